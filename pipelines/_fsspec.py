"""A directory on any fsspec filesystem, as sources and sinks name it: a URL, non-secret
fsspec options, and the names of environment variables holding the secret ones. It is a
plain value, shipped to executors as it is; each process reads the secrets from its own
environment when it opens the filesystem."""

import os
from dataclasses import dataclass, field
from urllib.parse import quote

from checkpoint_storage import StorageConfigurationError, url_to_fs
from resources import refuse_credentials

__all__ = ["FileSystemLocation", "partition_directory"]


@dataclass(frozen=True)
class FileSystemLocation:
    url: str
    storage_options: dict = field(default_factory=dict)
    storage_options_from_env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise ValueError(f"a URL or path is needed, got {self.url!r}")
        refuse_credentials(self.storage_options)

    def options(self) -> dict:
        """The fsspec options, secrets read from this process's environment now."""
        options = dict(self.storage_options)
        for option, variable in self.storage_options_from_env.items():
            value = os.environ.get(variable)
            if value is None:
                raise StorageConfigurationError(
                    f"fsspec option {option!r} of {self.url} comes from environment variable "
                    f"{variable!r}, which is not set in this process (pid {os.getpid()}): set "
                    "it on the driver and on every executor"
                )
            options[option] = value
        return options

    def filesystem(self, url: str | None = None):
        """``(fs, path)`` of ``url`` (default: this location's URL) with these options."""
        return url_to_fs(url or self.url, self.options())


def partition_directory(url: str, column: str, partition: str) -> str:
    """``<url>/<column>=<partition>``, the key escaped as Spark escapes partition values
    (``:`` in hourly keys becomes ``%3A``), so Spark, pyarrow and DuckDB read it back."""
    return f"{url.rstrip('/')}/{column}={quote(partition, safe='-_.+ ')}"

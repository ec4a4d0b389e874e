"""A directory on any fsspec filesystem, as sources and sinks name it: a URL, non-secret
fsspec options, and the names of environment variables holding the secret ones. It is a
plain value, shipped to executors as it is; each process reads the secrets from its own
environment when it opens the filesystem."""

from dataclasses import dataclass, field
from urllib.parse import quote

from checkpoint_storage import url_to_fs
from checkpoint_storage.spi import options_with_environment, refuse_credentials

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
        return options_with_environment(
            self.storage_options, self.storage_options_from_env, f"files at {self.url}"
        )

    def filesystem(self, url: str | None = None):
        """``(fs, path)`` of ``url`` (default: this location's URL) with these options."""
        return url_to_fs(url or self.url, self.options())


def partition_directory(url: str, column: str, partition: str) -> str:
    """``<url>/<column>=<partition>``, the key escaped as Spark escapes partition values
    (``:`` in hourly keys becomes ``%3A``), so Spark, pyarrow and DuckDB read it back."""
    return f"{url.rstrip('/')}/{column}={quote(partition, safe='-_.+ ')}"

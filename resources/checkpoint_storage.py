"""``CheckpointStorageResource``: the checkpoint storage configuration as a Dagster resource,
handing out plain ``checkpoint_storage`` objects."""

from dagster import ConfigurableResource
from pydantic import field_validator

from checkpoint_storage import FileSystemCheckpointStorage
from checkpoint_storage.spi import (
    DEFAULT_FILE_STATE_THRESHOLD,
    DEFAULT_MAX_FILE_SIZE,
    DEFAULT_WRITE_BUFFER_SIZE,
    refuse_credentials,
)

__all__ = ["CheckpointStorageResource"]

class CheckpointStorageResource(ConfigurableResource):
    """Where and how the pipelines checkpoint (Flink's ``state.checkpoints.dir`` and friends).

    - ``checkpoint_dir`` / ``savepoint_dir``: any fsspec URL (local path, ``s3://``, ...).
    - ``storage_options``: non-secret fsspec options (``endpoint_url``, ``region_name``...).
    - ``storage_options_from_env``: fsspec option -> environment variable, for credentials.
      They are read from the environment by each process that opens the storage, driver and
      executors, so they never travel inside the objects shipped to executors. (A
      ``dagster.EnvVar`` resolves on the driver only; S3 credentials in ``AWS_*`` variables
      need nothing here at all.)
    - ``file_merging_enabled``, ``file_merging_across_checkpoint_boundary``,
      ``file_merging_max_file_size``: Flink's ``execution.checkpointing.file-merging.*``.
      With both on and a local ``checkpoint_dir``, each keyed range's change files are
      appended to one physical file per snapshot instead of one file per batch.
    """

    checkpoint_dir: str
    savepoint_dir: str | None = None
    file_state_size_threshold: int = DEFAULT_FILE_STATE_THRESHOLD
    write_buffer_size: int = DEFAULT_WRITE_BUFFER_SIZE
    storage_options: dict[str, str] = {}
    storage_options_from_env: dict[str, str] = {}
    file_merging_enabled: bool = False
    file_merging_across_checkpoint_boundary: bool = False
    file_merging_max_file_size: int = DEFAULT_MAX_FILE_SIZE

    @field_validator("storage_options")
    @classmethod
    def _no_secrets(cls, options: dict[str, str]) -> dict[str, str]:
        return refuse_credentials(options)

    def checkpoint_storage(self) -> FileSystemCheckpointStorage:
        """A plain, picklable storage config object: safe to ship to executors."""
        return FileSystemCheckpointStorage(
            self.checkpoint_dir,
            self.savepoint_dir,
            file_state_size_threshold=self.file_state_size_threshold,
            write_buffer_size=self.write_buffer_size,
            storage_options=dict(self.storage_options),
            storage_options_from_env=dict(self.storage_options_from_env),
            file_merging_enabled=self.file_merging_enabled,
            file_merging_across_checkpoint_boundary=self.file_merging_across_checkpoint_boundary,
            file_merging_max_file_size=self.file_merging_max_file_size,
        )

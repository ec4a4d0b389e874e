"""``checkpoints``: look at and tidy checkpoint and savepoint directories (docs/cli.md)."""

from checkpoint_storage.cli.app import *  # noqa: F403
from checkpoint_storage.cli.app import __all__  # noqa: F401

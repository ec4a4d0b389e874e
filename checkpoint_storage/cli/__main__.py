"""``python -m checkpoint_storage.cli``: the ``checkpoints`` command."""

import sys

from checkpoint_storage.cli import main

sys.exit(main())

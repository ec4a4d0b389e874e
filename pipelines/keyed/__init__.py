"""Keyed state (Flink's keyed state with incremental checkpoints), independent of Spark.

A ``pipelines.KeyedStage`` declares key columns, a state schema, an optional ``StateTtl`` and
a vectorised Arrow function; a pipeline's author needs nothing from here. This package is
for those who look below a keyed stage: keys map to key groups (``assign_key_groups``,
``KeyGroupRange``, ``compute_key_group_range_for_operator_index``); each task keeps its range
in a local ``KeyedStateStore`` (``local_store_directory``, ``sweep_idle_stores``) and writes
its changes per batch as SHARED-scope change files; ``KeyedStateChain`` records, per range,
the latest full snapshot and the change files since (``chains_from_operator_state``,
``read_change_file``, ``read_full_snapshot``, ``replay_chains``). See docs/design.md,
"Keyed state".

The runner's machinery (``KeyedStageDriver``, ``apply_keyed_batch``,
``snapshot_keyed_state``, the writers of change files and full snapshots, ...) and the
stage types ``pipelines`` exports stay importable from here, outside ``__all__``.
"""

from checkpoint_storage.spi import lazy_names
from pipelines.keyed._aggregates import Aggregate, Aggregates, agg
from pipelines.keyed._chain import (
    CHAIN_FORMAT,
    KEYED_STATE_PREFIX,
    KeyedStateChain,
    KeyedStateFormatError,
    chains_from_operator_state,
    decode_keyed_master_state,
    read_change_file,
    read_full_snapshot,
    replay_chains,
)
from pipelines.keyed._key_groups import (
    DEFAULT_MAX_PARALLELISM,
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    assign_key_groups,
    compute_key_group_range_for_operator_index,
)
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout
from pipelines.keyed._local_stores import local_store_directory, sweep_idle_stores
from pipelines.keyed._stage import TimeMode, Watermark
from pipelines.keyed._store import ArrowKeyedStateStore
from pipelines.keyed._store_base import KeyedStateStore
from pipelines.keyed._store_directory import LocalStoreError
from pipelines.keyed._variables import ListState, MapState, StateChanges, ValueState

__all__ = [
    # declarative aggregates
    "Aggregate",
    "Aggregates",
    "agg",
    # timers and watermarks of a KeyedStage
    "TimeMode",
    "Watermark",
    # state variables (KeyedStage.with_variables)
    "ListState",
    "MapState",
    "StateChanges",
    "ValueState",
    # key groups
    "DEFAULT_MAX_PARALLELISM",
    "KEY_GROUP",
    "UPPER_BOUND_MAX_PARALLELISM",
    "KeyGroupRange",
    "assign_key_groups",
    "compute_key_group_range_for_operator_index",
    # keyed state in checkpoints
    "CHAIN_FORMAT",
    "KEYED_STATE_PREFIX",
    "KeyedStateChain",
    "KeyedStateFormatError",
    "KeyedStateLayout",
    "chains_from_operator_state",
    "decode_keyed_master_state",
    "read_change_file",
    "read_full_snapshot",
    "replay_chains",
    # local stores
    "ArrowKeyedStateStore",
    "KeyedStateStore",
    "LocalStoreError",
    "local_store_directory",
    "sweep_idle_stores",
]

# Names outside __all__ that this package exported before: where each one lives.
_ELSEWHERE = {
    "chains_to_operator_state": "pipelines.keyed._chain",
    "encode_keyed_master_state": "pipelines.keyed._chain",
    "rebuild_store": "pipelines.keyed._rebuild",
    "write_change_file": "pipelines.keyed._chain",
    "write_full_snapshot": "pipelines.keyed._chain",
    "KeyedStageDriver": "pipelines.keyed._driver",
    "KeyedStageState": "pipelines.keyed._driver",
    "KEY_HASH": "pipelines.keyed._key_groups",
    # out of __all__ for the budget (issue 27 added timers and state variables): a helper
    # of the runner's, the inverse of compute_key_group_range_for_operator_index
    "compute_operator_index_for_key_group": "pipelines.keyed._key_groups",
    "hash_keys": "pipelines.keyed._key_groups",
    "last_per_key": "pipelines.keyed._key_groups",
    "DEFAULT_LOCAL_STORE_MAX_AGE": "pipelines.keyed._local_stores",
    "OPERATOR_INDEX": "pipelines.keyed._routing",
    "ChainRef": "pipelines.keyed._task",
    "KeyedBatch": "pipelines.keyed._batch",
    "KeyedRangeResult": "pipelines.keyed._task",
    "KeyedStageTask": "pipelines.keyed._task",
    "FullSnapshotPolicy": "pipelines.keyed._batch",
    "apply_keyed_batch": "pipelines.keyed._batch",
    "chain_version": "pipelines.keyed._task",
    "extend_chains": "pipelines.keyed._batch",
    "snapshot_keyed_state": "pipelines.keyed._batch",
    "ranges_to_snapshot": "pipelines.keyed._batch",
    "read_keyed_state": "pipelines.keyed._batch",
    "snapshot_from_local_stores": "pipelines.keyed._batch",
    "check_evolution": "pipelines.keyed._evolution",
    "check_evolution_spec": "pipelines.keyed._evolution",
    "evolve_table": "pipelines.keyed._evolution",
    "widens": "pipelines.keyed._evolution",
    "KeyedResult": "pipelines.keyed._stage",
    "TIMER": "pipelines.keyed._stage",
    "TIMERS": "pipelines.keyed._stage",
    "KeyedStage": "pipelines.keyed._stage",
    "StateTtl": "pipelines.keyed._stage",
    "TtlTimeCharacteristic": "pipelines.keyed._stage",
    "key_type_fits": "pipelines.keyed._stage",
    "forget_verified_files": "pipelines.keyed._store_verification",
    "remove_store": "pipelines.keyed._store_directory",
    "TTL_TIME": "pipelines.keyed._variables",
    "VARIABLES_METADATA": "pipelines.keyed._variables",
    "StateVariables": "pipelines.keyed._variables",
    "StateView": "pipelines.keyed._variables",
    "VariablesApply": "pipelines.keyed._variables",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _ELSEWHERE)

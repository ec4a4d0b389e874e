"""Keyed state (Flink's keyed state with incremental checkpoints), independent of Spark.

A ``KeyedStage`` declares key columns, a state schema, an optional ``StateTtl`` and a
vectorised Arrow function. Keys map to key groups (``KeyGroupRange``,
``compute_key_group_range_for_operator_index``); each task keeps its range in a local
``KeyedStateStore`` and writes its changes per batch as SHARED-scope change files;
``KeyedStateChain`` records, per range, the latest materialisation and the change files since.
``apply_keyed_batch`` and ``materialise_keyed_state`` run a keyed stage on Spark executors.
See docs/design.md, "Keyed state".
"""

from pipelines.keyed._batch import (
    KeyedBatch,
    MaterialisationPolicy,
    apply_keyed_batch,
    extend_chains,
    materialise_keyed_state,
    ranges_to_materialise,
    read_keyed_state,
    rematerialise_from_local_stores,
)
from pipelines.keyed._chain import (
    CHAIN_FORMAT,
    KEYED_STATE_PREFIX,
    KeyedStateChain,
    KeyedStateFormatError,
    chains_from_operator_state,
    chains_to_operator_state,
    decode_keyed_master_state,
    encode_keyed_master_state,
    read_change_file,
    read_materialisation,
    rebuild_store,
    replay_chains,
    write_change_file,
    write_materialisation,
)
from pipelines.keyed._driver import KeyedStageDriver, KeyedStageState
from pipelines.keyed._key_groups import (
    DEFAULT_MAX_PARALLELISM,
    KEY_HASH,
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    assign_key_groups,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
    hash_keys,
    last_per_key,
)
from pipelines.keyed._layout import KEY_GROUP, KeyedStateLayout
from pipelines.keyed._local_stores import (
    DEFAULT_LOCAL_STORE_MAX_AGE,
    local_store_directory,
    sweep_idle_stores,
)
from pipelines.keyed._routing import OPERATOR_INDEX
from pipelines.keyed._stage import (
    KeyedResult,
    KeyedStage,
    StateTtl,
    TtlTimeCharacteristic,
    key_type_fits,
)
from pipelines.keyed._store import (
    ArrowKeyedStateStore,
    KeyedStateStore,
    LocalStoreError,
    forget_verified_files,
    remove_store,
)
from pipelines.keyed._task import ChainRef, KeyedRangeResult, KeyedStageTask, chain_version

__all__ = [
    "CHAIN_FORMAT",
    "DEFAULT_LOCAL_STORE_MAX_AGE",
    "DEFAULT_MAX_PARALLELISM",
    "KEYED_STATE_PREFIX",
    "KEY_GROUP",
    "KEY_HASH",
    "OPERATOR_INDEX",
    "UPPER_BOUND_MAX_PARALLELISM",
    "ArrowKeyedStateStore",
    "ChainRef",
    "KeyedBatch",
    "KeyedRangeResult",
    "KeyGroupRange",
    "KeyedResult",
    "KeyedStage",
    "KeyedStageTask",
    "KeyedStageDriver",
    "KeyedStageState",
    "KeyedStateChain",
    "KeyedStateFormatError",
    "KeyedStateLayout",
    "KeyedStateStore",
    "LocalStoreError",
    "MaterialisationPolicy",
    "StateTtl",
    "TtlTimeCharacteristic",
    "apply_keyed_batch",
    "assign_key_groups",
    "chain_version",
    "chains_from_operator_state",
    "chains_to_operator_state",
    "compute_key_group_range_for_operator_index",
    "compute_operator_index_for_key_group",
    "decode_keyed_master_state",
    "encode_keyed_master_state",
    "extend_chains",
    "forget_verified_files",
    "hash_keys",
    "key_type_fits",
    "last_per_key",
    "local_store_directory",
    "materialise_keyed_state",
    "ranges_to_materialise",
    "read_change_file",
    "read_keyed_state",
    "read_materialisation",
    "rebuild_store",
    "rematerialise_from_local_stores",
    "remove_store",
    "replay_chains",
    "sweep_idle_stores",
    "write_change_file",
    "write_materialisation",
]

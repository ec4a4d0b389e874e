"""The public surfaces: each package's ``__all__`` is a decision written down here, every name
in it exists and is documented, and what left ``__all__`` stays importable (docs/design.md,
"Public APIs").

A failure of ``test_public_surfaces_are_the_decided_ones`` means a package's ``__all__``
changed. Decide who needs the name (a pipeline's author, an operator, a Dagster definitions
author) and either add it to ``PUBLIC`` below (within ``BUDGET``), or export it from a module
below the package instead (``checkpoint_storage.spi`` for the storage layer's extension points,
``pipelines.runner``, ``pipelines.state_reader``, ...).
"""

import ast
import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BUDGET = 30
"""The most names a package's ``__all__`` may hold: what a reader takes in at once."""

PUBLIC = {
    "checkpoint_storage": {
        # storage
        "CheckpointStorage", "FileSystemCheckpointStorage", "JobID", "MemoryCheckpointStorage",
        "url_to_fs",
        # _metadata
        "CheckpointMetadata", "load_checkpoint_metadata", "metadata_as_json",
        # retention and restore
        "CheckpointRetentionPolicy", "RestoreMode",
        # finding, verifying, copying and deleting snapshots
        "CheckpointInfo", "GarbageCollectionResult", "VerificationProblem", "VerificationReport",
        "collect_garbage", "copy_savepoint", "dispose_savepoint", "latest_checkpoint",
        "list_checkpoints", "list_checkpoints_below", "verify_checkpoint",
        # the job lease
        "LeaseRecord", "break_job_lease", "read_job_lease",
        # errors
        "CheckpointNotFoundError", "CheckpointStorageError", "CommitStateUnknownError",
        "InvalidCheckpointError", "JobLeaseHeldError", "JobLeaseLostError",
    },
    "pipelines": {
        # the pipeline spec and its stages
        "SOURCE", "KeyedResult", "KeyedStage", "FullSnapshotPolicy", "Stage",
        "StatefulPipeline", "StateTtl", "TtlTimeCharacteristic", "agg",
        # sources and sinks
        "FileSource", "ParquetSink", "Sink", "Source", "SparkReadSource", "SparkWriterSink",
        # running without Dagster
        "CheckpointSummary", "PartitionResult", "SourcePosition", "StatefulRunner", "job_id_for",
        "write_savepoint",
        # what a run raises
        "BatchListChangedError", "ClaimRefusedError", "CorruptStateError", "MissingStateError",
        "StageError",
        # reading state
        "StateReadError", "UnknownStageError", "read_state", "state_stages",
    },
    "pipelines.keyed": {
        # declarative aggregates
        "Aggregate", "Aggregates", "agg",
        # timers and watermarks of a KeyedStage
        "TimeMode", "Watermark",
        # state variables
        "ListState", "MapState", "StateChanges", "ValueState",
        # key groups
        "DEFAULT_MAX_PARALLELISM", "KEY_GROUP", "UPPER_BOUND_MAX_PARALLELISM", "KeyGroupRange",
        "assign_key_groups", "compute_key_group_range_for_operator_index",
        # keyed state in checkpoints
        "CHAIN_FORMAT", "KEYED_STATE_PREFIX", "KeyedStateChain", "KeyedStateFormatError",
        "KeyedStateLayout", "chains_from_operator_state", "decode_keyed_master_state",
        "read_change_file", "read_full_snapshot", "replay_chains",
        # local stores
        "ArrowKeyedStateStore", "KeyedStateStore", "LocalStoreError", "local_store_directory",
        "sweep_idle_stores",
    },
    "resources": {
        "DEFAULT_SPARK_CONF", "CheckpointStorageResource", "SparkResource", "build_spark_session",
        "add_session_python_path", "on_session_created",
    },
    "sensors": {
        # a pipeline's definitions, from Python or from defs.yaml
        "ImportReference", "PartitionsSpec", "StatefulPipelineComponent", "pipeline_definitions",
        # each definition on its own
        "build_recovery_sensor", "build_retention_sensor", "build_savepoint_job",
        "build_savepoint_schedule", "build_stateful_assets",
        # configuration
        "RetentionPolicy", "SavepointConfig", "StatefulRunConfig",
        # names runs and checks carry
        "INTEGRITY_CHECK", "INTERRUPTED_TAG", "RECOVERY_ATTEMPT_TAG", "RECOVERY_OF_TAG",
        "RECOVERY_ROOT_TAG", "SAVEPOINT_KIND_TAG", "pool_for",
        # what a pipeline retains, and retention by hand
        "RetainedSnapshot", "RetentionReport", "apply_retention", "retained_snapshots",
    },
}

DOCUMENTED = [
    *PUBLIC, "checkpoint_storage.spi", "checkpoint_storage.exceptions", "checkpoint_storage.flink",
]

# docs/design.md §3.1 maps Flink's names to these: code written against it imports them from
# the package, whichever surface documents them now.
FLINK_NAMES = [
    "CheckpointStorage", "FileSystemCheckpointStorage", "MemoryCheckpointStorage",
    "CheckpointStorageAccess", "CheckpointStorageCoordinatorView", "CheckpointStorageWorkerView",
    "CheckpointStreamFactory", "CheckpointStateOutputStream", "CheckpointStorageLocation",
    "CheckpointMetadataOutputStream", "CompletedCheckpointStorageLocation",
    "CheckpointStorageLocationReference", "encode_path_as_reference",
    "decode_path_from_reference", "ByteStreamStateHandle", "FileStateHandle",
    "RelativeFileStateHandle", "SegmentFileStateHandle", "CheckpointedStateScope",
    "CheckpointMetadata", "SharedStateRegistry", "CompletedCheckpointStore", "JobID",
]

# Aliases removed for one name per concept: (module, old name, where the concept lives now).
REMOVED_ALIASES = [
    ("pipelines", "POSITION_STATE", "checkpoint_storage.spi.SOURCE_POSITION_STATE"),
    ("pipelines.runner", "POSITION_STATE", "checkpoint_storage.spi.SOURCE_POSITION_STATE"),
    ("pipelines", "PIPELINE_NAME_STATE", "checkpoint_storage.spi.JOB_NAME_STATE"),
    ("pipelines.runner", "PIPELINE_NAME_STATE", "checkpoint_storage.spi.JOB_NAME_STATE"),
    ("pipelines.runner", "SCHEMA_STATE_PREFIX", "checkpoint_storage.spi.STATE_SCHEMA_PREFIX"),
    ("resources", "refuse_credentials", "checkpoint_storage.spi.refuse_credentials"),
    ("checkpoint_storage._file_merging", "EXCLUSIVE", "CheckpointedStateScope.EXCLUSIVE"),
    ("checkpoint_storage._file_merging", "SHARED", "CheckpointedStateScope.SHARED"),
]


def test_public_surfaces_are_the_decided_ones():
    """Each package's ``__all__`` is exactly the set decided above, without repeats, and
    within the budget (see the module docstring for what to do when this fails)."""
    actual = {name: importlib.import_module(name).__all__ for name in PUBLIC}

    assert {name: sorted(names) for name, names in PUBLIC.items()} == {
        name: sorted(names) for name, names in actual.items()}
    assert {name: len(set(names)) for name, names in actual.items()} == {
        name: len(names) for name, names in actual.items()}
    assert {name: True for name in PUBLIC} == {
        name: len(names) <= BUDGET for name, names in actual.items()}


@pytest.mark.parametrize("module", DOCUMENTED)
def test_every_exported_name_exists_and_has_a_docstring(module):
    """``from <module> import *`` works, and every name in ``__all__`` is documented: a class
    or function by its own docstring (not one inherited from ``Enum`` or generated by
    ``dataclass``), a constant by the string literal after its assignment (what pdoc shows)."""
    namespace = {}
    exec(f"from {module} import *", namespace)
    imported = importlib.import_module(module)

    undocumented = [name for name in imported.__all__
                    if not _documented(getattr(imported, name), name, imported)]

    assert set(imported.__all__) <= set(namespace)
    assert [] == undocumented


def test_the_spi_module_holds_the_extension_points_and_none_of_the_users_names():
    """``checkpoint_storage.spi`` documents the Flink extension points (streams, handles,
    registries, reference encoding); no name is in both it and the package's ``__all__``."""
    import checkpoint_storage
    from checkpoint_storage import spi

    assert {"CheckpointStreamFactory", "CheckpointStateOutputStream", "StreamStateHandle",
            "SharedStateRegistry", "encode_path_as_reference", "decode_path_from_reference",
            "CheckpointStorageLocationReference"} <= set(spi.__all__)
    assert set() == set(spi.__all__) & set(checkpoint_storage.__all__)


def test_names_outside_all_stay_importable_from_their_package():
    """Existing code keeps working: docs/design.md's Flink names, every extension point,
    every exception and the Flink reader's names import from ``checkpoint_storage``, as the
    same objects as from their documented module; every name a package exported before
    imports from it still."""
    import checkpoint_storage
    from checkpoint_storage import exceptions, flink, spi

    for name in [*FLINK_NAMES, *spi.__all__]:
        assert getattr(spi, name, None) is getattr(checkpoint_storage, name) or name in (
            checkpoint_storage.__all__), name
    for name in exceptions.__all__:
        assert getattr(exceptions, name) is getattr(checkpoint_storage, name)
    for name in flink.__all__:  # exported by the package before checkpoint_storage.flink
        assert getattr(flink, name) is getattr(checkpoint_storage, name), name
    assert sorted(flink.__all__) == sorted(checkpoint_storage._FLINK_NAMES)
    for package in ("pipelines", "pipelines.keyed", "sensors"):
        imported = importlib.import_module(package)
        kept = imported._ELSEWHERE
        assert set() == set(kept) & set(imported.__all__)
        assert {name: True for name in kept} == {
            name: getattr(imported, name) is getattr(importlib.import_module(module), name)
            for name, module in kept.items()}
        assert set(kept) <= set(dir(imported))


def test_an_unknown_name_is_still_an_attribute_error():
    """The lazy lookups of names outside ``__all__`` answer a typo as Python does."""
    for package in ("checkpoint_storage", "pipelines", "pipelines.keyed", "sensors"):
        with pytest.raises(ImportError, match="PIPELINE_NAME_STATE"):
            exec(f"from {package} import PIPELINE_NAME_STATE", {})


@pytest.mark.parametrize(("module", "old", "new"), REMOVED_ALIASES)
def test_removed_aliases_are_gone(module, old, new):
    """One name per concept: each alias is gone (its concept lives at ``new``)."""
    assert not hasattr(importlib.import_module(module), old), f"{module}.{old}: use {new}"


def _documented(obj, name: str, module) -> bool:
    if inspect.ismodule(obj):
        return bool(inspect.getdoc(obj))
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__") or ""
        generated = doc.startswith(f"{obj.__name__}(")  # dataclass's signature stand-in
        return bool(doc.strip()) and not generated
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return bool(inspect.getdoc(obj))
    return name in _variable_docstrings(module.__name__.split(".")[0])


def _variable_docstrings(package: str) -> set[str]:
    """Module-level names in ``package``'s sources that a string literal follows (PEP 257's
    attribute docstrings, which pdoc shows)."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        body = ast.parse(path.read_text()).body
        for node, following in zip(body, body[1:], strict=False):
            documented = (isinstance(following, ast.Expr)
                          and isinstance(following.value, ast.Constant)
                          and isinstance(following.value.value, str))
            if not documented:
                continue
            if isinstance(node, ast.Assign):
                found.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)
    return found


@pytest.mark.timeout(300)
def test_the_api_reference_documents_the_narrowed_surfaces(tmp_path):
    """scripts/api-docs documents each package's ``__all__`` and nothing beside it, and the
    extension points and the Flink reader on pages of their own (checkpoint_storage/spi.html,
    checkpoint_storage/flink.html)."""
    subprocess.run([str(ROOT / "scripts" / "api-docs"), str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, timeout=280)

    def documented(page: str) -> set[str]:
        text = (tmp_path / page).read_text()
        return set(re.findall(r'<section id="([A-Za-z_][A-Za-z0-9_]*)">', text))

    from checkpoint_storage import flink, spi

    assert PUBLIC["checkpoint_storage"] == documented("checkpoint_storage.html")
    assert set(spi.__all__) == documented("checkpoint_storage/spi.html")
    assert set(flink.__all__) == documented("checkpoint_storage/flink.html")
    assert PUBLIC["pipelines.keyed"] == documented("pipelines/keyed.html")
    assert PUBLIC["sensors"] == documented("sensors.html")

"""A pipeline's Dagster assets: the stateful multi-asset (its state, its sinks and the
``checkpoint_integrity`` check of the state).

No ``from __future__ import annotations`` here: Dagster reads the ``config`` parameters'
annotations at definition time.
"""

import os
import threading
from collections.abc import Sequence
from pathlib import Path

import dagster as dg
from pydantic import Field

from checkpoint_storage import (
    CheckpointMetadata,
    CheckpointNotFoundError,
    InvalidCheckpointError,
    RestoreMode,
    list_checkpoints,
)
from checkpoint_storage.spi import StreamStateHandle, format_size, verify_state_handles
from pipelines import CheckpointSummary, PartitionResult, StatefulPipeline, StatefulRunner
from pipelines.local_recovery import prefetch_local_stores
from pipelines.runner import check_restore_from, damaged_state
from pipelines.statistics import statistics_metadata
from resources import CheckpointStorageResource, SparkResource
from sensors._retained import (
    EVENT_KEY,
    MATERIALIZATION_EVENT,
    WITHOUT_METADATA,
    retained_metadata,
)
from sensors.recovery import run_lease_owner

__all__ = [
    "FAULT_INJECTION_ENV",
    "FAULT_TAG",
    "INTEGRITY_CHECK",
    "StatefulRunConfig",
    "integrity_check_result",
    "build_stateful_assets",
    "pool_for",
    "runner_for",
    "sink_asset_key",
]

# --- test seam: a real failure in a real run (off by default) -------------------------
# The end-to-end tests need a run that fails midway in the real processes, without mocks, so
# that the recovery sensor has something to recover. Only when the code location's
# environment has PIPELINE_FAULT_INJECTION=1 does a run tagged ``test/fail_after_batch=<k>``
# raise right after applying its k-th batch (counted from 1 within a partition, before that
# position's checkpoint). Without the env var the tag is ignored; recovery runs do not carry
# the failed run's tags, so they run through.
FAULT_INJECTION_ENV = "PIPELINE_FAULT_INJECTION"
FAULT_TAG = "test/fail_after_batch"
INTEGRITY_CHECK = "checkpoint_integrity"
"""The name of the asset check that verifies a pipeline's checkpoint."""


class InjectedFault(RuntimeError):
    """The failure the test seam injects (never raised unless enabled, see above)."""


# With ``test/hang_after_batch=<k>`` the run instead stops right after its k-th batch and waits
# forever (to be killed), having written its process id into ``<PIPELINE_FAULT_MARKER_DIR>/
# <partition>.pid``: a test kills the run worker at a known point, never by timing luck.
HANG_TAG = "test/hang_after_batch"
FAULT_MARKER_DIR_ENV = "PIPELINE_FAULT_MARKER_DIR"


def _hang(partition: str) -> None:
    marker = Path(os.environ[FAULT_MARKER_DIR_ENV]) / f"{partition}.pid"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.with_suffix(".tmp").write_text(str(os.getpid()))
    marker.with_suffix(".tmp").rename(marker)
    threading.Event().wait()


def _fault_hook(tags: dict[str, str]):
    if os.environ.get(FAULT_INJECTION_ENV) != "1" or not {FAULT_TAG, HANG_TAG} & set(tags):
        return None
    after = int(tags.get(FAULT_TAG, tags.get(HANG_TAG, 0)))

    def hook(point: str, **info) -> None:
        if point == "batch_applied" and info.get("batch", -1) + 1 == after and HANG_TAG in tags:
            _hang(str(info.get("partition")))
        if point == "batch_applied" and info.get("batch", -1) + 1 == after:
            raise InjectedFault(
                f"injected fault ({FAULT_TAG}={after}) after batch {after} of "
                f"{info.get('partition')}"
            )

    return hook


def runner_for(
    pipeline: StatefulPipeline,
    spark: SparkResource,
    checkpoint_storage: CheckpointStorageResource,
    *,
    session_when_used: bool = False,
    **options,
) -> StatefulRunner:
    """The pipeline's runner, from resources (which stay here on the driver: only the plain
    storage object they hand out reaches the executors). ``session_when_used``: the Spark
    session is asked of the resource (started) only when the runner first uses it."""
    session = _SessionWhenUsed(spark) if session_when_used else spark.session
    return StatefulRunner(session, checkpoint_storage.checkpoint_storage(), pipeline, **options)


class _SessionWhenUsed:
    """A ``SparkResource``'s session, asked for at the first use of one of its attributes.
    The integrity check run alone replays a small state in the driver and needs no session;
    a session's start (the JVM's, 4-6 s) was most of that run (docs/benchmarks.md)."""

    def __init__(self, resource: SparkResource) -> None:
        self._resource = resource

    def __getattr__(self, name: str):
        return getattr(self._resource.session, name)


def pool_for(pipeline: StatefulPipeline) -> str:
    """The Dagster concurrency pool of every step that writes ``pipeline``'s checkpoints (the
    stateful asset, the savepoint job): with a limit of 1 on the instance a second run waits
    in the queue instead of racing the first for the job directory."""
    return f"checkpoints_{pipeline.name}"


def sink_asset_key(pipeline: StatefulPipeline, sink_name: str) -> dg.AssetKey:
    return dg.AssetKey(f"{pipeline.name}_{sink_name}")


class StatefulRunConfig(dg.Config):
    """Where the state comes from. By default the newest retained checkpoint that fits the
    first partition of the run; ``restore_from`` names a checkpoint or savepoint instead
    (backfill from a savepoint). ``restore_mode``: NO_CLAIM never deletes the restored
    snapshot; CLAIM hands it to retention."""

    restore_from: str | None = Field(
        default=None,
        description="Leave empty to continue from the newest retained checkpoint. Otherwise "
        "the pointer of a checkpoint or savepoint to start from: its directory, as a local "
        "path, a file: URL or an fsspec URL (s3://bucket/savepoints/savepoint-2b2376-"
        "0123456789ab, /data/checkpoints/<job id>/chk-42). It must hold the state at the end of "
        "the partition before the first one of this run (or inside that first partition). "
        "Find pointers on the state asset's page: the `retained` table of its newest event "
        "(column pointer, with each one's partition), `checkpoint_pointer` on a "
        "materialization, `savepoint_pointer` on a savepoint's observation; or with "
        "`checkpoints list <checkpoint or savepoint dir>`.",
    )
    restore_mode: RestoreMode = Field(
        default=RestoreMode.NO_CLAIM,
        description="NO_CLAIM: the restored snapshot is never deleted by this pipeline. CLAIM: "
        "it is handed to retention, which deletes it once newer checkpoints subsume it (a "
        "savepoint, or a checkpoint of this pipeline's own job directory; another job's "
        "checkpoint is refused before any Spark work).",
    )
    allow_non_restored_state: bool = Field(
        default=False,
        description="Restore a snapshot that holds the state of stages the pipeline no longer "
        "has, leaving that state behind (Flink's allowNonRestoredState). Without it such a "
        "restore is refused, naming the stages. See docs/pipelines.md, \"Upgrading a "
        "pipeline\".",
    )


def _materializations(pipeline: StatefulPipeline, result: PartitionResult, retained: dict):
    checkpoint = result.checkpoint
    rows = {f"rows_{name}": count for name, count in result.rows.items()}
    state_rows = {f"state_rows_{name}": n for name, n in checkpoint.state_rows.items()}
    state_rows |= expired_rows_metadata(checkpoint)
    yield dg.AssetMaterialization(
        pipeline.name,
        partition=result.partition,
        # The UI's event list shows no label: the description says what this is first.
        description=f"Materialization of partition {result.partition}: checkpoint "
        f"{checkpoint.checkpoint_id} at {checkpoint.position}",
        metadata={
            EVENT_KEY: MATERIALIZATION_EVENT,
            "checkpoint_pointer": dg.MetadataValue.path(checkpoint.pointer),
            "checkpoint_id": checkpoint.checkpoint_id,
            "restored_from": result.restored_from or "none: started from empty state",
            "source_position": str(checkpoint.position),
            "state_bytes": checkpoint.state_bytes,
            "state_size": format_size(checkpoint.state_bytes),
            "files_written": checkpoint.files_written,
            "inline_states": checkpoint.inline_states,
            "checkpoints_taken": len(result.checkpoints_taken),
            "batches_applied": result.batches_applied,
            "duration_s": round(result.duration_s, 3),
            **rows,
            **state_rows,
            **statistics_metadata(checkpoint.statistics),
            **({"rewound": result.rewound} if result.rewound else {}),
            **retained,
        },
    )
    for sink in pipeline.sinks:
        yield dg.AssetMaterialization(
            sink_asset_key(pipeline, sink.name),
            partition=result.partition,
            metadata={
                "path": dg.MetadataValue.path(sink.location(result.partition)),
                "stage": sink.stage,
                "of": sink.of,
            },
        )


def expired_rows_metadata(summary: CheckpointSummary) -> dict:
    """``expired_rows_<stage>``: rows a keyed stage's TTL expired that the state still holds
    (``state_rows_<stage>`` counts the live ones); left out where it is not known, so that
    the entry stays numeric (Dagster plots it)."""
    return {f"expired_rows_{name}": n for name, n in summary.expired_rows.items()
            if n is not None}


def build_stateful_assets(pipeline: StatefulPipeline) -> dg.AssetsDefinition:
    """The stateful multi-asset: the pipeline's state (asset ``<name>``) and one asset per
    sink (``<name>_<sink>``), partitioned like the pipeline, single-run backfills, the state
    depending on its own previous partition; with the ``checkpoint_integrity`` check of the
    state, which a run that materializes it evaluates on the last checkpoint it wrote (so a
    backfill ends with a result, not a skipped check), and which runs alone too. Each
    partition's materialization carries its checkpoint's metadata and the ``retained``
    table."""
    name = pipeline.name
    upstream = [dep.key for dep in pipeline.deps]
    # The state after partition P is the state after the one before P, plus P's input.
    # Dagster allows an asset to depend on itself only across time windows; for static
    # partitions the runner alone enforces the order (MissingStateError names what is
    # missing).
    if isinstance(pipeline.partitions_def, dg.TimeWindowPartitionsDefinition):
        upstream.append(
            dg.AssetDep(
                name,
                partition_mapping=dg.TimeWindowPartitionMapping(start_offset=-1, end_offset=-1),
            )
        )
    state = dg.AssetSpec(
        name,
        group_name=name,
        kinds={"spark"},
        description=pipeline.description
        or f"The state of pipeline {name} (stages: "
        f"{', '.join(s.name for s in pipeline.stages)}), checkpointed every "
        f"{pipeline.checkpoint_interval} batches and at the end of each partition.",
        deps=upstream,
        skippable=True,
    )
    sinks = [
        dg.AssetSpec(
            sink_asset_key(pipeline, sink.name),
            group_name=name,
            kinds={"parquet"},
            description=f"{sink.of} of stage {sink.stage}, per partition "
            f"({type(sink).__name__}); a re-run replaces its partition.",
            deps=[name],
            skippable=True,
        )
        for sink in pipeline.sinks
    ]

    @dg.multi_asset(
        name=name,
        specs=[state, *sinks],
        check_specs=[
            dg.AssetCheckSpec(
                INTEGRITY_CHECK,
                asset=name,
                description="The state files validate (size and CRC-32, read whole): after a "
                "materialization, every file its checkpoints newly reference, and the whole "
                "last checkpoint it wrote, restored with each stage's rows as recorded, when "
                "the run started a keyed chain anew (snapshotted) or the state is not keyed; "
                "run alone, the whole newest checkpoint with a `_metadata`. A file that does "
                "not verify is named with its stage, key-group range and what the next run "
                "does about it.",
            )
        ],
        partitions_def=pipeline.partitions_def,
        # One run processes a backfill's partitions in order, in one Spark session.
        backfill_policy=dg.BackfillPolicy.single_run(),
        # Subsettable for the check alone (``<name>_integrity_job``); a selection of any of
        # the assets runs the whole step, which writes the state and every sink together.
        can_subset=True,
        pool=pool_for(pipeline),
    )
    def stateful_asset(
        context: dg.AssetExecutionContext,
        config: StatefulRunConfig,
        spark: SparkResource,
        checkpoint_storage: CheckpointStorageResource,
    ):
        checked = bool(context.selected_asset_check_keys)
        if not context.selected_asset_keys:  # the check alone (``<name>_integrity_job``)
            result = integrity_check_result(
                pipeline, runner_for(pipeline, spark, checkpoint_storage, session_when_used=True)
            )
            # Logged as an evaluation, not yielded: a yielded result looks up its target
            # materialization through the state's dependency on its previous partition,
            # which Dagster cannot map in a run without partitions. It targets no
            # materialization anyway: it checks what is in storage now.
            context.log_event(
                dg.AssetCheckEvaluation(
                    asset_key=dg.AssetKey(name), check_name=INTEGRITY_CHECK,
                    passed=result.passed, metadata=result.metadata,
                    description=result.description,
                )
            )  # fmt: skip
            return
        if config.restore_from is not None and context.partition_keys:
            # Storage only, before the Spark session exists: a savepoint that is missing or
            # does not fit the range fails here, with the reason, and no Spark work was done.
            position = check_restore_from(
                checkpoint_storage.checkpoint_storage(),
                config.restore_from,
                context.partition_keys[0],
                pipeline,
                config.restore_mode,
                allow_non_restored_state=config.allow_non_restored_state,
            )
            mode = RestoreMode(config.restore_mode).value
            context.log.info(f"restoring from {config.restore_from} ({position}, {mode})")
        keys = context.partition_keys
        context.log.info(
            f"{name}: {len(keys)} partition(s), {keys[0]}"
            + (f" to {keys[-1]}" if len(keys) > 1 else "")
            + f"; Spark master {spark.master}"
        )
        if config.restore_from is None and spark.master.startswith("local"):
            # The executors share this disk: the local stores are rebuilt from the newest
            # checkpoint while the JVM starts (a task uses one only if it holds its chains).
            prefetch_local_stores(checkpoint_storage.checkpoint_storage(), pipeline)
        fault_hook = _fault_hook(context.run.tags)  # test seam, None unless enabled
        runner = runner_for(
            pipeline, spark, checkpoint_storage, fault_hook=fault_hook,
            lease_owner=run_lease_owner(context.run.run_id),
        )

        def record(result: PartitionResult) -> None:
            # Each partition is recorded as soon as its checkpoint completed, so a run that
            # fails later keeps the partitions it finished.
            retained = retained_metadata(runner.storage, pipeline.name)
            for event in _materializations(pipeline, result, retained):
                context.log_event(event)

        results = runner.run(
            context.partition_keys,
            restore_from=config.restore_from,
            restore_mode=config.restore_mode,
            allow_non_restored_state=config.allow_non_restored_state,
            on_partition_done=record,
            on_progress=context.log.info,
        )
        if checked:
            # A check result in every run that materializes the state (a backfill too),
            # for the checkpoint this run wrote last.
            yield integrity_check_result(
                pipeline, runner, results[-1].checkpoint.pointer, results=results
            )

    return stateful_asset


def _identity(handle: StreamStateHandle) -> tuple:
    return (getattr(handle, "path", None), getattr(handle, "start_position", None),
            handle.state_size, getattr(handle, "checksum", None))  # fmt: skip


def _load(runner: StatefulRunner, pointer: str | None) -> CheckpointMetadata | None:
    """The `_metadata` at ``pointer``; None if there is none (retention removed it)."""
    if pointer is None:
        return None
    try:
        return runner.access.resolve_checkpoint(pointer).load_metadata()
    except (CheckpointNotFoundError, InvalidCheckpointError):
        return None


def _run_scope(
    pipeline: StatefulPipeline, runner: StatefulRunner, results: Sequence[PartitionResult]
) -> tuple[list[StreamStateHandle], list[CheckpointMetadata], str | None]:
    """The handles the run's checkpoints newly reference (not in the snapshot it restored,
    whose files the runner verified before restoring them), the run's checkpoints still
    retained, and why the whole last checkpoint is to be verified too (None: no need)."""
    written = [c for r in results for c in r.checkpoints_taken]
    metadatas = [m for m in (_load(runner, c.pointer) for c in written) if m is not None]
    origin = results[0].restored_from
    restored = _load(runner, origin)
    inherited = set() if restored is None else {_identity(h) for h in restored.all_handles()}
    new = {}
    for metadata in metadatas:
        for handle in metadata.all_handles():
            if _identity(handle) not in inherited:
                new.setdefault(_identity(handle), handle)
    if not pipeline.keyed_stages:
        why = "the state is snapshotted whole"
    elif origin is not None and restored is None:
        why = f"the restored snapshot {origin} is gone: its files cannot be told apart"
    elif any(
        s.properties.get("keyed.materialised") == "true"
        and s.handles
        and _identity(s.handles[0]) in new
        for m in metadatas
        for op in m.operator_states
        for s in op.subtask_states.values()
    ):
        why = "the run snapshotted keyed ranges (a new chain starts)"
    else:
        why = None
    return list(new.values()), metadatas, why


def integrity_check_result(
    pipeline: StatefulPipeline,
    runner: StatefulRunner,
    pointer: str | None = None,
    *,
    results: Sequence[PartitionResult] | None = None,
) -> dg.AssetCheckResult:
    """``checkpoint_integrity`` of the checkpoint at ``pointer`` (default: the newest one of
    the pipeline with a `_metadata`, which must be a valid one of ours, not corrupt, foreign
    or unreadable). After a run (``results``): every file its checkpoints newly reference
    verifies (size and CRC-32); the whole checkpoint at ``pointer`` verifies and restores with
    each stage's rows as recorded when the run snapshotted a keyed range (once per
    full snapshot cycle, when the chain is shortest) or the state is not keyed. Alone: the
    whole checkpoint. A file that does not verify fails the check (ERROR) with its stage,
    key-group range and what the next run does. Read-only: it never deletes or creates
    anything."""

    def result(passed: bool, description: str | None = None, **metadata):
        return dg.AssetCheckResult(
            passed=passed, asset_key=pipeline.name, check_name=INTEGRITY_CHECK,
            description=description, metadata=metadata,
        )  # fmt: skip

    if pointer is None:
        storage = runner.storage
        directory = runner.access.checkpoints_directory
        try:
            found = list_checkpoints(directory, storage_options=storage.storage_options)
        except FileNotFoundError:
            found = []
        with_metadata = [c for c in found if c.status not in WITHOUT_METADATA]
        if not with_metadata:
            return result(False, f"no completed checkpoint in {directory}")
        newest = with_metadata[-1]
        if not newest.completed:
            return result(
                False,
                f"the newest checkpoint {newest.pointer} is {newest.status}: {newest.reason}",
                checkpoint_pointer=dg.MetadataValue.path(newest.pointer),
            )
        pointer = newest.pointer
    location = runner.access.resolve_checkpoint(pointer)
    try:
        snapshot = location.load_metadata()
    except InvalidCheckpointError as exc:
        return result(False, str(exc), checkpoint_pointer=dg.MetadataValue.path(pointer))
    checked = [snapshot]
    if results is None:
        handles, whole = snapshot.all_handles(), "the check runs alone"
    else:
        handles, checked, whole = _run_scope(pipeline, runner, results)
        if whole is not None:
            handles = [*handles, *snapshot.all_handles()]
    bytes_read, problems = verify_state_handles(handles)
    metadata = {
        "checkpoint_pointer": dg.MetadataValue.path(pointer),
        "checkpoint_id": snapshot.checkpoint_id,
        "handles_checked": len(handles),
        "bytes_read": bytes_read,
        "verified": f"the whole checkpoint ({whole})" if whole else "the files new in this run",
    }
    if problems:
        damaged = {}
        unique = {m.checkpoint_id: m for m in [*checked, snapshot]}
        for checked_metadata in unique.values():
            for d in damaged_state(checked_metadata, problems):
                damaged.setdefault(str(d), []).append(f"chk-{checked_metadata.checkpoint_id}")
        in_newest = [p for p in problems if damaged_state(snapshot, [p])]
        next_run = (
            runner.restore_advice(pointer, in_newest) if in_newest
            else "The last checkpoint does not reference these files; do not restore the "
            "checkpoints that do."
        )  # fmt: skip
        files = "; ".join(f"{p.kind}: {p.path}: {p.reason}" for p in problems[:5])
        metadata |= {
            "bad_files": "\n".join(f"{p.kind}: {p.path}" for p in problems),
            "damaged": "\n".join(f"{d} (in {', '.join(ids)})" for d, ids in damaged.items()),
            "next_run": next_run,
        }
        return result(False, f"{len(problems)} problem(s): {files}. {next_run}", **metadata)
    if not whole:
        return result(True, **metadata)
    # Expired keyed rows too: the recorded counts include them until they are dropped. A
    # small state is replayed in the driver, without a Spark job.
    try:
        restored = runner.restored_row_counts(snapshot, pointer)
    except (InvalidCheckpointError, OSError) as exc:  # a chain that does not replay
        return result(False, f"the checkpoint does not restore: {exc}", **metadata)
    recorded = {
        op.operator_id: sum(int(s.properties.get("rows", -1)) for s in op.subtask_states.values())
        for op in snapshot.operator_states
    }
    metadata |= {f"restored_rows_{name}": n for name, n in restored.items()}
    if restored != recorded:
        return result(
            False, f"restored rows {restored} differ from the recorded {recorded}", **metadata
        )
    return result(True, **metadata)

"""What runs on the executors for a keyed stage: the body of one range's task for a batch
(bring the local store to the shipped chain, run the stage, write the change file), for a
full snapshot (write a snapshot of the range) and for a replay (read the range's state)
(docs/design.md, "Keyed state", 7.5).
"""

import datetime as dt
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from checkpoint_storage import CheckpointStorage, FileSystemCheckpointStorage
from checkpoint_storage.spi import ByteStreamStateHandle, SubtaskKey, is_appended_segment
from pipelines.keyed._chain import (
    KeyedStateChain,
    iter_replay_chains,
    write_change_file,
    write_full_snapshot,
)
from pipelines.keyed._key_groups import (
    KeyGroupRange,
    group_hash_order,
    hash_keys,
    in_group_hash_order,
)
from pipelines.keyed._layout import KeyedStateLayout, concat_as
from pipelines.keyed._local_stores import (
    _local_root,
    _locked_store,
    local_store_directory,
    sweep_idle_stores,
    sweep_other_ranges,
)
from pipelines.keyed._memory import release_arrow_memory
from pipelines.keyed._routing import (
    _NEWEST,
    _ROUTE,
    _ROWS,
    _SUMMARY_INDEX,
    OPERATOR_INDEX,
    _routes,
)
from pipelines.keyed._stage import TIMERS, WRITTEN_AT, TtlTimeCharacteristic
from pipelines.keyed._task import (
    _CHANGE,
    _EPOCH,
    _FULL_SNAPSHOT,
    _LATE,
    _NO_LOCAL_STORE,
    _OUTPUT,
    _OUTPUT_ROWS_PER_PAYLOAD,
    _RESULT_SCHEMA,
    _SUMMARY,
    KeyedStageTask,
    _context,
    _handle_row,
    _micros,
    _newer,
    chain_version,
)
from pipelines.keyed._timers import due_mask, fire, fold, merge_changes


def _change_file_storage(storage: CheckpointStorage,
                         chain: KeyedStateChain) -> CheckpointStorage:
    """The storage a range's next change file is written through. An inline state is
    repeated in every ``_metadata`` until its chain is snapshotted, so a chain's inline
    states (its snapshot and change files) share one inline threshold: past it, change files
    go to files. Each ``_metadata`` then repeats at most that threshold per range."""
    if not isinstance(storage, FileSystemCheckpointStorage):
        return storage
    inline = sum(h.state_size for h in (chain.full_snapshot, *chain.changes)
                 if isinstance(h, ByteStreamStateHandle))
    return storage.with_file_state_size_threshold(
        max(0, storage.file_state_size_threshold - inline))


def _file_prefix(task: KeyedStageTask, key_groups: KeyGroupRange, kind: str,
                 attempt: int) -> str:
    """``<stage>-kg<start>-<end>-<kind><batch>-a<attempt>-``, the stage name shortened so
    that the prefix fits the 64 characters a stream's name prefix may have."""
    tail = f"-kg{key_groups.start}-{key_groups.end}-{kind}{task.batch}-a{attempt}-"
    return task.stage.name[:64 - len(tail)] + tail


def _run_partition(task: KeyedStageTask,
                   batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body after routing: the routing tasks' summaries and the rows of one
    range (or none). Advances the clock by the batch's newest event time, drops (and
    counts) the late rows: behind the watermark, or without one the clock minus the
    ``ttl``; runs the range if rows are left or the stage has timers, and reports the batch
    as this task saw it (a summary row): every range's task sees the same summaries."""
    batches = [b for b in batches if b.num_rows]
    if not batches:
        return  # no routing task ran: the input had no partitions
    summaries, table = _split_summaries(batches)
    del batches
    newest = pc.max(summaries.column(_NEWEST)).as_py()
    partition, attempt = _context()
    stage = task.stage
    late_rows = 0
    if stage.event_time is not None:
        clock = task.clock if newest is None else _newer(
            task.clock, _EPOCH + dt.timedelta(microseconds=newest))
        task = replace(task, clock=clock)
        late = stage.late_cutoff(clock)
        if late is not None:
            on_time = pc.greater_equal(_micros(table.column(stage.event_time)),
                                       (late - _EPOCH) // dt.timedelta(microseconds=1))
            # a row without an event time is late too, as before watermarks
            on_time = pc.fill_null(on_time, False)
            late_rows = table.num_rows - (pc.sum(on_time).as_py() or 0)
            if late_rows and stage.watermark is not None and stage.watermark.late_rows:
                late_table = table.filter(pc.invert(on_time)).drop_columns(
                    [OPERATOR_INDEX, _ROUTE, _ROWS, _NEWEST])
                yield from _payload_batches(_LATE, partition, attempt, late_table)
            if late_rows:  # else the rows as they are: a filter keeping all is a copy
                table = table.filter(on_time)
        if (stage.ttl is not None
                and stage.ttl.time_characteristic is TtlTimeCharacteristic.EVENT_TIME
                and clock is not None):
            task = replace(task, now=clock)
    yield pa.RecordBatch.from_pylist([{
        "row_kind": _SUMMARY, "operator_index": partition, "attempt": attempt,
        "input_rows": pc.sum(summaries.column(_ROWS)).as_py(), "newest": newest,
        "late_rows": late_rows}], schema=_RESULT_SCHEMA)
    if not table.num_rows and not stage.has_timers:
        return
    if any(table.column(name).null_count for name in stage.key):
        hash_keys(table.select(list(stage.key)), stage.key)  # says: keys must not be null
    indices = pc.unique(table.column(OPERATOR_INDEX))
    if not table.num_rows:
        # no rows, but due timers may fire: the routing summaries name this range's route
        indices = pc.unique(summaries.column(_ROUTE))
        routes = _routes(task.parallelism)
        indices = pa.array([routes.index(r) for r in indices.to_pylist()], pa.int32())
    if len(indices) != 1:
        raise RuntimeError(f"keyed stage {task.stage.name}: rows of ranges "
                           f"{indices.to_pylist()} reached one task; routing is broken")
    # handed over, not kept here: _run_range lets the rows go once the stage has run
    rows = [table.drop_columns([_ROUTE, _ROWS, _NEWEST])]
    del table
    result = _run_range(task, (indices[0],), rows)
    release_arrow_memory()
    if result is not None:
        handle, outputs = result
        del result
        yield from handle.to_batches()
        yield from _payload_batches(_OUTPUT, indices[0].as_py(), attempt, outputs)
        release_arrow_memory()


def _split_summaries(batches: list[pa.RecordBatch]) -> tuple[pa.Table, pa.Table]:
    """The routing tasks' summary rows and the range's rows of ``batches``. The summaries are
    a few rows (one per routing task), so only the batches holding one are filtered: the
    rest of the input stays as Spark's worker read it. A filter of the whole input copied it
    (then held beside it: the workers' peak in a range's first batch, 2M keys at 4M)."""
    summaries, rows = [], []
    for batch in batches:
        is_summary = pc.equal(batch.column(OPERATOR_INDEX), _SUMMARY_INDEX)
        if not pc.any(is_summary).as_py():
            rows.append(batch)
            continue
        summaries.append(batch.filter(is_summary))
        rows.append(batch.filter(pc.invert(is_summary)))
    schema = batches[0].schema
    return pa.Table.from_batches(summaries, schema), pa.Table.from_batches(rows, schema)


_SLICE_ROWS = 1 << 17  # a range's input rows the stage runs on at once (``_key_slices``)
_RELEASE_EVERY_BATCHES = 8  # input batches cut into slices between two releases of memory


def _run_range(task: KeyedStageTask, group_key: tuple,
               rows: list[pa.Table]) -> tuple[pa.Table, pa.Table] | None:
    """The work of one range and batch: bring the local store to the shipped
    chain, run the stage, fire the due timers, write the change file, apply the changes to
    the store; return one handle row and the output rows (for ``_payload_batches``) (None:
    nothing to do, a range without rows nor due timers). ``rows``: a list holding the
    range's input rows, taken out of it so that they are let go once the stage has run (a
    batch of a whole range's keys, as the first one is, held them through the store's
    merge and the output's encoding)."""
    operator_index = group_key[0].as_py()
    key_groups = task.key_groups(operator_index)
    layout, stage = task.layout, task.stage
    _, attempt = _context()
    table = rows.pop().drop_columns([OPERATOR_INDEX])
    input_rows = table.num_rows
    stats = {"rebuilt": False, "rebuild_rows": 0, "rebuild_seconds": 0.0,
             "private": False, "lock_wait_seconds": 0.0, "input_rows": input_rows}
    directory = local_store_directory(task, key_groups)
    cutoff = None if stage.ttl is None else stage.ttl.cutoff(task.now)
    sweep_other_ranges(task)
    if task.local_max_age is not None:
        sweep_idle_stores(_local_root(task.local_dir), task.local_max_age, keep=directory)
    hidden = [c for c in (WRITTEN_AT, TIMERS) if c in layout.stored_schema.names]
    # A large input (a range's first batch) hands back what each of its steps freed: glibc
    # and Arrow's allocator keep freed memory for reuse, so each step stood on what the ones
    # before it had freed: the input (Spark's worker reads it as Python bytes, in the C
    # heap), each slice's work, the change file's encoding; 2M keys a range: +400 MiB a
    # worker at the store's merge. A release takes milliseconds; a steady batch skips them.
    sliced = input_rows > _SLICE_ROWS
    with _locked_store(task, key_groups, directory, stats) as store:
        outputs, parts, output_rows = [], [], 0
        # the slices hold the input's last reference: it goes as they are cut, before the
        # stage runs on them
        held = [table]
        del table
        slices = _key_slices(stage, held)
        for part in slices:
            stored = store.get(part.select(list(stage.key)), cutoff=cutoff)
            result = stage.run(part, stored.drop_columns(hidden), now=task.now)
            output_rows += _kept_output(task, result.output, outputs)
            parts.append(fold(stage, layout, stored, result, task.now))
            del part, stored, result
            if sliced:
                release_arrow_memory()
        if sliced:  # the slices are done: the input is gone
            release_arrow_memory()
        if len(parts) == 1:
            changes = parts[0]
        elif parts:  # slices of a large input: their keys are apart, their changes too
            changes = (
                pa.concat_tables([layout.conform(u, f"keyed stage {stage.name}: upserts")
                                  for u, _ in parts]),
                pa.concat_tables([layout.conform_keys(d, f"keyed stage {stage.name}: deletes")
                                  for _, d in parts]))
        else:
            changes = (layout.stored_schema.empty_table(), layout.key_schema.empty_table())
        del parts
        fired_timers = 0
        limit = stage.timer_limit(task.clock, task.processing_time)
        if limit is not None:
            due = _due_rows(store, stage, changes, cutoff, limit)
            if due.num_rows:
                fired, rest = fire(stage, due, limit)
                fired_timers = fired.num_rows
                result = stage.run_on_timer(fired, rest.drop_columns(hidden), now=task.now)
                output_rows += _kept_output(task, result.output, outputs)
                by_timer = fold(stage, layout, rest, result, task.now, "on_timer")
                # the fired timers go in this change file: rows on_timer left keep the rest
                changes = merge_changes(stage, changes,
                                        merge_changes(stage, (rest, by_timer[1][:0]), by_timer))
        upserts, deletes = changes
        del changes
        if not input_rows and not upserts.num_rows and not deletes.num_rows:
            return None  # nothing fired: the range's chain stays as it is
        held = [upserts]
        del upserts
        upserts, upsert_hashes = _in_store_order(layout, held, f"keyed stage {stage.name}")
        if sliced:  # the unsorted upserts
            release_arrow_memory()
        (chain,) = task.sources(key_groups)
        access = _change_file_storage(task.storage, chain).create_checkpoint_storage(
            task.job_id)
        # file merging across checkpoints: this range's change files go, one after the
        # other, into the physical file of its last appended one (checkpoint_storage's
        # _appending.py); None: a new chain, or the chain of another parallelism
        previous = next((h for h in reversed(chain.changes) if is_appended_segment(h)),
                        None) if chain.key_groups == key_groups else None
        access = access.to_appending_storage(
            SubtaskKey(access.job_id.hex, stage.name, operator_index, task.parallelism),
            previous)
        factory = access.resolve_checkpoint_storage_location(task.checkpoint_id,
                                                             task.reference)
        change = write_change_file(factory, layout, key_groups, upserts, deletes,
                                   _file_prefix(task, key_groups, "b", attempt),
                                   upsert_hashes=upsert_hashes)
        if sliced:  # the change file's encoding, before the store's merge
            release_arrow_memory()
        store.apply(upserts, deletes, version=chain_version(key_groups, [chain.appended(change)]),
                    upsert_hashes=upsert_hashes)
        del upsert_hashes
        stats["state_rows"] = store.num_rows
        # at this batch's cutoff, while the store is open: one vectorised comparison
        stats["expired_rows"] = 0 if cutoff is None else store.expired_rows(cutoff)
    if task.after_write is not None:
        task.after_write(operator_index, attempt)
    output = pa.concat_tables([_conform_output(o, task) for o in outputs]) if outputs else \
        _spark_arrow_schema(task.output_schema).empty_table()
    stats["output_rows"] = output_rows
    stats["fired_timers"] = fired_timers
    handle = pa.Table.from_pylist([_handle_row(_CHANGE, operator_index, attempt, change,
                                               upserts.num_rows + deletes.num_rows, stats)],
                                  schema=_RESULT_SCHEMA)
    return handle, output


def _kept_output(task: KeyedStageTask, output: pa.Table, outputs: list[pa.Table]) -> int:
    """Add the stage's ``output`` to ``outputs`` if the batch's output is read, else only
    check that it fits the output schema (as a read output is, a stage's error shows
    whether or not a sink reads it); its rows."""
    if task.output_read:
        outputs.append(output)
    else:
        _conform_output(output.slice(0, 0), task)
    return output.num_rows


def _in_store_order(layout: KeyedStateLayout, held: list[pa.Table],
                    where: str) -> tuple[pa.Table, np.ndarray]:
    """The upserts ``held`` holds (taken out of it), in (key group, key hash) order, and their
    key hashes: sorted once here, the change file is written from them as they are and an
    empty store's merge makes them its segment as they are (each sorted a copy of them: a
    range's first batch of 2M keys at 4M, +110 MiB a worker at each), and neither hashes
    them again. Taken a column at a time, each unsorted column let go once taken: one
    column's copy beside the rows, not the whole table's."""
    table = layout.conform(held.pop(), f"{where}: upserts")
    hashes = hash_keys(table, layout.key)
    groups = hashes % np.uint64(layout.max_parallelism)
    if in_group_hash_order(groups, hashes):
        return table, hashes
    order = group_hash_order(groups, hashes)
    del groups
    schema, columns, large = table.schema, table.columns, table.num_rows > _SLICE_ROWS
    del table
    indices, taken = pa.array(order), []
    for i in range(len(columns)):
        column, columns[i] = columns[i], None
        taken.append(column.take(indices).combine_chunks())
        del column
        if large:
            # Arrow's allocator (mimalloc) kept each freed column's chunks beside the next
            # column's copy: +230 MiB a worker over the sort of 2M rows. A small sort skips
            # it: its pages would be faulted in afresh by the task's next allocations.
            pa.default_memory_pool().release_unused()
    return pa.Table.from_arrays(taken, schema=schema), hashes[order]


def _key_slices(stage, held: list[pa.Table]) -> Iterator[pa.Table]:
    """The table ``held`` holds (a range's input rows; taken out of it) in slices of its
    keys, each key's rows in one slice, about ``_SLICE_ROWS`` rows each (one slice, the table
    itself, up to that): what the stage runs on at once. A range's first batch holds all its
    keys (500,000 at 1M keys and two ranges); run at once, the stage's working memory (its
    grouping, joins and results, 3.7x the input for the click events' aggregate) came on top
    of the input and was the workers' peak. Keys are independent in a keyed stage, as they
    are across ranges, so a slice is a smaller range; a steady batch (5,000 keys a range at
    1M) is one slice. The input is cut into its slices one record batch at a time, each let
    go once cut (Spark's worker reads each into a buffer of its own), so the input is not
    held while the stage runs beside the upserts and output it makes (a range's first batch
    of 2M keys at 4M: the input's 170 MiB, a worker's peak)."""
    table = held.pop()
    slices = -(-table.num_rows // _SLICE_ROWS)
    if slices <= 1:
        if table.num_rows:
            yield table
        return
    schema, batches = table.schema, table.to_batches()
    del table
    pieces: list[list[pa.RecordBatch] | None] = [[] for _ in range(slices)]
    while batches:
        if len(batches) % _RELEASE_EVERY_BATCHES == 0:
            # the cut batches' buffers (Python bytes, in the C heap) handed back as they go,
            # else the heap held the whole input beside its slices (+250 MiB a worker at 4M
            # keys a range)
            release_arrow_memory()
        batch = batches.pop()
        # the key hash's high bits: its low bits are the key group, which the range fixes
        of_row = (hash_keys(stage.cast_keys(pa.Table.from_batches([batch])), stage.key)
                  >> np.uint64(32)) % np.uint64(slices)
        for i in range(slices):
            pieces[i].append(batch.filter(pa.array(of_row == i)))
        del batch
    for i in range(slices):
        # the batches' order as they came: a key's rows in input order
        part = pa.Table.from_batches(pieces[i][::-1], schema).combine_chunks()
        pieces[i] = None
        if part.num_rows:
            yield part
        del part


def _payload_batches(row_kind: str, operator_index: int, attempt: int,
                     rows: pa.Table) -> Iterator[pa.RecordBatch]:
    """Result rows of kind ``row_kind`` carrying ``rows`` as Arrow IPC streams, for
    ``_decode_output``: a record batch of one row per ``_OUTPUT_ROWS_PER_PAYLOAD`` rows, made
    as Spark asks for it. Its payload is the stream's buffer itself, so one range's output is
    held once plus the payload in flight (it was held 4x: the rows, the streams, their Python
    bytes and the table of them, 100 MiB for a first batch of 500,000 keys)."""
    others = [pa.nulls(1, f.type) for f in _RESULT_SCHEMA][4:]
    for batch in rows.to_batches(max_chunksize=_OUTPUT_ROWS_PER_PAYLOAD):
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, rows.schema) as writer:
            writer.write_batch(batch)
        stream = sink.getvalue()
        payload = pa.Array.from_buffers(pa.binary(), 1, [
            None, pa.py_buffer(np.array([0, stream.size], np.int32)), stream])
        yield pa.RecordBatch.from_arrays([
            pa.array([row_kind]), pa.array([operator_index], pa.int32()),
            pa.array([attempt], pa.int32()), payload, *others], schema=_RESULT_SCHEMA)


def _due_rows(store, stage, changes: tuple[pa.Table, pa.Table], cutoff: dt.datetime | None,
              limit: dt.datetime) -> pa.Table:
    """The stored rows, as they are after this batch's ``changes``, of the keys with a timer
    due at ``limit``: from the store (a vectorised scan of its timers), but for the keys the
    batch changed, which come from ``changes``. Expired keys' timers do not fire: a key whose
    state expired has lost its timers with it."""
    upserts, deletes = changes
    keys = store.keys_where(lambda rows: due_mask(rows, limit))
    changed = pa.concat_tables([stage.cast_keys(upserts), stage.cast_keys(deletes)])
    if keys.num_rows and changed.num_rows:
        keys = stage.cast_keys(keys).join(changed, list(stage.key), join_type="left anti")
    from_store = store.get(keys, cutoff=cutoff) if keys.num_rows else upserts.slice(0, 0)
    if upserts.num_rows:
        upserts = upserts.filter(pa.array(due_mask(upserts, limit)))
    rows = concat_as(upserts.schema, [from_store, upserts])
    if cutoff is not None and stage.ttl is not None:
        rows = stage.ttl.live(rows, cutoff)
    return rows


def _spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` as Spark hands it back (timestamps in UTC), so decoded rows fit exactly."""
    return to_arrow_schema(from_arrow_schema(schema, prefer_timestamp_ntz=False),
                           timezone="UTC")


def _conform_output(output: pa.Table, task: KeyedStageTask) -> pa.Table:
    target = _spark_arrow_schema(task.output_schema)
    missing = [n for n in target.names if n not in output.column_names]
    if missing:
        raise ValueError(f"keyed stage {task.stage.name}: output lacks column(s) {missing}; "
                         f"the task's output_schema is {task.output_schema.names}")
    try:
        return output.select(target.names).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ValueError(f"keyed stage {task.stage.name}: output does not fit the output "
                         f"schema {task.output_schema}: {exc}") from exc


def _decode_output(schema: pa.Schema,
                   batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: the output rows of the payloads."""
    for batch in batches:
        payloads = batch.column("payload")
        for i in range(len(payloads)):
            for rows in ipc.open_stream(payloads[i].as_buffer()):  # no copy of the stream
                yield rows if rows.schema == schema else rows.cast(schema)


# --- on the driver --------------------------------------------------------------------------


def _unexpired(batches: Iterator[pa.RecordBatch], layout: KeyedStateLayout,
               cutoff: dt.datetime | None, counted: list[int]) -> Iterator[pa.RecordBatch]:
    """``batches`` without the rows expired at ``cutoff`` (None: all), counting the rows."""
    for batch in batches:
        if cutoff is not None:
            batch = layout.ttl.live(batch, cutoff)
        counted[0] += batch.num_rows
        yield batch


def _snapshot_ranges(task: KeyedStageTask, adopt: bool, local_only: bool,
                        batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: for each operator index, bring the local store to the shipped
    chains (rebuilding it from them, e.g. another parallelism's) and write a sorted snapshot
    without expired rows. ``adopt``: the snapshot starts the range's new chain, so the store
    drops the expired rows and is marked as holding it; otherwise (a savepoint) the store is
    left as it is. ``local_only``: only from a local store that holds the chains already (a
    range without one is reported in a ``_NO_LOCAL_STORE`` row, nothing written)."""
    _, attempt = _context()
    layout = task.layout
    cutoff = None if layout.ttl is None else layout.ttl.cutoff(task.now)
    for batch in batches:
        for operator_index in batch.column(OPERATOR_INDEX).to_pylist():
            key_groups = task.key_groups(operator_index)
            directory = local_store_directory(task, key_groups)
            stats = {"rebuilt": False, "rebuild_rows": 0, "rebuild_seconds": 0.0,
                     "private": False, "lock_wait_seconds": 0.0, "input_rows": 0}
            with _locked_store(task, key_groups, directory, stats,
                               local_only=local_only) as store:
                if store is None:
                    yield pa.RecordBatch.from_pylist([{
                        "row_kind": _NO_LOCAL_STORE, "operator_index": operator_index,
                        "attempt": attempt}], schema=_RESULT_SCHEMA)
                    continue
                if adopt and cutoff is not None:
                    store.drop_expired(cutoff)
                access = task.storage.create_checkpoint_storage(task.job_id)
                factory = access.resolve_checkpoint_storage_location(task.checkpoint_id,
                                                                     task.reference)
                written = [0]
                handle = write_full_snapshot(
                    factory, layout, key_groups,
                    _unexpired(store.sorted_batches(), layout, cutoff, written),
                    _file_prefix(task, key_groups, "m", attempt))
                if adopt:
                    store.apply(layout.stored_schema.empty_table(),
                                layout.key_schema.empty_table(),
                                version=chain_version(key_groups,
                                                      [KeyedStateChain(key_groups, handle)]))
            if task.after_write is not None:
                task.after_write(operator_index, attempt)
            stats["state_rows"] = written[0]
            stats["expired_rows"] = 0  # the snapshot leaves expired rows out
            row = _handle_row(_FULL_SNAPSHOT, operator_index, attempt, handle, written[0],
                              stats)
            release_arrow_memory()
            yield pa.RecordBatch.from_pylist([row], schema=_RESULT_SCHEMA)


def _replay_ranges(task: KeyedStageTask, include_expired: bool,
                   batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body: each operator index's state rows (the state schema's columns),
    replayed from the shipped chains; the local stores are not touched."""
    layout = task.layout
    target = _spark_arrow_schema(task.stage.state_schema)
    cutoff = None if layout.ttl is None or include_expired else layout.ttl.cutoff(task.now)
    for batch in batches:
        for operator_index in batch.column(OPERATOR_INDEX).to_pylist():
            key_groups = task.key_groups(operator_index)
            # part by part: a range's whole state is never in the worker's memory at once
            for state in iter_replay_chains(task.sources(key_groups), layout, key_groups):
                if cutoff is not None:
                    state = layout.ttl.live(state, cutoff)
                state = state.select(target.names).cast(target)
                yield from state.to_batches(max_chunksize=_OUTPUT_ROWS_PER_PAYLOAD)
            release_arrow_memory()

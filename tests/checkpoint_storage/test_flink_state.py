"""Keyed ValueState rows of Flink's canonical savepoints (samples 2, 4 and 5), read without a
JVM. The job counted rows per key: the counts must add up to a whole number of seconds of
the datagen source's rate, every key once, within the job's key range."""

import dataclasses
import os
from pathlib import Path

import pytest

from checkpoint_storage.exceptions import FlinkMetadataError
from checkpoint_storage.flink import read_flink_checkpoint, read_heap_value_rows

SAMPLES = Path(os.environ.get("FLINK_SAMPLES", "/work/shared/flink-samples"))
SAVEPOINTS = SAMPLES / "scratch" / "savepoints"
pytestmark = pytest.mark.skipif(not SAVEPOINTS.is_dir(), reason="no Flink samples")


@pytest.mark.parametrize(
    ("savepoint", "keys", "rate", "backend"),
    [
        ("savepoint-fc063a-1505fc75f4a1", 50, 500, "heap, inline"),
        ("savepoint-287eee-d43e8eb8a8c0", 20000, 2000, "heap, files"),
        ("savepoint-f722d2-dba7d40cb7b6", 20000, 2000, "RocksDB, canonical"),
    ],
)
def test_canonical_savepoints_read_as_rows(savepoint, keys, rate, backend) -> None:
    m = read_flink_checkpoint(str(SAVEPOINTS / savepoint))
    result = read_heap_value_rows(m, python_value_type="long")
    assert (result.operator, result.states) == ("running-count", ["count"])
    found = [row.key for row in result.rows]
    assert len(found) == len(set(found)), "a key appears twice"
    assert all(0 <= k < keys for k in found)
    assert all(row.value >= 1 and row.state == "count" for row in result.rows)
    total = sum(row.value for row in result.rows)
    assert total > 0 and total % rate == 0, (backend, total)  # whole seconds of the source
    ranges = {
        s.index: s.managed_keyed_state.key_groups
        for op in m.operators
        if op.uid == "running-count"
        for s in op.subtasks
    }
    assert all(any(a <= row.key_group <= b for a, b in ranges.values()) for row in result.rows)
    if keys == 50:
        assert sorted(found) == list(range(50))  # 16 s at 500 rows/s: every key was seen


def test_values_are_hex_unless_a_python_type_is_given() -> None:
    m = read_flink_checkpoint(str(SAVEPOINTS / "savepoint-fc063a-1505fc75f4a1"))
    raw = read_heap_value_rows(m).rows[0].value
    typed = read_heap_value_rows(m, python_value_type="long").rows[0].value
    assert raw == typed.to_bytes(8, "big").hex()


@pytest.mark.parametrize(
    "pointer",
    ["savepoints/savepoint-287eee-2bac4548935e", "ckpts/287eeec738b3c129b2274f1ab2ec2d52/chk-9"],
)
def test_native_savepoints_and_checkpoints_are_refused(pointer) -> None:
    m = read_flink_checkpoint(str(SAMPLES / "scratch" / pointer))
    with pytest.raises(FlinkMetadataError, match="only canonical savepoints"):
        read_heap_value_rows(m)


def test_a_truncated_key_group_stream_is_a_clear_error() -> None:
    m = read_flink_checkpoint(str(SAVEPOINTS / "savepoint-fc063a-1505fc75f4a1"))
    op = next(o for o in m.operators if o.uid == "running-count")
    for cut in (10, 700, 1489, 1500, 2000):
        subtasks = tuple(
            dataclasses.replace(
                s,
                managed_keyed_state=dataclasses.replace(
                    s.managed_keyed_state,
                    delegate=dataclasses.replace(
                        s.managed_keyed_state.delegate,
                        data=s.managed_keyed_state.delegate.data[:cut],
                    ),
                ),
            )
            for s in op.subtasks
        )
        damaged = dataclasses.replace(m, operators=(dataclasses.replace(op, subtasks=subtasks),))
        with pytest.raises(FlinkMetadataError):
            read_heap_value_rows(damaged)

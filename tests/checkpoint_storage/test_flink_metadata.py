"""Apache Flink's `_metadata` parsed in pure Python, checked against the real Flink 2.3.0
samples in /work/shared/flink-samples: every decoded operator, subtask and handle must print
exactly as the sample's independent dump does, and every file must have the size LISTING.txt
records. Then: versions refused by number, and a fuzz run (truncation, bit flips, huge
lengths) that may only ever end in FlinkMetadataError."""

import contextlib
import os
import re
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_storage.exceptions import FlinkMetadataError, UnsafePathError
from checkpoint_storage.flink import parse_flink_metadata, parse_remap, read_flink_checkpoint

SAMPLES = Path(os.environ.get("FLINK_SAMPLES", "/work/shared/flink-samples"))
SCRATCH = SAMPLES / "scratch"
WRITTEN_ROOT = "/srv/flinkdemo"  # where the samples were written (README: map onto scratch/)

pytestmark = pytest.mark.skipif(not SCRATCH.is_dir(), reason="Flink samples not available")


def metadata_files() -> list[Path]:
    return sorted(SCRATCH.glob("*/*/_metadata")) + sorted(SCRATCH.glob("*/*/*/_metadata"))


def dump_of(path: Path) -> list[str]:
    relative = path.parent.relative_to(SCRATCH)
    name = str(relative).replace("/", "__") + ".txt"
    return (SAMPLES / "dumps" / name).read_text().splitlines()


def listing() -> dict[str, int]:
    sizes = {}
    for line in (SAMPLES / "LISTING.txt").read_text().splitlines():
        match = re.fullmatch(r"(scratch/\S+) (\d+)", line)
        if match:
            sizes[match.group(1)] = int(match.group(2))
    return sizes


def scratch_form(text: str) -> str:
    return re.sub(r"^(file:)?/srv/flinkdemo", "<scratch>", text)


def render_stream(h) -> str:
    if h.type_name == "ByteStreamStateHandle":
        return f"ByteStreamStateHandle(1) inline {h.size} bytes, name={scratch_form(h.name)}"
    if h.type_name == "RelativeFileStateHandle":
        return f"RelativeFileStateHandle(6) size={h.size} relativePath={h.relative_path}"
    if h.type_name == "FileStateHandle":
        return f"FileStateHandle(2) size={h.size} path={scratch_form(h.written_path)}"
    if h.type_name == "SegmentFileStateHandle":
        return (
            f"SegmentFileStateHandle(15) scope={h.scope} start={h.start} size={h.size} "
            f"file={scratch_form(h.written_path)} logicalFileId={h.logical_file_id}"
        )
    assert h.type_name == "EmptySegmentFileStateHandle"
    return "EmptySegmentFileStateHandle(16)"


def render_keyed(h, out: list[str]) -> str:
    kg = f"kg=[{h.key_groups[0]}..{h.key_groups[1]}]"
    if h.checkpoint_id is None:
        first = ", ".join(map(str, h.offsets[:3]))
        out.append(f"      {render_stream(h.delegate)}")
        if h.state_handle_id:
            out.append(f"      stateHandleId={h.state_handle_id}")
        return f"{h.type_name}({h.tag}) {kg} first offsets=[{first}]"
    out.append("      meta:")
    out.append(f"        {render_stream(h.meta)}")
    for label, pairs in (("shared", h.shared), ("private", h.private)):
        out.append(f"      {label}: {len(pairs)}")
        for local_path, stream in pairs:
            out.append(f"        localPath={local_path} ->")
            out.append(f"          {render_stream(stream)}")
    out.append(f"      stateHandleId={h.state_handle_id}")
    return (
        f"IncrementalRemoteKeyedStateHandle(11) checkpointId={h.checkpoint_id} "
        f"backend={h.backend_id} {kg} checkpointedSize={h.checkpointed_size}"
    )


def render(path: Path, m) -> list[str]:
    """The parsed metadata in the samples' dump format."""
    lines = [
        f"### {path.relative_to(SCRATCH)}",
        f"magic=0x4960672d version={m.version} size={m.metadata_size}",
        f"checkpointId={m.checkpoint_id}",
        f"masterStates={len(m.master_states)}",
        f"operatorStates={len(m.operators)}",
    ]
    for op in m.operators:
        lines.append(
            f"operator name='{op.name or ''}' uid='{op.uid or ''}' id={op.operator_id} "
            f"parallelism={op.parallelism} maxParallelism={op.max_parallelism}"
        )
        lines.append("  coordinatorState:")
        lines.append("    null")
        for subtask in op.subtasks:
            lines.append(f"  subtask {subtask.index}:")
            for label, h in (
                ("managedOperatorState", subtask.managed_operator_state),
                ("rawOperatorState", subtask.raw_operator_state),
            ):
                if h is None:
                    lines.append(f"    {label}: none")
                    continue
                states = [name for name, _, _ in h.states]
                lines.append(
                    f"    {label}: {h.type_name}({h.tag}) states={states} "
                    f"taskOwnedDir={scratch_form(h.task_owned_dir)} "
                    f"sharedDir={scratch_form(h.shared_dir)} empty={h.empty}"
                )
                lines.append(f"      {render_stream(h.delegate)}")
            for label, h in (
                ("managedKeyedState", subtask.managed_keyed_state),
                ("rawKeyedState", subtask.raw_keyed_state),
            ):
                if h is None:
                    lines.append(f"    {label}: null")
                    continue
                tail: list[str] = []
                lines.append(f"    {label}: {render_keyed(h, tail)}")
                lines.extend(tail)
    return lines


@pytest.mark.parametrize("path", metadata_files(), ids=lambda p: str(p.parent.relative_to(SCRATCH)))
def test_every_sample_decodes_as_its_dump(path: Path) -> None:
    m = parse_flink_metadata(path.read_bytes(), directory=str(path.parent))
    dump = dump_of(path)
    properties_at = next(
        i for i, line in enumerate(dump) if line.startswith("checkpointProperties")
    )
    assert render(path, m) == dump[:properties_at]
    # The properties: the dump names the class and the strings present in them.
    props = dump[properties_at + 1 :]
    expected_class = "SavepointType" if m.kind == "savepoint" else "CheckpointType"
    assert f"  class {expected_class} present" in props
    strings = {line.split("'")[1] for line in props if line.startswith("  string")}
    found = {
        m.properties.type_name,
        m.properties.format_type,
        m.properties.post_checkpoint_action,
        m.properties.sharing_files_strategy,
    } - {None}
    assert found == strings


def test_the_savepoint_kinds_and_types() -> None:
    kinds = {}
    for path in metadata_files():
        m = parse_flink_metadata(path.read_bytes(), directory=str(path.parent))
        p = m.properties
        kinds[path.parent.name] = (m.kind, p.type_name, p.format_type, p.post_checkpoint_action)
    assert kinds["savepoint-609553-3e06fb282423"] == (
        "savepoint",
        "Suspend Savepoint",
        "NATIVE",
        "SUSPEND",
    )
    assert kinds["savepoint-f722d2-dba7d40cb7b6"] == ("savepoint", "Savepoint", "CANONICAL", "NONE")
    assert kinds["chk-9"] == ("checkpoint", "Checkpoint", None, None)


@pytest.mark.parametrize("path", metadata_files(), ids=lambda p: str(p.parent.relative_to(SCRATCH)))
def test_referenced_files_have_the_listed_sizes(path: Path) -> None:
    sizes = listing()
    remap = parse_remap([f"{WRITTEN_ROOT}={SCRATCH}"])
    m = read_flink_checkpoint(str(path.parent), remap=remap)
    assert sizes[str(path.relative_to(SAMPLES))] == m.metadata_size
    for file_path, ref in m.referenced_files().items():
        key = str(Path(file_path).relative_to(SAMPLES))
        if key not in sizes:  # sample 7's chk-6 OPTIONS files Flink deleted after the claim
            assert "f722d28ed64854daeb21648a701176a8" in key and "858c4eba" in str(path)
            continue
        if ref.whole_file_size is not None:
            assert ref.whole_file_size == sizes[key], key
        assert ref.needed_bytes <= sizes[key], key


def test_inline_only_samples_reference_no_file() -> None:
    for name in (
        "ckpts/fc063a5f9fa399b1c645cc51ac079a6f/chk-9",
        "savepoints/savepoint-fc063a-1505fc75f4a1",
    ):
        m = read_flink_checkpoint(str(SCRATCH / name))
        assert m.referenced_files() == {}
        assert m.inline_bytes() > 4000


def test_claim_job_references_the_other_jobs_shared_files() -> None:
    remap = parse_remap([f"file:{WRITTEN_ROOT}={SCRATCH}"])
    m = read_flink_checkpoint(
        str(SCRATCH / "ckpts/858c4eba9ab0bd13ae80f7b855214a38/chk-8"), remap=remap
    )
    old = str(SCRATCH / "ckpts/f722d28ed64854daeb21648a701176a8/shared") + "/"
    assert any(p.startswith(old) for p in m.referenced_files())


def _header(version: int) -> bytes:
    return struct.pack(">Iiq", 0x4960672D, version, 1)


@pytest.mark.parametrize("version", [1, 2, 7, 99, -1])
def test_unknown_versions_are_refused_by_number(version: int) -> None:
    with pytest.raises(FlinkMetadataError, match=f"version {version} is not supported") as info:
        parse_flink_metadata(_header(version) + b"\0" * 64, directory="/x")
    assert info.value.format_version == version


def test_a_relative_path_that_leaves_its_directory_is_refused() -> None:
    path = SCRATCH / "savepoints/savepoint-f722d2-dba7d40cb7b6/_metadata"
    data = path.read_bytes()
    name = b"1d402edf-6d77-42f4-b38b-4e0b19205c28"
    hostile = data.replace(name, b"../../../../../../../../etc/passwd".ljust(len(name), b"x"))
    with pytest.raises(UnsafePathError, match="leaves its checkpoint directory"):
        parse_flink_metadata(hostile, directory=str(path.parent))


def test_truncation_at_every_byte_is_a_clear_error() -> None:
    data = (SCRATCH / "ckpts/287eeec738b3c129b2274f1ab2ec2d52/chk-9/_metadata").read_bytes()
    for end in range(len(data)):
        with pytest.raises(FlinkMetadataError, match="not a valid Apache Flink _metadata"):
            parse_flink_metadata(data[:end], directory="/x")


def test_trailing_bytes_are_refused() -> None:
    data = (SCRATCH / "ckpts/287eeec738b3c129b2274f1ab2ec2d52/chk-9/_metadata").read_bytes()
    with pytest.raises(FlinkMetadataError, match="bytes follow the end"):
        parse_flink_metadata(data + b"\0", directory="/x")


_FUZZ_SEEDS = [p.read_bytes() for p in metadata_files()]


@pytest.mark.timeout(300)
@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    seed=st.integers(0, max(len(_FUZZ_SEEDS) - 1, 0)),
    flips=st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 255)), max_size=6),
    huge=st.lists(
        st.tuples(st.integers(0, 2**20), st.sampled_from([0x7FFFFFFF, 0xFFFF, 2**31])), max_size=2
    ),
    cut=st.one_of(st.none(), st.integers(0, 2**20)),
)
def test_fuzzed_metadata_never_crashes_or_hangs(seed, flips, huge, cut) -> None:
    data = bytearray(_FUZZ_SEEDS[seed])
    for at, xor in flips:
        data[8 + at % (len(data) - 8)] ^= xor
    for at, value in huge:
        at = 8 + at % (len(data) - 12)
        data[at : at + 4] = struct.pack(">I", value & 0xFFFFFFFF)
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    with contextlib.suppress(FlinkMetadataError, UnsafePathError):
        parse_flink_metadata(bytes(data), directory="/x")


def _java_utf(text: str) -> bytes:
    return struct.pack(">H", len(text)) + text.encode()


def _java_class(name: str, flags: int, fields: bytes, count: int) -> bytes:
    """TC_CLASSDESC, a serialVersionUID, ``flags``, ``count`` fields, no annotations, no
    superclass."""
    return (b"\x72" + _java_utf(name) + b"\0" * 8 + bytes([flags])
            + struct.pack(">H", count) + fields + b"\x78\x70")


def test_the_java_serialization_reader_reads_fields_strings_and_back_references():
    """The reader of the trailing CheckpointProperties (its own module): a boolean, a string
    and a back reference to that string, as plain data."""
    from checkpoint_storage._flink_java_serialization import JavaObject, read_java_object
    from checkpoint_storage._flink_metadata import _Reader

    string_type = b"\x74" + _java_utf("Ljava/lang/String;")  # handle 1 (the class is 0)
    fields = (b"Z" + _java_utf("forced") + b"L" + _java_utf("name") + string_type
              + b"L" + _java_utf("again") + b"\x71" + struct.pack(">i", 0x7E0001))
    stream = (b"\xac\xed\x00\x05\x73" + _java_class("org.example.Props", 0x02, fields, 3)
              + b"\x01" + b"\x74" + _java_utf("x")  # the object is handle 2, "x" handle 3
              + b"\x71" + struct.pack(">i", 0x7E0003))
    reader = _Reader(stream, "/x/_metadata")

    value = read_java_object(reader)

    assert (value, reader.remaining()) == (
        JavaObject("org.example.Props", {"forced": True, "name": "x", "again": "x"}), 0)


def test_the_java_serialization_reader_refuses_a_class_with_its_own_write_object():
    from checkpoint_storage._flink_java_serialization import read_java_object
    from checkpoint_storage._flink_metadata import _Reader

    stream = b"\xac\xed\x00\x05\x73" + _java_class("org.example.Custom", 0x03, b"", 0)

    with pytest.raises(FlinkMetadataError, match="org.example.Custom uses custom or external"):
        read_java_object(_Reader(stream, "/x/_metadata"))

"""Network-fault and hostile-input scenarios (issue 7), shared by pytest and the runner.

Each ``scenario_*(trials, ...)`` returns ``Result(trials, failures, figure)``: the pytest
suite calls them with small ``trials``, ``benchmarks/reliability.py`` with large ones. The S3
scenarios take the URL of a running moto server (``moto_server()`` starts one) and put a
``FaultProxy`` in front of it.
"""

import contextlib
import logging
import os
import pickle
import random
import tracemalloc
import uuid
import zlib
from collections import Counter
from typing import NamedTuple

from checkpoint_storage import (
    CheckpointedStateScope,
    CheckpointMetadata,
    FileStateHandle,
    FileSystemCheckpointStorage,
    OperatorState,
    OperatorSubtaskState,
    RelativeFileStateHandle,
    store_checkpoint_metadata,
)
from checkpoint_storage._filesystems import roots_for_directory
from checkpoint_storage._metadata import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    decode_metadata,
    encode_metadata,
)
from checkpoint_storage.exceptions import (
    CheckpointAlreadyExistsError,
    CheckpointCommitFailedError,
    InvalidCheckpointError,
    UnsafePathError,
)
from tests.reliability.proxy import (
    ACCESS_DENIED,
    LOST,
    PASS,
    RESET,
    UNAVAILABLE,
    FaultProxy,
)


class Result(NamedTuple):
    trials: int
    failures: int
    figure: str


@contextlib.contextmanager
def moto_server():
    """A moto S3 server on 127.0.0.1 for the runner (pytest uses the ``s3_server`` fixture)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


_SHARED_SERVER: list = []


def _upstream(upstream_url: str | None) -> str:
    """``upstream_url``, or a moto server started on first use and kept for this process
    (the runner calls scenarios with the trial count only)."""
    if upstream_url is not None:
        return upstream_url
    if not _SHARED_SERVER:
        import atexit

        context = moto_server()
        _SHARED_SERVER.append(context.__enter__())
        atexit.register(context.__exit__, None, None, None)
    return _SHARED_SERVER[0]


def new_bucket(upstream_url: str) -> str:
    """A fresh bucket, created directly on the server (not through the proxy)."""
    import boto3

    name = f"rel-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=upstream_url).create_bucket(Bucket=name)
    return name


def read_object(upstream_url: str, bucket: str, key: str) -> bytes:
    """An object's bytes, read directly from the server (not through the proxy)."""
    import boto3

    client = boto3.client("s3", endpoint_url=upstream_url)
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def checkpoint_metadata(
    checkpoint_id: int, handles=(), master: bytes = b"pos"
) -> CheckpointMetadata:
    return CheckpointMetadata(
        checkpoint_id=checkpoint_id,
        operator_states=(
            OperatorState("op", 1, subtask_states={0: OperatorSubtaskState(handles)}),
        ),
        master_states={"pos": master},
    )


def commit(access, checkpoint_id: int, master: bytes = b"pos"):
    """Write one small state (a file when the storage's threshold is 0) and publish
    `_metadata`; returns (the completed location, the `_metadata` bytes)."""
    location = access.initialize_location_for_checkpoint(checkpoint_id)
    with location.create_checkpoint_state_output_stream(CheckpointedStateScope.EXCLUSIVE) as out:
        out.write(b"s" * 64)
        handles = (out.close_and_get_handle(),)
    metadata = checkpoint_metadata(checkpoint_id, handles, master)
    out = location.create_metadata_output_stream()
    store_checkpoint_metadata(metadata, out)
    return out.close_and_finalize_checkpoint(), encode_metadata(metadata)


# --- discovery under list/info faults ------------------------------------------------------


def scenario_discovery_faults(
    trials: int, upstream_url: str | None = None, rate: float = 0.1, seed: int = 0
):
    """``latest_completed_checkpoint()`` with chk-1..4 complete and chk-5 in progress while
    ``rate`` of the LIST/HEAD requests fail with 403 or 503: every answer is chk-4 or a
    raised OSError; never None, an older checkpoint or another exception."""
    rng = random.Random(seed)
    upstream_url = _upstream(upstream_url)
    bucket = new_bucket(upstream_url)
    with FaultProxy(upstream_url) as proxy:
        storage = FileSystemCheckpointStorage(
            f"s3://{bucket}/cp",
            storage_options=proxy.options(attempts=1),
            file_state_size_threshold=0,
        )
        access = storage.create_checkpoint_storage(uuid.uuid4().hex)
        access.initialize_base_locations()
        for checkpoint_id in range(1, 5):
            commit(access, checkpoint_id)
        access.initialize_location_for_checkpoint(5)  # in progress: no _metadata
        expected = f"{access.checkpoints_directory}/chk-4"

        def rule(request):
            if request.kind in ("LIST", "HEAD") and rng.random() < rate:
                return rng.choice((ACCESS_DENIED, UNAVAILABLE))
            return PASS

        proxy.rule = rule
        outcomes: Counter = Counter()
        for _ in range(trials):
            try:
                latest = access.latest_completed_checkpoint()
            except OSError:
                outcomes["raised OSError"] += 1
                continue
            except Exception as exc:  # noqa: BLE001 - any other error is a wrong answer
                outcomes[f"wrong: {type(exc).__name__}"] += 1
                continue
            if latest is not None and latest.external_pointer == expected:
                outcomes["right"] += 1
            else:
                outcomes[f"wrong: {None if latest is None else latest.external_pointer}"] += 1
        injected = sum(1 for _, action in proxy.log if action != PASS)
        requests = len(proxy.log)
    failures = sum(n for outcome, n in outcomes.items() if outcome.startswith("wrong"))
    figure = (
        f"right={outcomes['right']} raised={outcomes['raised OSError']} wrong={failures}; "
        f"{injected} of {requests} requests faulted"
    )
    return Result(trials, failures, figure)


# --- `_metadata` PUT applied but response lost ---------------------------------------------

# (fault, how many conditional `_metadata` PUTs it hits, botocore attempts, expected outcome).
# s3fs itself retries connection errors (up to 5 tries), so a single lost response is
# followed by a retried PUT that gets 412 for our own object; when every try is lost the
# library's read-back decides.
ALL = 99
LOST_PUT_CASES = (
    (LOST, 1, 1, "committed"),  # retry finds our object (412): resolved by read-back
    (LOST, 1, 3, "committed"),  # the same with botocore retries on top
    (LOST, ALL, 1, "committed"),  # every try lost: the read-back after the error finds it
    (RESET, 1, 1, "committed"),  # never reached the server; the retry succeeds
    (RESET, ALL, 1, "failed"),  # never reached the server: nothing stored, retry is safe
)


def scenario_lost_metadata_put(trials: int, upstream_url: str | None = None):
    """A `_metadata` PUT whose response is lost after the server applied it completes the
    checkpoint exactly once (the commit returns the location; `_metadata` holds our bytes;
    a second commit is refused); one that never arrived fails cleanly with nothing stored."""
    upstream_url = _upstream(upstream_url)
    bucket = new_bucket(upstream_url)
    outcomes: Counter = Counter()
    failures = 0
    with FaultProxy(upstream_url) as proxy:
        accesses = {}
        for attempts in (1, 3):
            storage = FileSystemCheckpointStorage(
                f"s3://{bucket}/a{attempts}",
                storage_options=proxy.options(attempts=attempts),
                file_state_size_threshold=0,
            )
            accesses[attempts] = storage.create_checkpoint_storage(uuid.uuid4().hex)
            accesses[attempts].initialize_base_locations()
        for trial in range(trials):
            fault, times, attempts, expected = LOST_PUT_CASES[trial % len(LOST_PUT_CASES)]
            access = accesses[attempts]
            checkpoint_id = trial + 1
            faulted = []

            def rule(request, fault=fault, times=times, faulted=faulted):
                if (
                    request.conditional_create
                    and request.path.endswith("/_metadata")
                    and len(faulted) < times
                ):
                    faulted.append(request)
                    return fault
                return PASS

            proxy.rule = rule
            key = f"{access.checkpoints_directory.removeprefix(f's3://{bucket}/')}"
            key = f"{key}/chk-{checkpoint_id}/_metadata"
            master = f"writer-{trial}".encode()
            try:
                completed, ours = commit(access, checkpoint_id, master)
                actual = "committed"
            except CheckpointCommitFailedError:
                actual, completed, ours = "failed", None, None
            except Exception as exc:  # noqa: BLE001 - counted as a failure with its type
                actual, completed, ours = f"raised {type(exc).__name__}: {exc}"[:200], None, None
            proxy.rule = lambda request: PASS
            ok = actual == expected and bool(faulted)
            if ok and actual == "committed":
                stored = read_object(upstream_url, bucket, key)
                ok = (
                    completed.external_pointer
                    == f"{access.checkpoints_directory}/chk-{checkpoint_id}"
                    and stored == ours
                    and completed.load_metadata().master_states == {"pos": master}
                )
                try:  # no double commit: the checkpoint cannot be completed again
                    commit(access, checkpoint_id, b"again")
                    ok = False
                except CheckpointAlreadyExistsError:
                    pass
            elif ok:
                try:
                    read_object(upstream_url, bucket, key)
                    ok = False  # a failed commit must have published nothing
                except Exception:  # noqa: BLE001 - NoSuchKey
                    pass
                ok = ok and commit(access, checkpoint_id, master)[0] is not None  # retry is safe
            outcomes[f"{fault}x{'all' if times == ALL else times}/{attempts} {actual}"] += 1
            failures += not ok
    figure = ", ".join(f"{name}={n}" for name, n in sorted(outcomes.items()))
    return Result(trials, failures, figure)


# --- hostile pointers and handle paths -----------------------------------------------------

SEGMENT_ALPHABET = "abcxyz0123456789-_"
TRAVERSALS = (
    "..",
    ".",
    "%2e%2e",
    "%2E%2E",
    "%2e.",
    ".%2e",
    "%252e%252e",
    "..%2f..",
    "..%2F..",
    "%2e%2e%2f%2e%2e",
    "..\\..",
    "..%5c..",
)
CONTROL = ("\x00", "\n", "\r", "\t", "\x1b", "\x7f")


def hostile_pointer_strategy(base: str):
    """Pointers below ``base`` that try to walk out of it."""
    from hypothesis import strategies as st

    segment = st.text(alphabet=SEGMENT_ALPHABET, min_size=1, max_size=6)
    traversal = st.sampled_from(TRAVERSALS)
    tails = st.lists(segment | traversal, min_size=1, max_size=5).filter(
        lambda parts: any(p in TRAVERSALS for p in parts)
    )
    traversing = st.builds(
        lambda tail, suffix: f"{base}/{'/'.join(tail)}{suffix}",
        tails,
        st.sampled_from(["", "/", "/_metadata"]),
    )
    controlled = st.builds(
        lambda a, c, b: f"{base}/{a}{c}{b}", segment, st.sampled_from(CONTROL), segment
    )
    return st.one_of(traversing, controlled)


def hostile_handle_strategy(chk: str, job_dir: str):
    """(kind, path) of handle paths that leave a checkpoint's roots."""
    from hypothesis import strategies as st

    segment = st.text(alphabet=SEGMENT_ALPHABET, min_size=1, max_size=6)
    bucket_root = job_dir.split("/", 3)
    other_bucket = f"s3://{bucket_root[2]}x/{bucket_root[3]}"
    roots = st.sampled_from([chk, f"{job_dir}/shared", f"{job_dir}/taskowned"])
    traversal = st.sampled_from(TRAVERSALS)
    absolute = st.one_of(
        st.builds(lambda r, t, s: f"{r}/{t}/{s}", roots, traversal, segment),
        st.builds(lambda r, s, t: f"{r}{s}/{t}", roots, segment, segment),  # sibling prefix
        st.builds(lambda s: f"{other_bucket}/chk-1/{s}", segment),  # another bucket
        st.builds(lambda s: f"{job_dir}/chk-2/{s}", segment),  # another checkpoint
        st.builds(lambda s: f"/{s}/{s}", segment),  # a local absolute path
        st.builds(lambda s: f"memory://{s}/{s}", segment),
        st.builds(lambda r, c, s: f"{r}/{s}{c}{s}", roots, st.sampled_from(CONTROL), segment),
        st.builds(lambda r: f"{r}/", roots),
        roots,
    )
    relative = st.one_of(
        st.lists(segment | traversal, min_size=1, max_size=4)
        .filter(lambda parts: any(p in TRAVERSALS for p in parts))
        .map("/".join),
        st.builds(lambda s: f"/{s}", segment),
        st.builds(lambda a, b: f"{a}//{b}", segment, segment),
        st.builds(lambda a, c, b: f"{a}{c}{b}", segment, st.sampled_from(CONTROL), segment),
        st.builds(lambda s: f"s3://{s}/{s}", segment),
        st.just(""),
    )
    return st.one_of(
        st.tuples(st.just("absolute"), absolute), st.tuples(st.just("relative"), relative)
    )


def hostile_metadata(chk: str, kind: str, path: str) -> bytes:
    """Valid `_metadata` bytes holding one good inline handle and the hostile one."""
    if kind == "absolute":
        handle = FileStateHandle(path, 10)
    else:
        handle = RelativeFileStateHandle(f"{chk}/placeholder", path, 10)
    return encode_metadata(checkpoint_metadata(1, (handle,)))


# --- metadata decoder fuzzing --------------------------------------------------------------

FUZZ_DIRECTORY = "s3://bucket/cp/job/chk-7"
FUZZ_ROOTS = roots_for_directory(FUZZ_DIRECTORY)


def fuzz_seed_metadata() -> bytes:
    """A valid `_metadata` exercising every field and handle type."""
    from checkpoint_storage import ByteStreamStateHandle, CheckpointedStateScope
    from checkpoint_storage._handles import SegmentFileStateHandle

    handles = (
        ByteStreamStateHandle("inline", b"abc"),
        RelativeFileStateHandle(f"{FUZZ_DIRECTORY}/f1", "f1", 5, 7),
        FileStateHandle("s3://bucket/cp/job/shared/f2", 9, None),
        SegmentFileStateHandle(
            "s3://bucket/cp/job/taskowned/seg", 3, 4, CheckpointedStateScope.SHARED, "lf", 11
        ),
    )
    metadata = CheckpointMetadata(
        checkpoint_id=7,
        operator_states=(
            OperatorState(
                "op-a",
                2,
                4,
                {
                    0: OperatorSubtaskState(handles, {"k": "v"}),
                    1: OperatorSubtaskState(handles[:1]),
                },
            ),
            OperatorState("op-b", 1),
        ),
        master_states={"pos": b"12", "other": b""},
        job_id="0123456789abcdef0123456789abcdef",
        timestamp_ms=1234,
    )
    return encode_metadata(metadata)


def reseal(body: bytes) -> bytes:
    """A header that matches ``body`` (length and CRC), so mutations reach the body parser."""
    import struct

    return struct.pack(">8sHHQI", MAGIC, FORMAT_VERSION, 0, len(body), zlib.crc32(body)) + body


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to eight random edits: flip, set, insert, delete, duplicate or truncate."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(6)
        pos = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[pos % len(out)] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[pos % len(out)] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif op == 2:
            out[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del out[pos : pos + rng.randint(1, 8)]
        elif op == 4:
            start = rng.randrange(len(out) + 1)
            out[pos:pos] = out[start : start + rng.randint(1, 16)]
        else:
            del out[pos:]
    return bytes(out)


def decode_outcome(data: bytes) -> str:
    """How the decoder treats ``data``: 'valid', 'invalid', 'unsafe' or 'BUG <type>: ...'."""
    try:
        decode_metadata(data, source="fuzz", directory=FUZZ_DIRECTORY, roots=FUZZ_ROOTS)
    except UnsafePathError:
        return "unsafe"  # a mutated path left the roots: the library's security verdict
    except InvalidCheckpointError:
        return "invalid"
    except Exception as exc:  # noqa: BLE001 - anything else is a decoder bug
        return f"BUG {type(exc).__name__}: {exc}"[:300]
    return "valid"


def fuzz_input(rng: random.Random, seed_body: bytes) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:  # random bytes, sometimes behind a valid magic
        data = rng.randbytes(rng.randint(0, 256))
        return MAGIC + data if rng.random() < 0.5 else data
    if choice == 1:  # mutated file, header untouched (checksum/length catch it)
        return mutate(rng, reseal(seed_body))
    # mutated body behind a resealed header: reaches the body parser
    return reseal(mutate(rng, seed_body))


MEMORY_BOUND = 4 * 1024 * 1024  # peak traced memory of decoding one input of < 1 KiB


def scenario_decoder_fuzz(trials: int, seed: int = 0) -> Result:
    """Random and mutated `_metadata` bytes: the decoder raises only InvalidCheckpointError
    (or UnsafePathError when a mutated path leaves the roots) and decoding one input peaks
    below MEMORY_BOUND of traced memory."""
    rng = random.Random(seed)
    seed_body = fuzz_seed_metadata()[HEADER_SIZE:]
    outcomes: Counter = Counter()
    bugs: list[str] = []
    peak = 0
    tracemalloc.start()
    try:
        for _ in range(trials):
            data = fuzz_input(rng, seed_body)
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            outcome = decode_outcome(data)
            peak = max(peak, tracemalloc.get_traced_memory()[1] - before)
            if outcome.startswith("BUG"):
                bugs.append(outcome)
                outcome = "BUG"
            outcomes[outcome] += 1
    finally:
        tracemalloc.stop()
    failures = outcomes["BUG"] + (peak >= MEMORY_BOUND)
    figure = (
        f"invalid={outcomes['invalid']} unsafe={outcomes['unsafe']} valid={outcomes['valid']} "
        f"bugs={outcomes['BUG']} peak={peak / 1024:.0f} KiB (bound {MEMORY_BOUND >> 10} KiB)"
    )
    if bugs:
        figure += f"; first: {bugs[0]}"
    return Result(trials, failures, figure)


def scenario_hostile_pointers(
    trials: int, upstream_url: str | None = None, seed: int = 0
) -> Result:
    """Hostile pointers and hostile handle paths in `_metadata`: every one is rejected with
    UnsafePathError (pointers: or ValueError for control characters) and the proxy in front
    of the S3 server sees no request."""
    from hypothesis import HealthCheck, given, settings

    upstream_url = _upstream(upstream_url)
    bucket = new_bucket(upstream_url)
    outcomes: Counter = Counter()
    with FaultProxy(upstream_url) as proxy:
        storage = FileSystemCheckpointStorage(
            f"s3://{bucket}/cp", storage_options=proxy.options(attempts=1)
        )
        access = storage.create_checkpoint_storage(uuid.uuid4().hex)
        job_dir = access.checkpoints_directory
        chk = f"{job_dir}/chk-1"
        roots = roots_for_directory(chk)
        fs = access._fs
        half = max(1, trials // 2)

        @settings(
            max_examples=half,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(pointer=hostile_pointer_strategy(chk))
        def pointers(pointer):
            try:
                access.resolve_checkpoint(pointer)
                outcome = "accepted"
            except UnsafePathError:
                outcome = "rejected"
            except ValueError:
                outcome = "rejected" if any(c in pointer for c in CONTROL) else "ValueError"
            except Exception as exc:  # noqa: BLE001
                outcome = type(exc).__name__
            outcomes["pointer " + outcome] += 1

        @settings(
            max_examples=half,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(kind_path=hostile_handle_strategy(chk, job_dir))
        def handles(kind_path):
            kind, path = kind_path
            data = hostile_metadata(chk, kind, path)
            try:
                decode_metadata(data, source="hostile", directory=chk, roots=roots, filesystem=fs)
                outcome = "accepted"
            except UnsafePathError:
                outcome = "rejected"
            except Exception as exc:  # noqa: BLE001
                outcome = type(exc).__name__
            outcomes["handle " + outcome] += 1

        pointers()
        handles()
        requests = len(proxy.log)
    total = sum(outcomes.values())
    rejected = outcomes["pointer rejected"] + outcomes["handle rejected"]
    failures = total - rejected + requests
    figure = (
        f"pointers rejected {outcomes['pointer rejected']}, handles rejected "
        f"{outcomes['handle rejected']}, other outcomes "
        f"{ {k: v for k, v in outcomes.items() if not k.endswith('rejected')} }, "
        f"S3 requests {requests}"
    )
    return Result(total, failures, figure)


# --- canary secret -----------------------------------------------------------------------

CANARY_VARIABLE = "RELIABILITY_CANARY_SECRET"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def canary_artifacts(storage, proxy, upstream_url: str, bucket: str) -> tuple[list, list[str]]:
    """Checkpoint twice (losing the second `_metadata` response), publish an invalid newer
    checkpoint, restore the newest valid one and read its state, resolve a missing pointer;
    all with the library's logger at DEBUG. Returns (named artifacts to search for a
    secret: (name, bytes)), the log lines)."""
    from pipelines.state_io import StateReadTask, StateWriteTask

    records = _Records()
    library_logger = logging.getLogger("checkpoint_storage")
    level = library_logger.level
    library_logger.addHandler(records)
    library_logger.setLevel(logging.DEBUG)
    artifacts: list[tuple[str, bytes]] = []
    try:
        access = storage.create_checkpoint_storage(uuid.uuid4().hex)
        access.initialize_base_locations()
        commit(access, 1)
        lost: list = []

        def lose_first_metadata_response(request):
            if request.conditional_create and not lost:
                lost.append(request)
                return LOST
            return PASS

        proxy.rule = lose_first_metadata_response
        completed, metadata_bytes = commit(access, 2)
        proxy.rule = lambda request: PASS
        location = access.initialize_location_for_checkpoint(3)
        out = location.create_metadata_output_stream()
        out.write(b"not metadata")
        out.close_and_finalize_checkpoint()
        latest = access.latest_completed_checkpoint()
        restored = latest.load_metadata()
        for handle in restored.all_handles():
            with handle.open() as f:
                artifacts.append(("state", f.read()))
        try:
            access.resolve_checkpoint(f"s3://{bucket}/nowhere")
        except FileNotFoundError as exc:
            artifacts.append(("error message", str(exc).encode()))
    finally:
        library_logger.removeHandler(records)
        library_logger.setLevel(level)
    if restored.checkpoint_id != 2:
        raise AssertionError(f"restored checkpoint {restored.checkpoint_id}, expected 2")
    key = f"{latest.external_pointer.removeprefix(f's3://{bucket}/')}/_metadata"
    artifacts.append(("stored _metadata", read_object(upstream_url, bucket, key)))
    artifacts.append(("written _metadata", metadata_bytes))
    artifacts.append(("logs", "\n".join(records.lines).encode()))
    import pyarrow as pa

    from checkpoint_storage import CheckpointStorageLocationReference

    schema = pa.schema([("user", pa.string())])
    reference = CheckpointStorageLocationReference.get_default()
    shipped = {
        "pickled storage": storage,
        "pickled access": access,
        "pickled reference": reference,
        "pickled StateWriteTask": StateWriteTask(
            storage, access.job_id.hex, 4, reference, "op", schema
        ),
        "pickled StateReadTask": StateReadTask(storage, schema),
    }
    artifacts.extend((name, pickle.dumps(obj)) for name, obj in shipped.items())
    for obj in (storage, access, location, completed, latest):
        artifacts.append((f"repr/str {type(obj).__name__}", f"{obj!r} {obj!s}".encode()))
    return artifacts, records.lines


def scenario_canary_secret(trials: int, upstream_url: str | None = None) -> Result:
    """Each trial: a fresh canary secret, read through storage_options_from_env, serves a
    checkpoint and restore on S3; a failure is any artifact (library logs, `_metadata`,
    pickled executor tasks and storage, reprs, error messages) that contains it."""
    upstream_url = _upstream(upstream_url)
    leaks: Counter = Counter()
    searched = 0
    previous = os.environ.get(CANARY_VARIABLE)
    try:
        with FaultProxy(upstream_url) as proxy:
            for _ in range(trials):
                canary = f"canary-{uuid.uuid4().hex}"
                os.environ[CANARY_VARIABLE] = canary
                bucket = new_bucket(upstream_url)
                storage = FileSystemCheckpointStorage(
                    f"s3://{bucket}/cp",
                    storage_options=proxy.options(attempts=1),
                    storage_options_from_env={
                        "key": "AWS_ACCESS_KEY_ID",
                        "secret": CANARY_VARIABLE,
                    },
                    file_state_size_threshold=0,
                )
                artifacts, _ = canary_artifacts(storage, proxy, upstream_url, bucket)
                searched += len(artifacts)
                leaks.update(name for name, data in artifacts if canary.encode() in data)
    finally:
        if previous is None:
            os.environ.pop(CANARY_VARIABLE, None)
        else:
            os.environ[CANARY_VARIABLE] = previous
    figure = f"{searched} artifacts searched, leaks: {dict(leaks) or 'none'}"
    return Result(trials, sum(leaks.values()), figure)


# --- the runner's table --------------------------------------------------------------------

HOSTILE_PER_TRIAL = 50  # --trials 200 -> 10k hypothesis examples
FUZZ_PER_TRIAL = 500  # --trials 200 -> 100k decoder inputs


def _scaled(function, factor: int, unit: str):
    def run(trials: int) -> Result:
        result = function(trials * factor)
        return result._replace(figure=f"{result.figure} ({factor} {unit} per trial)")

    return run


def _canary_runs(trials: int) -> Result:
    runs = max(1, trials // 20)  # each run is a whole checkpoint + restore on S3
    result = scenario_canary_secret(runs)
    return result._replace(figure=f"{result.figure} ({runs} runs for --trials {trials})")


SCENARIOS = {
    "net_discovery_faults": scenario_discovery_faults,
    "net_lost_metadata_put": scenario_lost_metadata_put,
    "net_hostile_pointers": _scaled(scenario_hostile_pointers, HOSTILE_PER_TRIAL, "examples"),
    "net_decoder_fuzz": _scaled(scenario_decoder_fuzz, FUZZ_PER_TRIAL, "inputs"),
    "net_canary_secret": _canary_runs,
}

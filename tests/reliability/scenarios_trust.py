"""Trust scenarios (issue 13): garbage collection over directories this library did not write,
and copied checkpoint directories whose id differs from their ``chk-<id>``.

Each scenario takes a trial count and a ``Target`` (local disk or S3 on moto, see
``scenarios_fs``) and returns ``Outcome(trials, failures, figure)``; the pytest suite runs them
with small N (``tests/reliability/test_foreign_and_mismatched_dirs.py``),
``benchmarks/reliability.py`` with large N.
"""

import random
import time
import uuid

from checkpoint_storage import (
    FileSystemCompletedCheckpointStore,
    JobID,
    collect_garbage,
    list_checkpoints,
)
from checkpoint_storage._metadata import FORMAT_VERSION, MAGIC
from tests.reliability.scenarios_fs import (
    Outcome,
    Target,
    _captured_warnings,
    _commit,
    _on_each_backend,
    _prepare,
    _real_fs,
    _storage,
)
from tests.support import flink_metadata, make_flink_job_directory, payload

FUTURE = 30 * 86400  # "now" for the collector: every file written is older than the grace


def _files(fs, url: str) -> set[str]:
    fs.invalidate_cache()
    try:
        return set(fs.find(type(fs)._strip_protocol(url)))
    except FileNotFoundError:
        return set()


def _put(fs, url: str, data: bytes) -> None:
    path = type(fs)._strip_protocol(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


# --- scenario: foreign directories under GC ------------------------------------------------


def foreign_directories_under_gc(trials: int, target: Target, seed: int = 13) -> Outcome:
    """Per trial a job directory holding checkpoints this library cannot read is collected
    with grace 0, dry run and real: Apache Flink's job directory (with in-progress
    checkpoints), a job of ours with an unknown-format and a newer-version `_metadata`, or a
    job of ours with one Flink `_metadata`. No file of theirs (nor of shared/) is lost, each is
    reported; an aborted checkpoint of ours still goes, unless a Flink `_metadata` makes the
    job directory Flink's (then nothing at all is deleted)."""
    fs = _real_fs(target)
    problems: list[str] = []
    failures = foreign_files = lost = reported = 0
    kinds = {"flink job": 0, "unknown formats": 0, "one flink checkpoint": 0}
    for trial in range(trials):
        before_problems = len(problems)
        rng = random.Random(seed * 1_000_003 + trial)
        storage = _storage(target, f"foreign-{uuid.uuid4().hex[:12]}")
        access = storage.create_checkpoint_storage(JobID.generate())
        job = access.checkpoints_directory
        kind = rng.choice(sorted(kinds))
        kinds[kind] += 1
        garbage: set[str] = set()
        if kind == "flink job":
            ids = sorted(rng.sample(range(1, 60), rng.randint(1, 4)))
            make_flink_job_directory(fs, job, ids=ids, shared_files=rng.randint(0, 12))
            for _ in range(rng.randint(0, 2)):  # Flink checkpoints still in progress
                _put(fs, f"{job}/chk-{max(ids) + rng.randint(1, 5)}/{uuid.uuid4()}", b"x" * 64)
            expected_reported = len(ids)
        else:
            access.initialize_base_locations()
            location, data = _prepare(access, 1, (seed, trial, 1))
            _commit(location, data)
            aborted = f"{job}/chk-2/{uuid.uuid4().hex}"
            _put(fs, aborted, payload(512, trial))
            garbage.add(type(fs)._strip_protocol(aborted))
            names = ["shared"]
            if kind == "one flink checkpoint":
                _put(fs, f"{job}/chk-3/_metadata", flink_metadata(rng.choice((4, 5, 6)), trial))
                names.append("chk-3")
                garbage.clear()  # Flink's job directory: not even our aborted checkpoint goes
            else:
                unknown = b"\x00" + rng.randbytes(rng.randint(0, 300))
                newer = MAGIC + (FORMAT_VERSION + rng.randint(1, 9)).to_bytes(2, "big")
                _put(fs, f"{job}/chk-3/_metadata", unknown)
                _put(fs, f"{job}/chk-4/_metadata", newer + rng.randbytes(rng.randint(14, 99)))
                names += ["chk-3", "chk-4"]
            for name in names:
                for _ in range(rng.randint(1, 3)):
                    _put(fs, f"{job}/{name}/{uuid.uuid4().hex}", payload(256, rng.random()))
            expected_reported = len(names) - 1
        before = _files(fs, job)
        protected = before - garbage
        now = time.time() + FUTURE
        dry = collect_garbage(access, grace_period=0, now=now, dry_run=True)
        real = collect_garbage(access, grace_period=0, now=now)
        after = _files(fs, job)
        missing = protected - after
        foreign_files += len(protected)
        lost += len(missing)
        reported += len(real.skipped)
        if missing:
            problems.append(f"{target.name} trial {trial} {kind}: lost {sorted(missing)[:3]}")
        if len(real.skipped) != expected_reported or len(dry.skipped) != expected_reported:
            problems.append(f"{target.name} trial {trial} {kind}: reported {real.skipped}")
        if after & garbage:
            problems.append(f"{target.name} trial {trial}: the aborted checkpoint stayed")
        if kind == "flink job" and not all(
            "Apache Flink (metadata format version 6)" in s.detail for s in real.skipped
        ):
            problems.append(f"{target.name} trial {trial}: Flink's files not named as Flink's")
        failures += len(problems) > before_problems
    figure = (
        f"{target.name} files lost: {lost} of {foreign_files} foreign and kept files; "
        f"checkpoints reported unreadable: {reported} "
        f"({', '.join(f'{k}={v}' for k, v in sorted(kinds.items()))})"
    )
    return Outcome(trials, failures, figure, problems)


# --- scenario: id mismatch ----------------------------------------------------------------


def id_mismatch(trials: int, target: Target, seed: int = 17) -> Outcome:
    """Per trial ``cp -r chk-<i> chk-<j>`` (j random, often the largest id) in a job with a few
    completed checkpoints: latest, the store and list never take chk-<j> for checkpoint j, the
    warning names both ids, and GC deletes none of its files."""
    fs = _real_fs(target)
    problems: list[str] = []
    failures = wrong_latest = copies_deleted = 0
    for trial in range(trials):
        before_problems = len(problems)
        rng = random.Random(seed * 1_000_003 + trial)
        storage = _storage(target, f"mismatch-{uuid.uuid4().hex[:12]}")
        access = storage.create_checkpoint_storage(JobID.generate())
        access.initialize_base_locations()
        ids = sorted(rng.sample(range(1, 40), rng.randint(1, 4)))
        for checkpoint_id in ids:
            location, data = _prepare(access, checkpoint_id, (seed, trial, checkpoint_id))
            _commit(location, data)
        source = rng.choice(ids)
        target_id = rng.choice([max(ids) + rng.randint(1, 100), rng.randint(1, 2**63 - 1)])
        job = access.checkpoints_directory
        copy = f"{job}/chk-{target_id}"
        source_path = type(fs)._strip_protocol(f"{job}/chk-{source}")
        for path in fs.find(source_path):
            _put(fs, copy + path[len(source_path) :], fs.cat_file(path))
        copied = _files(fs, copy)
        case = f"{target.name} trial {trial} chk-{source} -> chk-{target_id}"

        with _captured_warnings() as warnings:
            latest = access.latest_completed_checkpoint()
            store = FileSystemCompletedCheckpointStore(access, max_retained=len(ids) + 1)
        infos = list_checkpoints(job, storage_options=target.storage_options)
        result = collect_garbage(access, grace_period=0, now=time.time() + FUTURE)

        expected_latest = f"{job}/chk-{max(ids)}"
        if latest is None or latest.external_pointer != expected_latest:
            wrong_latest += 1
            problems.append(f"{case}: latest {latest}")
        if [c.checkpoint_id for c in store.all()] != ids:
            problems.append(f"{case}: store recovered {store.all()}")
        row = next((i for i in infos if i.checkpoint_id == target_id), None)
        if row is None or row.status != "invalid" or f"chk-{target_id}" not in (row.reason or ""):
            problems.append(f"{case}: list row {row}")
        both = f"holds checkpoint {source} but its directory is chk-{target_id}"
        if not any(both in w for w in warnings):
            problems.append(f"{case}: no warning names both ids: {warnings[:2]}")
        lost = copied - _files(fs, copy)
        copies_deleted += len(lost)
        if lost or [s.reason for s in result.skipped] != ["id mismatch"]:
            problems.append(f"{case}: GC lost {sorted(lost)[:2]}, skipped {result.skipped}")
        failures += len(problems) > before_problems
    figure = (
        f"{target.name} copies taken for latest: {wrong_latest} of {trials}; files of copies "
        f"deleted by GC: {copies_deleted}"
    )
    return Outcome(trials, failures, figure, problems)


# --- the runner's table --------------------------------------------------------------------

SCENARIOS = {}
for _name, _function, _s3_share in (
    ("trust_foreign_directories_under_gc", foreign_directories_under_gc, 5),
    ("trust_id_mismatch", id_mismatch, 5),
):
    SCENARIOS[f"{_name}_local"], SCENARIOS[f"{_name}_s3"] = _on_each_backend(
        _function, s3_share=_s3_share
    )

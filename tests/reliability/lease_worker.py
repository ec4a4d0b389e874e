"""One coordinator process of the lease scenarios (``scenarios_lease``).

Usage: ``lease_worker.py CONFIG_JSON`` with keys ``base`` (checkpoint directory URL),
``job_id``, ``storage_options``, ``ttl``, ``mode`` and, per mode:

- ``race``: wait for the file ``start`` to exist, take the lease with ``wait``, commit one
  checkpoint under it, hold it ``hold`` seconds, release; print one JSON line: pid, epoch,
  acquired and released (wall clock; the process believes it owns the job in between),
  checkpoint id and the epoch its `_metadata` records.
- ``hold``: take the lease (auto renewed), print ``{"epoch": n}`` and sleep until killed.

Errors are printed as ``{"error": ...}`` with exit status 1.
"""

import json
import os
import sys
import time


def main() -> int:
    config = json.loads(sys.argv[1])
    from checkpoint_storage import (
        CheckpointMetadata,
        FileSystemCheckpointStorage,
        store_checkpoint_metadata,
    )

    storage = FileSystemCheckpointStorage(
        config["base"], storage_options=config.get("storage_options") or {}
    )
    access = storage.create_checkpoint_storage(config["job_id"])
    owner = f"worker-{os.getpid()}"
    if config["mode"] == "hold":
        lease = access.acquire_job_lease(owner, ttl=config["ttl"], wait=config.get("wait"))
        print(json.dumps({"pid": os.getpid(), "epoch": lease.epoch}), flush=True)
        while True:
            time.sleep(1)
    while not os.path.exists(config["start"]):
        time.sleep(0.01)
    with access.acquire_job_lease(owner, ttl=config["ttl"], wait=config["wait"]) as lease:
        acquired = time.time()
        checkpoint_id = access.next_checkpoint_id()
        location = access.initialize_location_for_checkpoint(checkpoint_id)
        out = location.create_metadata_output_stream()
        store_checkpoint_metadata(CheckpointMetadata(checkpoint_id), out)
        completed = out.close_and_finalize_checkpoint()
        recorded = completed.load_metadata().lease_epoch
        time.sleep(config["hold"])
        released = time.time()
        epoch = lease.epoch
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "epoch": epoch,
                "acquired": acquired,
                "released": released,
                "checkpoint_id": checkpoint_id,
                "recorded_epoch": recorded,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # noqa: BLE001 - reported to the scenario as one JSON line
        print(json.dumps({"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)

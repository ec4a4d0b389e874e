"""``checkpoints gc``, ``dispose-savepoint`` and ``copy-savepoint``: the commands that
delete or write (deletion is in Flink's order: `_metadata` first)."""

import os
from typing import Annotated

import typer

from checkpoint_storage import (
    JobID,
    collect_garbage,
    copy_savepoint,
    corruption_of,
    dispose_savepoint,
    job_storage,
    resolve_checkpoint_pointer,
    snapshot_kind,
    url_to_fs,
)
from checkpoint_storage.cli.helpers import (
    ENV_TARGET_OPTIONS,
    EPILOG,
    EXIT_ERROR,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_PROBLEMS,
    DirArgument,
    JsonOption,
    PointerArgument,
    StorageOption,
    TargetStorageOption,
    UsageError,
    activity,
    command_help,
    counted,
    echo,
    error,
    location,
    one_line,
    parse_duration,
    print_json,
    progress,
    run_command,
    storage_options,
)
from checkpoint_storage.exceptions import InvalidCheckpointError, UnsafePathError

__all__ = ["copy_command", "dispose_command", "gc_command", "register"]

DEFAULT_GRACE_PERIOD = "1h"
SKIPPED_UNREADABLE = "unreadable"  # a SkippedCheckpoint.reason: gc kept it, exit 5 (not 4)


def register(app: typer.Typer) -> None:
    """Add ``gc``, ``dispose-savepoint`` (alias ``dispose``) and ``copy-savepoint`` to the
    ``checkpoints`` app."""
    app.command("gc", help=command_help(gc_command), epilog=EPILOG)(gc_command)
    app.command("dispose-savepoint", help=command_help(dispose_command), epilog=EPILOG)(
        dispose_command
    )
    app.command("dispose", help=command_help(dispose_command), epilog=EPILOG, hidden=True)(
        dispose_command
    )
    app.command("copy-savepoint", help=command_help(copy_command), epilog=EPILOG)(copy_command)


def _gc(
    directory_arg: str,
    as_json: bool,
    options: dict,
    *,
    grace_period: str,
    dry_run: bool,
    delete_corrupt: bool,
) -> int:
    directory = location(directory_arg)
    grace = parse_duration(grace_period)
    name = directory.rstrip("/").rpartition("/")[2]
    try:
        JobID(name)
    except ValueError:
        raise UsageError(
            f"gc needs a job directory <base>/<job_id> (32 hex characters), got {directory}"
        ) from None
    access = job_storage(directory, options)
    fs, path = url_to_fs(directory, options)
    fs.invalidate_cache(path)
    fs.info(path)  # FileNotFoundError (exit 3) for a job directory that does not exist
    with activity("collecting garbage"):
        try:
            result = collect_garbage(
                access, grace_period=grace, dry_run=dry_run, delete_corrupt=delete_corrupt
            )
        except (FileNotFoundError, ValueError, InvalidCheckpointError):
            raise
        except OSError as exc:
            error(f"gc of {directory} failed: {one_line(exc)}")
            return EXIT_PROBLEMS
    if as_json:
        print_json(
            {
                "dry_run": bool(result.dry_run),
                "deleted": list(result.deleted),
                "kept": list(result.kept),
                "bytes_deleted": result.bytes_deleted,
                "removed_directories": list(getattr(result, "removed_directories", ())),
                "skipped": [
                    {
                        "pointer": s.pointer,
                        "metadata": s.metadata,
                        "reason": s.reason,
                        "detail": s.detail,
                    }
                    for s in result.skipped
                ],
                "shared_collected": result.shared_collected,
            }
        )
    else:
        verb = "would delete" if result.dry_run else "deleted"
        echo(f"{directory}: {result.summary()}")
        for url in result.deleted:
            echo(f"  {verb}: {url}")
        for s in result.skipped:
            echo(f"  kept ({s.reason}): {s.pointer}: {s.detail}")
    if not result.skipped:
        return EXIT_OK
    first = result.skipped[0]
    error(
        f"gc of {directory} kept {counted(len(result.skipped), 'checkpoint')} whose _metadata "
        f"it cannot read, and shared/: first {first.metadata} ({first.reason}): {first.detail}"
    )
    if all(s.reason == SKIPPED_UNREADABLE for s in result.skipped):
        return EXIT_ERROR
    return EXIT_INVALID


def _dispose(pointer_arg: str, as_json: bool, options: dict, *, force: bool, corrupt: bool):
    pointer = location(pointer_arg)
    # Resolve and load first: "not found" (3), "corrupt" (4) and I/O errors before anything is
    # deleted (5) keep their exit codes; only failures while deleting are exit 1.
    completed = resolve_checkpoint_pointer(pointer, options)
    if corrupt:
        problem = corruption_of(completed)  # raises for foreign (4) and unreadable (5)
        if problem is None:
            raise UsageError(
                f"{completed.external_pointer} is not corrupt (its _metadata is valid): "
                "--corrupt only disposes a checkpoint whose _metadata is corrupt"
            )
        message = f"disposed corrupt {completed.external_pointer} ({one_line(problem)})"
        return _dispose_reporting(completed, options, as_json, message, corrupt=True)
    metadata = completed.load_metadata()
    if not metadata.properties.is_savepoint() and not force:
        raise UsageError(
            f"{completed.external_pointer} is a {snapshot_kind(metadata)}, not a savepoint: "
            "checkpoints are disposed by their job's retention; pass --force to dispose it"
        )
    message = f"disposed {completed.external_pointer}"
    return _dispose_reporting(completed, options, as_json, message, force=force)


def _dispose_reporting(completed, options: dict, as_json: bool, message: str, **flags) -> int:
    """``dispose_savepoint`` with the CLI's reporting: deletion failures exit 1; not found
    (disposed concurrently), invalid and usage errors keep their own exit codes."""
    try:
        dispose_savepoint(completed.external_pointer, storage_options=options, **flags)
    except (FileNotFoundError, InvalidCheckpointError, UnsafePathError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001 - deletion failures: exit 1
        error(f"disposing {completed.external_pointer} failed: {one_line(exc)}")
        return EXIT_PROBLEMS
    if as_json:
        print_json({"pointer": completed.external_pointer, "disposed": True})
    else:
        echo(message)
    return EXIT_OK


def _copy(pointer_arg: str, target_arg: str, as_json: bool, options: dict, target_flags) -> int:
    source = location(pointer_arg)
    target = location(target_arg)
    target_options = (
        storage_options(target_flags, ENV_TARGET_OPTIONS)
        if target_flags or os.environ.get(ENV_TARGET_OPTIONS)
        else None
    )
    with progress("copying") as update:
        pointer = copy_savepoint(
            source,
            target,
            storage_options=options,
            target_storage_options=target_options,
            progress=update,
        )
    if as_json:
        print_json({"source": source, "pointer": pointer})
    else:
        echo(pointer)
    return EXIT_OK


def gc_command(
    directory: DirArgument,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="print what would be deleted; delete nothing")
    ] = False,
    delete_corrupt: Annotated[
        bool,
        typer.Option(
            "--delete-corrupt",
            help="also delete checkpoints of this library whose _metadata is corrupt (after "
            "the grace period); foreign, mismatched and unreadable ones are never deleted",
        ),
    ] = False,
    grace_period: Annotated[
        str,
        typer.Option(
            "--grace-period",
            metavar="DURATION",
            help="keep files younger than this, e.g. 3600s, 30m, 1h, 2d; must exceed the "
            "longest checkpoint's duration",
        ),
    ] = DEFAULT_GRACE_PERIOD,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Delete unreferenced files of a job.

    Deletes the files under the job directory DIR (<base>/<job_id>) that no retained
    checkpoint or savepoint references and that are older than the grace period. Never
    touches referenced files, taskowned/ or savepoints. A checkpoint whose _metadata cannot
    be read (Apache Flink's or another format, corrupt, of another id than its chk-<id>, or
    unreadable) keeps all its files, and while there is one nothing in shared/ is collected;
    gc names each and exits 4 (5 if only unreadable ones). JSON keys: dry_run, deleted,
    kept, bytes_deleted, removed_directories, skipped (pointer, metadata, reason, detail),
    shared_collected.
    """
    run_command(
        lambda: _gc(
            directory,
            json_output,
            storage_options(storage_option),
            grace_period=grace_period,
            dry_run=dry_run,
            delete_corrupt=delete_corrupt,
        )
    )


def dispose_command(
    pointer: PointerArgument,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="dispose even if _metadata says it is a checkpoint (its shared state is kept)",
        ),
    ] = False,
    corrupt: Annotated[
        bool,
        typer.Option(
            "--corrupt",
            help="dispose a checkpoint whose _metadata is corrupt (only such a one); its "
            "directory goes, shared state stays for gc",
        ),
    ] = False,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Delete a savepoint (_metadata first); alias: dispose.

    Deletes the savepoint POINTER in Flink's order: _metadata first (from then on it is no
    longer addressable), then its state files, then its directory. Refuses a checkpoint
    unless --force. With --corrupt, deletes a checkpoint or savepoint of this library whose
    _metadata is corrupt (and refuses any other): _metadata first, then its own directory.
    Exits 1 if some files could not be deleted.
    """
    run_command(
        lambda: _dispose(
            pointer, json_output, storage_options(storage_option), force=force, corrupt=corrupt
        )
    )


def copy_command(
    pointer: PointerArgument,
    target: Annotated[str, typer.Argument(metavar="TARGET", show_default=False)],
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
    target_storage_option: TargetStorageOption = None,
) -> None:
    """Copy a savepoint to another directory or filesystem.

    Copies the savepoint POINTER into TARGET (another directory or filesystem, e.g.
    s3://bucket/savepoints) as TARGET/<savepoint directory name>: state files first,
    _metadata last, then verifies the copy and prints its pointer. JSON keys: source,
    pointer.
    """
    run_command(
        lambda: _copy(
            pointer,
            target,
            json_output,
            storage_options(storage_option),
            target_storage_option,
        )
    )


"""``checkpoints lease show`` and ``lease break``: the job directory's lease (one
coordinator per job)."""

from datetime import UTC, datetime
from typing import Annotated

import typer

from checkpoint_storage import (
    LeaseRecord,
    break_job_lease,
    default_lease_owner,
    read_job_lease,
    url_to_fs,
)
from checkpoint_storage.cli.helpers import (
    EPILOG,
    EXIT_OK,
    DirArgument,
    JsonOption,
    StorageOption,
    UsageError,
    command_help,
    echo,
    iso_utc,
    location,
    one_line,
    print_json,
    run_command,
    storage_options,
)
from checkpoint_storage.exceptions import JobLeaseHeldError

__all__ = ["lease_break_command", "lease_show_command", "register"]


def register(app: typer.Typer) -> None:
    """Add ``lease show`` and ``lease break`` to the ``checkpoints`` app."""
    lease = typer.Typer(
        help="Show or break a job directory's lease. A coordinator holds its job directory's "
        "lease (DIR/_lease) while it writes checkpoints: one coordinator per job.",
        epilog=EPILOG,
        no_args_is_help=False,
    )
    lease.command("show", help=command_help(lease_show_command), epilog=EPILOG)(
        lease_show_command
    )
    lease.command("break", help=command_help(lease_break_command), epilog=EPILOG)(
        lease_break_command
    )
    app.add_typer(lease, name="lease")


def _lease_json(directory: str, record: LeaseRecord | None) -> dict:
    if record is None:
        return {"directory": directory, "state": "none", "epoch": None, "owner": None}
    unreadable = record.unreadable is not None

    def moment(value: float) -> str | None:
        return None if unreadable else iso_utc(datetime.fromtimestamp(value, UTC))

    return {
        "directory": directory,
        "state": record.state(),
        "epoch": record.epoch,
        "owner": None if unreadable else record.owner,
        "acquired_at": moment(record.acquired_at),
        "renewed_at": moment(record.renewed_at),
        "expires_at": moment(record.expires_at),
        "ttl_seconds": None if unreadable else record.ttl_seconds,
        "broken_by": record.broken_by,
        "reason": record.unreadable,
    }


def _lease_show(directory_arg: str, as_json: bool, options: dict) -> int:
    directory = location(directory_arg)
    fs, path = url_to_fs(directory, options)
    record = read_job_lease(fs, path)
    if as_json:
        print_json(_lease_json(directory, record))
    elif record is None:
        echo(f"{directory}: no lease has been taken")
    else:
        echo(f"{directory}: {record.describe()}")
    return EXIT_OK


def _lease_break(directory_arg: str, as_json: bool, options: dict, *, force: bool) -> int:
    directory = location(directory_arg)
    fs, path = url_to_fs(directory, options)
    try:
        broken = break_job_lease(
            fs, path, by=f"checkpoints lease break ({default_lease_owner()})", force=force
        )
    except JobLeaseHeldError as exc:
        raise UsageError(
            f"{one_line(exc)}; pass --force to break it anyway (only when that coordinator "
            "is gone)"
        ) from None
    if as_json:
        print_json(
            {
                "directory": directory,
                "broken": broken is not None,
                "previous": None if broken is None else _lease_json(directory, broken),
            }
        )
    elif broken is None:
        echo(f"{directory}: no lease to break (never taken, or released)")
    else:
        echo(f"{directory}: broke the lease ({broken.describe()})")
    return EXIT_OK


def lease_show_command(
    directory: DirArgument, json_output: JsonOption = False, storage_option: StorageOption = None
) -> None:
    """Who holds the lease.

    Shows the lease of the job directory DIR (<base>/<job_id>): state (held / expired /
    released / unreadable / none), epoch, owner, when it was acquired and renewed, and when
    it expires. JSON keys: directory, state, epoch, owner, acquired_at, renewed_at,
    expires_at, ttl_seconds, broken_by, reason.
    """
    run_command(lambda: _lease_show(directory, json_output, storage_options(storage_option)))


def lease_break_command(
    directory: DirArgument,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="break the lease even though its holder renewed it within its ttl"
        ),
    ] = False,
    json_output: JsonOption = False,
    storage_option: StorageOption = None,
) -> None:
    """Break a stale lease.

    Breaks the lease of the job directory DIR: the next epoch is written as a released
    tombstone, so the old holder can no longer publish checkpoints and the next coordinator
    takes the lease at once. A lease that is still held (renewed within its ttl) is refused
    (exit 2) unless --force. JSON keys: directory, broken, previous (as in lease show).
    """
    run_command(
        lambda: _lease_break(directory, json_output, storage_options(storage_option), force=force)
    )


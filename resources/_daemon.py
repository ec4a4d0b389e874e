"""Spark's Python worker daemon (``pyspark.daemon``), quiet when a cancelled task's worker
finds its socket closed. Sessions built by ``build_spark_session`` run it
(``spark.python.daemon.module``).

A task cancelled while its Python worker runs (Ctrl-C in ``scripts/run`` cancels every job)
has its socket closed by the JVM; the worker's last flush then fails, and ``pyspark.daemon``
prints that ``BrokenPipeError`` with a traceback on the driver's console. Nobody is left to
read that output: the JVM already abandoned the task and reports its failure itself. Here
that worker ends quietly instead, as a failed worker (not reused); everything else is
``pyspark.daemon`` unchanged. Imports no Dagster: it runs in the daemon's process.
"""

import pyspark.daemon as _pyspark_daemon

__all__ = ["worker"]

_worker = _pyspark_daemon.worker


def worker(sock, authenticated: bool) -> int:
    """``pyspark.daemon.worker``; 1 (a failed worker) when the JVM closed the socket."""
    try:
        return _worker(sock, authenticated)
    except (BrokenPipeError, ConnectionResetError):
        return 1


# The daemon's manager calls ``worker`` by its module-level name in each forked worker.
_pyspark_daemon.worker = worker

if __name__ == "__main__":
    _pyspark_daemon.manager()

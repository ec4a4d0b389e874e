"""Rewinds that lose nothing, time travel over 48 hourly partition ends, and failures at random
points recovered (issue 25): the reliability scenarios of scenarios_operations.py, small."""

import pytest

from tests.reliability import scenarios_operations

# The suite's session (tests/conftest.py): a module's own ``build_spark_session`` got that
# session back from getOrCreate, and stopping it at the module's end stopped it for the
# tests after this module.


@pytest.mark.timeout(600)
def test_rewinds_lose_nothing(spark):
    """Two rewinds: backfill 3-5 from a savepoint at the end of 2, and from the retained end
    of 2 without a savepoint; then 9."""
    outcome = scenarios_operations.rewind(2, spark=spark)
    print(outcome.figure)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(600)
def test_every_retained_partition_end_restores(spark):
    """50 hourly partitions, the last 48 ends retained: each restores and reads as the
    recomputation; GC leaves exactly the referenced files."""
    outcome = scenarios_operations.time_travel(spark=spark)
    print(outcome.figure)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(600)
def test_failures_at_random_points_are_recovered(spark):
    """Three runs, each failed at a random point (one of each kind) and recovered."""
    outcome = scenarios_operations.recovery(3, spark=spark)
    print(outcome.figure)
    assert (0, []) == (outcome.failures, outcome.problems)

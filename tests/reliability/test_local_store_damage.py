"""Local keyed-state stores damaged at random between and during runs (issue 24): no wrong value is
ever committed; every damaged store is rebuilt from the checkpoint, with a warning naming the
damage."""

import pytest

from tests.reliability import scenarios_store

# The scenarios run keyed pipelines on a local Spark in a subprocess.
pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_damaged_local_stores_never_commit_a_wrong_value():
    """20 rounds (bit flips at random offsets, truncations, deleted files, stale copies)."""
    outcome = scenarios_store.local_store_damage(20)
    print(outcome.figure)
    assert (0, []) == (outcome.failures, outcome.problems)


@pytest.mark.timeout(600)
def test_local_stores_damaged_during_a_run_never_commit_a_wrong_value():
    """10 rounds, each store damaged between two batches of one run: the workers that already
    verified it must notice the change (its inode, size or times) and rebuild."""
    outcome = scenarios_store.local_store_damage(10, seed=2424, during=True)
    print(outcome.figure)
    assert (0, []) == (outcome.failures, outcome.problems)

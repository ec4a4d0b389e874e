"""The Dagster run tags this package reads and writes. Dagster documents them as tags (they
show on every run in the UI); the constants are ours, so nothing here imports Dagster's
private modules."""

PARTITION_NAME_TAG = "dagster/partition"
ASSET_PARTITION_RANGE_START_TAG = "dagster/asset_partition_range_start"
ASSET_PARTITION_RANGE_END_TAG = "dagster/asset_partition_range_end"
MAX_RETRIES_TAG = "dagster/max_retries"
RETRY_NUMBER_TAG = "dagster/retry_number"

"""``format("checkpoint")`` found by Spark itself: on a session's first use of a format it does
not know (or first registration), Spark looks installed Python data sources up once per JVM,
importing each ``pyspark_*`` module on its Python path and taking its ``DefaultSource``.
``pipelines.state_source`` puts this directory (this module only: the lookup imports
nothing else from it) on the path of the sessions ``build_spark_session`` starts."""

from pipelines.state_source import CheckpointDataSource as DefaultSource

__all__ = ["DefaultSource"]

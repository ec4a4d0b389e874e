"""YAML-defined pipelines: one folder per pipeline with a ``defs.yaml`` for
``sensors.StatefulPipelineComponent`` (``dg scaffold defs sensors.StatefulPipelineComponent
<name>`` creates one). The code location loads this folder next to its Python pipelines."""

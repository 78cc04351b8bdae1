"""Entry points: the Python API's one orchestration path (a stage of the pipeline: docs/design.md)."""

"""Solve: the search, and pipeline stages around it (a stage of the pipeline: docs/design.md)."""

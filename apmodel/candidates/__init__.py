"""Candidates: every placement of every node (a stage of the pipeline: docs/design.md)."""

"""The placement problem: groups, costs, memory, constraints (a stage of the pipeline: docs/design.md)."""

"""What to plan: the workload and the machine it runs on (a stage of the pipeline: docs/design.md)."""

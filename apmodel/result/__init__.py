"""The plan: its file, its price and step timeline (a stage of the pipeline: docs/design.md)."""

"""Reading a plan: roles, recipes, the report (a stage of the pipeline: docs/design.md)."""

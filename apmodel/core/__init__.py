"""The shared vocabulary: placements, options, schedules, number formats, local kernels (a stage of the pipeline: docs/design.md)."""

"""Capture: the joint forward-backward graph of one step, and what it is made of (a stage of the pipeline: docs/design.md)."""

"""apmodel: automatic parallelism planning for PyTorch training steps."""

"""The torch distributed optimizer: per-bucket updates (optimizer.py), sharded state (sharded.py)."""

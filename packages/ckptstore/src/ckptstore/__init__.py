"""Verified, atomic, async PyTorch checkpoints on any fsspec URL, in torch or DCP format."""

__version__ = "0.1.0"

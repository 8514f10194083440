"""Parquet text to tokens to packed, sharded, exactly resumable language-model batches."""

__version__ = "0.1.0"

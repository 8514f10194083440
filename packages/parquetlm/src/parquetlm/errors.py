"""Errors. Every problem with the user's input is a :class:`ParquetLMError` (a ``ValueError``)
whose message names the problem and how to fix it, in one line."""

from __future__ import annotations


class ParquetLMError(ValueError):
    """Bad input: a missing file, a wrong column, a corrupt tokenizer, an impossible setting."""


class SourceError(ParquetLMError):
    """The parquet source cannot be read as asked (missing file, not parquet, wrong column)."""


class EmptyDatasetError(SourceError):
    """The source holds no text at all (no files, no rows, or only null rows)."""


class TokenizerError(ParquetLMError):
    """A tokenizer cannot be loaded or built (corrupt file, unknown name, missing extra)."""


class MissingExtraError(TokenizerError):
    """An optional dependency is not installed; the message says which extra to install."""


class CacheError(ParquetLMError):
    """A token cache on disk is unusable (incomplete, corrupt, or for other data)."""


class LoaderError(ParquetLMError):
    """The loader cannot be made as asked (seq_len too long for the corpus, bad split or state)."""


class CacheRebuiltWarning(UserWarning):
    """A token cache found damaged on disk (``verify=True``, or sizes that do not match) was
    deleted and is built again; the message names what was damaged."""


class NullRowsWarning(UserWarning):
    """Null rows were skipped while reading the text column (they are counted, not tokenized)."""

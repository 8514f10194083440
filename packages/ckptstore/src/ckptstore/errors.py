"""Exceptions. Every message names the checkpoint (URL, file) and says what to do about it."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: anything ckptstore refuses or fails to do."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated, bit-flipped), or its
    manifest or payload is not a valid ckptstore file (including pickles, which are refused)."""


class NoCheckpointError(CheckpointError):
    """Nothing loadable: no committed checkpoint, or every candidate failed verification."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is intact but does not fit: unknown format or version, missing keys,
    shape or dtype mismatches with the state it is loaded into."""


class MirrorError(CheckpointError):
    """Copying a committed checkpoint to the mirror URL failed (the primary copy is fine)."""

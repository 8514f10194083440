"""Verified, atomic, async PyTorch checkpoints on any fsspec URL, in torch or DCP format."""

__version__ = "0.1.0"

from .errors import (  # noqa: E402 - __version__ first: store.py records it in manifests
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MirrorError,
    NoCheckpointError,
)
from .formats import (  # noqa: E402
    CheckpointFormat,
    LoadContext,
    SaveContext,
    available_formats,
    get_format,
    register_format,
)
from .manifest import (  # noqa: E402
    CheckpointInfo,
    FileReport,
    Manifest,
    SaveStats,
    VerifyReport,
)
from .retention import RetentionPolicy  # noqa: E402
from .storage import IOOptions  # noqa: E402
from .store import CheckpointStore, CheckpointWarning, SaveHandle  # noqa: E402

__all__ = [
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointInfo",
    "CheckpointStore",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "FileReport",
    "IOOptions",
    "IncompatibleCheckpointError",
    "LoadContext",
    "Manifest",
    "MirrorError",
    "NoCheckpointError",
    "RetentionPolicy",
    "SaveContext",
    "SaveHandle",
    "SaveStats",
    "VerifyReport",
    "__version__",
    "available_formats",
    "get_format",
    "register_format",
]

"""Verified, atomic, async PyTorch checkpoints on any fsspec URL, in torch or DCP format."""

from ._version import __version__
from .errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    LockedError,
    MirrorError,
    NoCheckpointError,
    StoreConfigError,
    StoreUnreachableError,
    unreachable,
)
from .exporting import ExportReport, export_checkpoint
from .foreign import Foreign, foreign_kind, read_foreign
from .formats import (
    CheckpointFormat,
    LoadContext,
    SaveContext,
    available_formats,
    get_format,
    register_format,
)
from .importing import ImportReport, import_checkpoint
from .layout import (
    ExperimentLocation,
    Scan,
    StepSpec,
    experiment_location,
    validate_experiment_name,
)
from .limits import CallLimits
from .lock import LockInfo
from .manifest import (
    CheckpointInfo,
    FileReport,
    Manifest,
    SaveStats,
    SaveTimings,
    VerifyReport,
)
from .mirror import check_mirror
from .outage import Outage
from .plugins import PluginError
from .retention import Pruning, RetentionPolicy
from .storage import (
    IOOptions,
    Storage,
    available_storages,
    get_storage,
    open_storage,
    parse_storage_options,
    register_storage,
)
from .store import CheckpointStore, SaveHandle, check_plugins

__all__ = [
    "PluginError",
    "check_plugins",
    "CallLimits",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointInfo",
    "CheckpointStore",
    "CheckpointWarning",
    "CorruptCheckpointError",
    "ExperimentLocation",
    "ExportReport",
    "Foreign",
    "FileReport",
    "IOOptions",
    "ImportReport",
    "IncompatibleCheckpointError",
    "LoadContext",
    "LockInfo",
    "LockedError",
    "Manifest",
    "ModelState",
    "MirrorError",
    "NoCheckpointError",
    "OptimizerState",
    "Outage",
    "Pruning",
    "RetentionPolicy",
    "SaveContext",
    "SaveHandle",
    "SaveStats",
    "SaveTimings",
    "Scan",
    "StepSpec",
    "Storage",
    "StoreConfigError",
    "StoreUnreachableError",
    "VerifyReport",
    "__version__",
    "available_formats",
    "available_storages",
    "check_mirror",
    "experiment_location",
    "export_checkpoint",
    "foreign_kind",
    "get_format",
    "get_storage",
    "import_checkpoint",
    "open_storage",
    "parse_storage_options",
    "read_foreign",
    "register_format",
    "register_storage",
    "unreachable",
    "validate_experiment_name",
]


def __getattr__(name: str) -> object:
    # The FSDP2 wrappers import torch.distributed.checkpoint: only when asked for, so that
    # `import ckptstore` (the CLI, verify, list) stays free of torch.
    if name in ("ModelState", "OptimizerState"):
        from . import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")

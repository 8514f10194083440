"""Checkpoints of other tools, read without running their code, and brought in as verified
ckptstore checkpoints.

``read_foreign(source)`` recognises what ``source`` is and reads it into a ckptstore state:

- a plain ``torch.save`` file (a model ``state_dict``, or a dict of entries);
- a ``torch.distributed.checkpoint`` folder (``.metadata``; written by any number of ranks);
- a safetensors file (a ckptstore export or ``torch`` payload comes back whole);
- a Lightning ``.ckpt`` file;
- a Hugging Face Trainer ``checkpoint-N`` folder (``model.safetensors`` or ``pytorch_model.bin``,
  sharded or not, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``).

Nothing is unpickled beyond what ``torch.load(weights_only=True)`` allows (plus numpy arrays,
which RNG states hold, as Hugging Face's own loader does); DCP's ``.metadata`` goes through an
unpickler that knows only DCP's metadata classes. A file that needs more (a pickled object) is
refused with one line, or, inside a folder, left out and named in ``Foreign.left``.

Entries get the names a training state uses: ``model``, ``optim``, ``scheduler``, ``step``,
``rng`` (from the usual spellings: ``model_state_dict``, ``optimizer``, ``global_step``, ...);
everything else keeps its own name. ``Foreign.summary()`` says in one line what was taken and
what not; ``ckptstore.importing.import_checkpoint`` saves it as a verified checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError, CorruptCheckpointError
from .manifest import MANIFEST_NAME
from .stfile import read_safetensors

ROLES: dict[str, tuple[str, ...]] = {  # a training state's entries, and how others spell them
    "model": ("model", "model_state_dict", "state_dict", "model_state", "module", "net"),
    "optim": ("optim", "optimizer", "optimizer_state_dict", "optimizer_state", "opt"),
    "scheduler": ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched"),
    "step": ("step", "global_step", "iteration", "iter"),
    "rng": ("rng", "rng_state", "rng_states"),
}
KINDS = ("torch.save", "dcp", "safetensors", "lightning", "hf-trainer")  # Foreign.kind
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
_HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_HF_PARTS = {
    "optimizer.pt": "optim",
    "scheduler.pt": "scheduler",
    "scaler.pt": "scaler",
}
_HF_EXPECTED = {  # what the Trainer writes into every checkpoint-N (file -> entry)
    "model weights": "model",
    "optimizer.pt": "optim",
    "scheduler.pt": "scheduler",
    "rng_state.pth": "rng",
    "trainer_state.json": "trainer_state",
}
_FRESH = {  # what a resume loses without an entry
    "model": "the weights start from scratch",
    "optim": "the optimizer starts without its moments",
    "scheduler": "the LR schedule starts over",
    "rng": "the random streams (dropout, data order) start anew",
    "trainer_state": "no step, epoch or progress",
}


@dataclass(frozen=True, slots=True)
class Foreign:
    """A foreign checkpoint read into a ckptstore state.

    ``state``: ``{entry: value}`` ready for ``CheckpointStore.save`` (model and optimizer as
    state dicts); ``step``: the step the source recorded (None if it did not); ``took``: entry ->
    what it holds and where it came from; ``left``: what the source holds that ``state`` does
    not, and why; ``missing``: what a complete checkpoint of its kind holds and this one lacks,
    and what a resume from it loses for want of it (a resume is then not exact)."""

    source: str
    kind: str
    state: dict[str, Any]
    step: int | None
    took: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)

    @property
    def has_model(self) -> bool:
        return "model" in self.state

    @property
    def has_optimizer(self) -> bool:
        return "optim" in self.state

    def summary(self) -> str:
        """One line: the kind, the step, what was taken and what was not."""
        step = "no step" if self.step is None else f"step {self.step}"
        took = ", ".join(f"{k} ({v})" for k, v in self.took.items()) or "nothing"
        left = "; ".join(f"{k}: {v}" for k, v in self.left.items()) or "nothing"
        line = f"{self.kind} checkpoint {self.source} ({step}): took {took}; left out {left}"
        return line + (f"; {self.incomplete()}" if self.missing else "")

    def incomplete(self) -> str:
        """What is missing, in words ("" when nothing is)."""
        if not self.missing:
            return ""
        what = "; ".join(f"{k} ({v})" for k, v in self.missing.items())
        return f"not a complete {self.kind} checkpoint, a resume from it is not exact: no {what}"


# -- entry points ------------------------------------------------------------------------------
def read_foreign(source: str, *, storage_options: dict[str, Any] | None = None) -> Foreign:
    """Read ``source`` (a path or fsspec URL) as the foreign checkpoint it is; never unpickles
    an object. CheckpointError (one line) if it is none of the kinds above or is damaged."""
    fs, path = _open_fs(source, storage_options)
    kind = detect(fs, path, source)
    if kind == "dcp":
        return _read_dcp(fs, path, source, storage_options)
    reader = {
        "torch.save": _read_torch_save,
        "safetensors": _read_safetensors_file,
        "hf-trainer": _read_hf,
    }[kind]
    return reader(fs, path, source)


def detect(fs: Any, path: str, source: str) -> str:
    """Which kind of checkpoint ``path`` is; CheckpointError (one line) if none."""
    if not fs.exists(path):
        raise CheckpointError(f"{source}: no such file or folder")
    if fs.isdir(path):
        names = {n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)}
        if MANIFEST_NAME in names or "latest" in names or any(n.startswith("step-") for n in names):
            raise CheckpointError(
                f"{source} is a ckptstore checkpoint already: load it, or copy it with "
                "ckptstore export"
            )
        if ".metadata" in names:
            return "dcp"
        if "trainer_state.json" in names or _hf_weights(names):
            return "hf-trainer"
        raise CheckpointError(
            f"{source} is not a checkpoint ckptstore can import: a DCP folder has .metadata, a "
            "Hugging Face Trainer checkpoint-N folder has trainer_state.json or model.safetensors"
            " / pytorch_model.bin"
        )
    with fs.open(path, "rb") as f:
        head = f.read(9)
    if head.startswith(_PICKLE_MAGICS):
        return "torch.save"  # Lightning's .ckpt too: told apart once read
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    raise CheckpointError(
        f"{source} is not a checkpoint ckptstore can import (not a torch.save, Lightning or "
        f"safetensors file: it starts with {head[:8]!r})"
    )


def foreign_kind(source: str, storage_options: dict[str, Any] | None = None) -> tuple[str, str]:
    """``(kind, line)`` for what a reader finds at ``source`` when it is not a ckptstore
    checkpoint: the kind of foreign checkpoint and a one-line pointer at ``ckptstore import``,
    or ``("", why it is no checkpoint at all)``; ``("", "")`` when there is nothing there or it
    is a ckptstore checkpoint. Reads at most a few bytes."""
    try:
        fs, path = _open_fs(source, storage_options)
        if not fs.exists(path):
            return "", ""
        kind = detect(fs, path, source)
    except CheckpointError as e:
        return ("", "") if "ckptstore checkpoint already" in str(e) else ("", str(e))
    except Exception:
        return "", ""
    return kind, (
        f"{source} is a {kind} checkpoint, not a ckptstore one: bring it in with "
        f"`ckptstore import {source} DEST` (Python: ckptstore.import_checkpoint), then use DEST"
    )


# -- torch.save and Lightning -----------------------------------------------------------------
def _read_torch_save(fs: Any, path: str, source: str) -> Foreign:
    obj = _torch_load(fs, path, source)
    if isinstance(obj, Mapping) and "pytorch-lightning_version" in obj:
        return _lightning(obj, source)
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        state: dict[str, Any] = {"model": dict(obj)}
        took = {"model": f"{_tensors(obj)}, the whole file"}
        return Foreign(source, "torch.save", state, None, took)
    if not isinstance(obj, Mapping):
        return Foreign(source, "torch.save", {"model": obj}, None, {"model": "the whole file"})
    state, took = _roles(obj)
    return Foreign(source, "torch.save", state, _step(state), took)


def _lightning(ckpt: Mapping[str, Any], source: str) -> Foreign:
    state: dict[str, Any] = {}
    took: dict[str, str] = {}
    if "state_dict" in ckpt:
        state["model"] = ckpt["state_dict"]
        took["model"] = f"{_tensors(ckpt['state_dict'])} from 'state_dict'"
    for role, key in (("optim", "optimizer_states"), ("scheduler", "lr_schedulers")):
        values = list(ckpt.get(key) or [])
        if values:
            state[role] = values[0] if len(values) == 1 else values
            took[role] = f"from '{key}'" + (f" ({len(values)} of them)" if len(values) > 1 else "")
    if "global_step" in ckpt:
        state["step"] = _step_value(ckpt["global_step"])
        took["step"] = f"{_step_said(ckpt['global_step'])} from 'global_step'"
    rest = {
        k: v
        for k, v in ckpt.items()
        if k not in ("state_dict", "optimizer_states", "lr_schedulers")
    }
    state["lightning"] = rest
    took["lightning"] = ", ".join(sorted(rest))
    missing = {} if "optim" in state else {"optimizer_states": _FRESH["optim"]}
    return Foreign(source, "lightning", state, _step(state), took, missing=missing)


def _torch_load(fs: Any, path: str, source: str) -> Any:
    """``torch.load(weights_only=True)`` (numpy arrays allowed); one line if it refuses."""
    try:
        with _numpy_allowed(), warnings.catch_warnings():
            # torch's notes on its own internals (TypedStorage, quantized tensors) say nothing
            # about the checkpoint; what cannot be imported gets a line of its own later
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
            if type(fs).__name__ == "LocalFileSystem":
                return torch.load(path, map_location="cpu", weights_only=True)
            with fs.open(path, "rb") as f:
                data: Any = f if _seekable(f) else io.BytesIO(f.read())
                return torch.load(data, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{source}: refused: not readable with torch.load(weights_only=True) "
            f"({why_refused(e)}); ckptstore never unpickles objects, which can run code"
        ) from None


def _seekable(f: Any) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError):
        return False


def why_refused(e: BaseException) -> str:
    """torch's refusal, in a few words: which global the pickle asked for, or the damage."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it holds a pickled {found.group(1)}, which is not plain data"
    if "PytorchStreamReader" in text or "zip archive" in text:
        return "a damaged or truncated torch.save archive"
    if isinstance(e, EOFError):
        return "truncated"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:160]


@contextlib.contextmanager
def _numpy_allowed() -> Iterator[None]:
    """Let weights_only loads rebuild numpy arrays (RNG states hold them), as Hugging Face's
    loader does: numpy's array reconstruction runs no code of the file's choosing."""
    try:
        import numpy as np
    except ImportError:
        yield
        return
    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.uint8)]
    with torch.serialization.safe_globals(allowed):
        yield


# -- safetensors --------------------------------------------------------------------------------
def _read_safetensors_file(fs: Any, path: str, source: str) -> Foreign:
    tensors, meta = read_safetensors(fs, path, source)
    own = meta.get("ckptstore")
    if own is not None:  # a ckptstore payload or export: the whole state comes back
        from .tree import decode

        try:
            tree = json.loads(own)["tree"]
            state = {k: decode(v, tensors) for k, v in tree.items()}
        except (ValueError, KeyError, TypeError, CheckpointError) as e:
            raise CorruptCheckpointError(f"{source}: malformed ckptstore metadata ({e})") from None
        took = dict.fromkeys(state, "as saved")
        return Foreign(source, "safetensors", state, _step(state), took)
    took = {"model": f"{_tensors(tensors)}, the whole file"}
    left = {"__metadata__": f"{len(meta)} strings (kept in the manifest)"} if meta else {}
    return Foreign(source, "safetensors", {"model": tensors}, None, took, left)


# -- torch.distributed.checkpoint ---------------------------------------------------------------
_DCP_METADATA_CLASSES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _Refused(pickle.UnpicklingError):
    """The pickle asked for a global that DCP's metadata never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata``: its own classes, torch dtypes and sizes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


# Read through DCP's public API: ``dcp.load`` into a template built from the checkpoint's own
# metadata, with DCP's reader and ``DefaultLoadPlanner``. Not through DCP's public converter
# ``format_utils.dcp_to_torch_save``: it reads ``.metadata`` with ``pickle.load`` and every
# non-tensor value with ``torch.load(weights_only=False)``, and both run whatever the file asks
# for; the reader and planner below replace exactly those two reads. Two private names remain,
# for want of public ones: the fsspec reader (``_fsspec_filesystem.FsspecReader``, in that
# module's ``__all__``) and ``_traverse.set_element``, which puts a flat key back at the path
# ``DefaultSavePlanner`` recorded for it in ``Metadata.planner_data``.
def _read_dcp(
    fs: Any, path: str, source: str, storage_options: dict[str, Any] | None = None
) -> Foreign:
    from torch.distributed.checkpoint._traverse import set_element

    metadata = _dcp_metadata(fs, path, source)
    _check_dcp_files(fs, path.rstrip("/"), source, metadata)
    flat = _dcp_load(_dcp_reader(fs, path, source, storage_options, metadata), source, metadata)
    paths = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    state: dict[str, Any] = {}
    for fqn, value in flat.items():
        set_element(state, paths.get(fqn, (fqn,)), value)
    state = {k: _int_keys(v) for k, v in state.items()}
    if state and all(isinstance(v, torch.Tensor) for v in state.values()):
        state = {"model": state}  # a bare model state dict
        return Foreign(source, "dcp", state, None, {"model": _tensors(state["model"])})
    state, took = _roles(state)
    return Foreign(source, "dcp", state, _step(state), took)


def _dcp_metadata(fs: Any, path: str, source: str) -> Any:
    """``.metadata`` through the unpickler that runs nothing; one line when it cannot be."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = f"{source}/.metadata"
    try:
        with fs.open(f"{path.rstrip('/')}/.metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise CorruptCheckpointError(
            f"{where}: refused: a pickle that asks for {e}, which DCP's metadata never holds "
            "(loading it would run code); ckptstore never runs it: take the checkpoint again "
            "from where it was written"
        ) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{where}: truncated or damaged ({why_refused(e)}): copy the checkpoint folder "
            "again from where it was written"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: not DCP metadata (a {type(metadata).__name__})")
    return metadata


def _check_dcp_files(fs: Any, base: str, source: str, metadata: Any) -> None:
    """Every file ``.metadata`` names is there, inside the folder and long enough: a missing
    or truncated shard is one line before DCP reads anything."""
    storage = getattr(metadata, "storage_data", None)
    need: dict[str, int] = {}
    for info in storage.values() if isinstance(storage, Mapping) else ():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        if rel.startswith("/") or ".." in rel.split("/"):
            raise CorruptCheckpointError(
                f"{source}/.metadata names {rel!r}, a file outside the checkpoint folder: refused"
            )
        try:
            have = fs.size(f"{base}/{rel}")
        except FileNotFoundError:
            have = None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated ({have} of {size} bytes)"
            raise CorruptCheckpointError(
                f"{source}/{rel} {what}: the checkpoint's .metadata needs it (every rank of the "
                "save wrote one such file); copy the whole folder again from where it was written"
            )


def _dcp_reader(
    fs: Any, path: str, source: str, storage_options: dict[str, Any] | None, metadata: Any
) -> Any:
    """DCP's reader for ``fs``, handing out the metadata already read (never ``pickle.load``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    base: Any = dcp.FileSystemReader
    if type(fs).__name__ != "LocalFileSystem":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as base

    class Reader(base):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    if base is dcp.FileSystemReader:
        return Reader(path)
    return Reader(source, **dict(storage_options or {}))


def _dcp_load(reader: Any, source: str, metadata: Any) -> dict[str, Any]:
    """``{fqn: value}``: ``dcp.load`` into tensors of the saved shapes and dtypes (and a slot
    for each non-tensor value, read with ``weights_only=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            with _numpy_allowed():
                self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    flat: dict[str, Any] = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        if isinstance(md, TensorStorageMetadata)
        else None
        for fqn, md in metadata.state_dict_metadata.items()
    }
    planner = Planner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with _quiet_dcp():
            dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        inner = _dcp_failure(e)
        if isinstance(inner, CheckpointError):
            raise type(inner)(str(inner)) from None
        raise CorruptCheckpointError(
            f"{source}: cannot read this DCP checkpoint ({why_refused(inner)}); copy the whole "
            "folder again from where it was written"
        ) from None
    return flat


def _dcp_failure(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None) or {}
    for err in failures.values():
        return err[0] if isinstance(err, tuple) else err
    return e


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _int_keys(v: Any) -> Any:
    """DCP names dict keys as strings: an optimizer's state keys back to the parameter ids its
    ``param_groups`` list (else ``load_state_dict`` silently drops the state)."""
    if isinstance(v, dict):
        v = {k: _int_keys(x) for k, x in v.items()}
        state, groups = v.get("state"), v.get("param_groups")
        if isinstance(state, dict) and isinstance(groups, list):
            ids = {p for g in groups if isinstance(g, dict) for p in g.get("params", [])}
            v["state"] = {
                int(k) if isinstance(k, str) and k.isdigit() and int(k) in ids else k: x
                for k, x in state.items()
            }
        return v
    if isinstance(v, list):
        return [_int_keys(x) for x in v]
    return v


# -- Hugging Face Trainer -------------------------------------------------------------------------
def _hf_weights(names: set[str]) -> bool:
    return any(n in names or f"{n}.index.json" in names for n in _HF_WEIGHTS)


def _read_hf(fs: Any, path: str, source: str) -> Foreign:
    base = path.rstrip("/")
    names = sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(base, detail=False)})
    state: dict[str, Any] = {}
    took: dict[str, str] = {}
    used: set[str] = set()
    weights, files = _hf_model(fs, base, names, source)
    if weights is not None:
        state["model"] = weights
        took["model"] = f"{_tensors(weights)} from {', '.join(files)}"
        used.update(files)
    for name, role in _HF_PARTS.items():
        if name in names:
            state[role] = _torch_load(fs, f"{base}/{name}", f"{source}/{name}")
            took[role] = f"from {name}"
            used.add(name)
    rng_files = [n for n in names if n.startswith("rng_state") and n.endswith(".pth")]
    if rng_files:
        rngs = {n: _torch_load(fs, f"{base}/{n}", f"{source}/{n}") for n in rng_files}
        state["rng"] = next(iter(rngs.values())) if len(rngs) == 1 else rngs
        took["rng"] = f"from {', '.join(rng_files)}"
        used.update(rng_files)
    for name, entry in (("trainer_state.json", "trainer_state"), ("config.json", "config")):
        if name in names:
            with fs.open(f"{base}/{name}", "rb") as f:
                try:
                    state[entry] = json.loads(f.read())
                except ValueError as e:
                    raise CorruptCheckpointError(f"{source}/{name}: not JSON ({e})") from None
            took[entry] = f"from {name}"
            used.add(name)
    trainer_state = state.get("trainer_state")
    if isinstance(trainer_state, dict) and "global_step" in trainer_state:
        state["step"] = _step_value(trainer_state["global_step"])
        took["step"] = f"{_step_said(trainer_state['global_step'])} from trainer_state.json"
    left = {n: _hf_left_reason(n) for n in names if n not in used}
    missing = {name: _FRESH[role] for name, role in _HF_EXPECTED.items() if role not in state}
    return Foreign(source, "hf-trainer", state, _step(state), took, left, missing)


def _hf_left_reason(name: str) -> str:
    if name == "training_args.bin":
        return "a pickled TrainingArguments object (never unpickled)"
    return "not training state"


def _hf_model(
    fs: Any, base: str, names: list[str], source: str
) -> tuple[dict[str, torch.Tensor] | None, list[str]]:
    """The weights (joined from shards when an index lists them) and the files read."""
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        files = [single] if single in names else []
        if not files and index in names:
            with fs.open(f"{base}/{index}", "rb") as f:
                try:
                    files = sorted(set(json.loads(f.read())["weight_map"].values()))
                except (ValueError, KeyError, TypeError) as e:
                    raise CorruptCheckpointError(f"{source}/{index}: malformed ({e})") from None
            files.append(index)
        if not files:
            continue
        weights: dict[str, torch.Tensor] = {}
        for name in files:
            if name.endswith(".json"):
                continue
            where = f"{source}/{name}"
            if name.endswith(".safetensors"):
                part, _ = read_safetensors(fs, f"{base}/{name}", where)
            else:
                part = _torch_load(fs, f"{base}/{name}", where)
                if not isinstance(part, Mapping):
                    raise CorruptCheckpointError(f"{where}: not a state dict")
            weights.update(part)
        return weights, files
    return None, []


# -- shared -----------------------------------------------------------------------------------
def _open_fs(source: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    if "://" not in source:
        source = os.path.abspath(os.path.expanduser(source))
    try:
        fs, path = fsspec.core.url_to_fs(source, **dict(storage_options or {}))
    except (ImportError, ValueError) as e:
        raise CheckpointError(f"cannot open {source}: {e}") from None
    return fs, path


def _roles(obj: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``obj``'s entries under a training state's names (model, optim, ...); the rest keep
    their own names. Keys that are not strings are made strings."""
    state: dict[str, Any] = {}
    took: dict[str, str] = {}
    used: set[Any] = set()
    for role, spellings in ROLES.items():
        key = next((k for k in spellings if k in obj), None)
        if key is None:
            continue
        used.add(key)
        state[role] = obj[key]
        what = _tensors(obj[key]) if role == "model" else ""
        if role == "step":
            what = _step_said(obj[key])
        took[role] = " ".join(x for x in (what, "" if key == role else f"from {key!r}") if x)
    for key, value in obj.items():
        if key not in used:
            name = str(key)
            while name in state:
                name = f"{name}_"
            state[name] = value
            took[name] = "as it was"
    if "step" in state:
        state["step"] = _step_value(state["step"])
    return state, took


def _as_int(v: Any) -> int | None:
    """A step as a whole number >= 0: an int, a whole float (``5.0``), a string of digits or a
    one-value tensor holding one; None for anything else."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        v = v.item()
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v.strip())
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _step_said(v: Any) -> str:
    """What ``took`` says of a step entry: the number, and what it was written as if not an
    int."""
    step = _as_int(v)
    if step is None:
        return f"{v!r}, not a step number"
    return str(step) if type(v) is int else f"{step}, written as {type(v).__name__} {v!r}"


def step_problem(state: Mapping[str, Any]) -> str:
    """Why ``state`` gives no step: none recorded, or what its step entry holds instead."""
    if "step" not in state:
        return "records no step"
    v = state["step"]
    return f"records its step as {v!r} ({type(v).__name__}), not a whole number >= 0"


def _step(state: Mapping[str, Any]) -> int | None:
    return _as_int(state.get("step"))


def _step_value(v: Any) -> Any:
    """The step entry to keep: the whole number, or the value as it was if it is none."""
    step = _as_int(v)
    return v if step is None else step


def _tensors(value: Any) -> str:
    """ "12 tensors, 3.4M values" for a state dict (what a summary says of a model)."""
    n = count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            n += 1
            count += v.numel()
        elif isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    size = f"{count / 1e6:.1f}M" if count >= 100_000 else str(count)
    return f"{n} tensors, {size} values"

"""A checkpoint, whole or some of its entries, as one file a standard reader opens.

- ``torch.save``: ``torch.load(path, weights_only=True)`` gives ``{entry: value}`` with modules
  and optimizers as their state dicts (one entry asked for: that value alone);
- ``safetensors``: the layout of the ``torch`` format (tensors under their dotted names, the
  state tree as JSON in ``__metadata__``): ``safetensors.torch.load_file`` reads the tensors,
  and ``ckptstore import`` brings the whole state back.

The file is written beside its final name and renamed into place once complete and fsynced.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .buffers import as_bytes, memview
from .errors import CheckpointError

EXPORT_FORMATS = ("torch", "safetensors")


@dataclass(frozen=True, slots=True)
class ExportReport:
    path: str
    format: str
    step: int
    keys: tuple[str, ...]
    bytes: int

    def summary(self) -> str:
        how = (
            "torch.load(path, weights_only=True)"
            if self.format == "torch"
            else "safetensors.torch.load_file(path)"
        )
        return (
            f"exported {', '.join(self.keys)} of step {self.step} to {self.path} "
            f"({self.bytes} bytes; read it with {how})"
        )


def export_format(out: str, fmt: str | None) -> str:
    """The format asked for, else the one ``out``'s suffix names (``.safetensors``), else
    ``torch``."""
    if fmt is None:
        return "safetensors" if out.endswith(".safetensors") else "torch"
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    return fmt


def check_out(out: str) -> str:
    """``out`` as an absolute path, if a file can be written there; ValueError saying what is
    wrong with it otherwise (one line, naming ``out``, not a temporary file)."""
    path = os.path.abspath(os.path.expanduser(out))
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise ValueError(f"{out} is a folder: give the file to write, e.g. {out}/state.pt")
    probe = parent
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{out}: {probe} is a file, not a folder")
    if probe != parent:
        raise ValueError(f"{out}: its folder {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{out}: the folder {parent} is not writable")
    return path


def export_checkpoint(
    url: str,
    out: str,
    *,
    step: int | str = "latest",
    keys: Sequence[str] | None = None,
    format: str | None = None,
    experiment: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ExportReport:
    """Write step ``step`` of the checkpoints at ``url`` (every entry, or ``keys``) to
    ``out`` (a local file) as ``torch.save`` or safetensors (``format``; default from the
    suffix of ``out``)."""
    from .store import CheckpointStore

    fmt = export_format(out, format)
    path = check_out(out)
    with CheckpointStore(
        url, experiment=experiment, storage_options=storage_options, distributed=False
    ) as store:
        if keys:
            have = list(store.inspect(step)["types"])
            missing = [k for k in keys if k not in have]
            if missing:
                raise CheckpointError(
                    f"checkpoint has no entry {', '.join(map(repr, missing))}; it has: "
                    f"{', '.join(have)}"
                )
        manifest, values = store.read(step, keys=list(keys) if keys else None)
    names = tuple(values)
    if fmt == "torch":
        one = keys is not None and len(keys) == 1
        size = _write_atomically(
            path, lambda f: _torch_save(values[names[0]] if one else values, f)
        )
    else:
        size = _write_atomically(path, lambda f: write_safetensors(values, f))
    return ExportReport(path, fmt, manifest.step, names, size)


def _torch_save(value: Any, f: Any) -> None:
    torch.save(_own(value), f)  # a view would write its whole read buffer


def write_safetensors(values: dict[str, Any], f: Any) -> None:
    """``values`` in the ``torch`` format's safetensors layout, written to the open file."""
    from .formats.torchfile import build_header
    from .tree import encode_state

    enc = encode_state(values)
    prefix, header, size = build_header(enc)
    f.write(prefix)
    pos = len(prefix)
    for key, spec in sorted(header["tensors"].items(), key=lambda kv: int(kv[1]["offset"])):
        assert spec["offset"] == pos, "the safetensors layout has no gaps"
        if spec["nbytes"]:
            f.write(memview(as_bytes(enc.tensors[key].cpu())))
        pos += spec["nbytes"]
    assert pos == size


def _write_atomically(path: str, write: Any) -> int:
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return size


def _own(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        out = type(v)((k, _own(x)) for k, x in v.items())
        if hasattr(v, "_metadata"):
            out._metadata = v._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(v, (list, tuple)):
        return type(v)(_own(x) for x in v)
    return v

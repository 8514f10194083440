"""A checkpoint, whole or some of its entries, as one file a standard reader opens.

- ``torch.save``: ``torch.load(path, weights_only=True)`` gives ``{entry: value}`` with modules
  and optimizers as their state dicts (one entry asked for: that value alone);
- ``safetensors``: the layout of the ``torch`` format (tensors under their dotted names, the
  state tree as JSON in ``__metadata__``): ``safetensors.torch.load_file`` reads the tensors,
  and ``ckptstore import`` brings the whole state back.

A file is written beside the file ``out`` names (through symbolic links: a link stays a link)
and renamed into place once complete and fsynced. A character device or a FIFO (``/dev/null``,
a named pipe) and standard output (``-``, ``/dev/stdout``) are written into as they are, never
replaced; anything else that is not a file is refused.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch

from .buffers import as_bytes, memview
from .errors import CheckpointError

EXPORT_FORMATS = ("torch", "safetensors")
SUFFIXES = {"safetensors": (".safetensors",), "torch": (".pt", ".pth", ".bin", ".ckpt")}
STDOUT = ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")
_STREAMS = ("/proc/", "/dev/fd/", "/dev/stdout", "/dev/stderr")  # another process's open files


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
            else "safetensors.torch.load_file(path), after pip install safetensors"
        )
        return (
            f"exported {', '.join(self.keys)} of step {self.step} to {self.path} "
            f"({self.bytes} bytes; read it with {how})"
        )


def export_format(out: str, fmt: str | None) -> str:
    """The format asked for, else the one ``out``'s suffix names, else ``torch``; ValueError
    when the two disagree (a pickle under a ``.safetensors`` name)."""
    named = next((f for f, suffixes in SUFFIXES.items() if out.lower().endswith(suffixes)), None)
    if fmt is None:
        return named or "torch"
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if named is not None and named != fmt:
        stem = out[: out.rfind(".")]
        raise ValueError(
            f"--format {fmt} writes a {_WHAT[fmt]}, but --out {out} names a {_WHAT[named]}: name "
            f"it {stem}{SUFFIXES[fmt][0]}, or leave --format out (the suffix then picks {named})"
        )
    return fmt


_WHAT = {"torch": "torch.save file", "safetensors": "safetensors file"}


@dataclass(frozen=True, slots=True)
class Target:
    """Where an export goes: ``path``, and whether it is written into as it is (``stream``:
    a character device, a FIFO, standard output) rather than beside and renamed over."""

    path: str
    stream: bool = False
    stdout: bool = False


def check_out(out: str) -> Target:
    """Where ``out`` writes, if something can be written there; ValueError saying what is
    wrong with it otherwise (one line, naming ``out``, not a temporary file)."""
    if out in STDOUT:
        if sys.stdout.isatty():
            raise ValueError(f"{out} is a terminal: redirect it (> FILE, or | COMMAND)")
        return Target("/dev/stdout", stream=True, stdout=True)
    path = os.path.abspath(os.path.expanduser(out))
    if _an_open_file(path):
        return Target(path, stream=True)
    real = os.path.realpath(path)  # a link's file is replaced, the link stays
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"{out} is a folder: give the file to write, e.g. {out}/state.pt")
    if mode is not None and (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        return Target(path, stream=True)  # /dev/null, a named pipe: written into
    if mode is not None and not stat.S_ISREG(mode):
        kind = "block device" if stat.S_ISBLK(mode) else "socket"
        raise ValueError(
            f"{out} is a {kind}: export writes a file, a FIFO or a character device such as "
            "/dev/null; give a file"
        )
    _check_folder(out, os.path.dirname(real))
    return Target(real)


def _an_open_file(path: str) -> bool:
    """Does ``path`` (or a link on the way) name a file of a process (``/dev/stderr``,
    ``/proc/self/fd/3``)? Then it is written into, never replaced."""
    for _ in range(40):
        if path.startswith(_STREAMS):
            return True
        if not os.path.islink(path):
            return False
        path = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    return False


def _check_folder(out: str, parent: str) -> None:
    probe = parent
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{out}: {probe} is a file, not a folder")
    if probe != parent:
        raise ValueError(f"{out}: its folder {parent} does not exist (create it first)")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{out}: the folder {parent} is not writable")


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
    target = check_out(out)
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
        size = _write(target, lambda f: _torch_save(values[names[0]] if one else values, f))
    else:
        size = _write(target, lambda f: write_safetensors(values, f))
    return ExportReport(target.path, fmt, manifest.step, names, size)


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


def _write(target: Target, write: Callable[[Any], None]) -> int:
    if not target.stream:
        return _write_atomically(target.path, write)
    try:
        if target.stdout:
            sys.stdout.flush()
            return _write_stream(sys.stdout.buffer, write)
        with open(target.path, "wb") as f:
            if f.isatty():
                raise CheckpointError(f"{target.path} is a terminal: give a file, or redirect")
            return _write_stream(f, write)
    except OSError as e:
        raise CheckpointError(f"cannot write {target.path}: {e.strerror or e}") from None


def _write_stream(f: IO[bytes], write: Callable[[Any], None]) -> int:
    counted = _Counting(f)
    write(counted)
    f.flush()
    return counted.bytes


class _Counting:
    """A write-only stream that counts (a pipe or a device has no ``tell``)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.bytes = f, 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.f.write(data)
        self.bytes += n
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_atomically(path: str, write: Callable[[Any], None]) -> int:
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

"""Reading a safetensors file that came from elsewhere, with the checks the ``safetensors``
library makes, so that ckptstore accepts what it accepts and refuses, in one line, what it
refuses: a header of JSON (no duplicate names, not nested without end), ``__metadata__`` of
strings, known dtypes, shapes of non-negative integers, and byte ranges that match each tensor's
size and cover the data exactly once (no overlap, no gap, nothing after the last tensor).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import torch

from .buffers import memview
from .errors import CorruptCheckpointError

MAX_HEADER = 100_000_000  # the safetensors library's limit
# Every dtype the safetensors format defines (those torch has no type for are refused by name).
KNOWN_DTYPES = (
    *("BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"),
    *("I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"),
)


class _Duplicate(ValueError):
    pass


def read_safetensors(
    fs: Any, path: str, source: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a safetensors file (dtypes it cannot name come back as saved by
    ckptstore: reinterpreted from ``U8``) and its ``__metadata__``; CorruptCheckpointError
    (one line naming ``source``) for a file the safetensors library would refuse."""
    with fs.open(path, "rb") as f:
        size = fs.size(path)
        header = _header(f, size, source)
        data = torch.empty(size - f.tell(), dtype=torch.uint8)
        if data.numel() and f.readinto(memview(data)) != data.numel():
            raise _bad(source, "it changed while being read")
    meta = _metadata(header.pop("__metadata__", {}), source)
    raw = _raw_dtypes(meta)
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, a, b) in _layout(header, data.numel(), source).items():
        t = data[a:b].clone().view(dtype).view(shape)
        if name in raw:
            try:
                t = t.view(getattr(torch, raw[name]["dtype"])).view(raw[name]["shape"])
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
                raise _bad(source, f"its ckptstore dtype of tensor {name!r} ({e})") from None
        tensors[name] = t
    return tensors, meta


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: not a valid safetensors file: {what} (the safetensors library refuses it "
        "too); write it again, e.g. with safetensors.torch.save_file"
    )


def _header(f: Any, size: int, source: str) -> dict[str, Any]:
    head = f.read(8)
    (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
    if not 0 < n <= min(size - 8, MAX_HEADER):
        raise CorruptCheckpointError(f"{source}: not a safetensors file (header length {n})")
    raw = f.read(n)
    if not raw.startswith(b"{"):
        raise _bad(source, "its header does not start with '{'")
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise _bad(source, f"the name {e} appears twice in its header") from None
    except RecursionError:
        raise _bad(source, "its header is JSON nested too deep to be one") from None
    except ValueError as e:  # not UTF-8, not JSON
        raise _bad(source, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(source, "its header is not a JSON object")
    return header


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(repr(key))
        out[key] = value
    return out


def _metadata(meta: Any, source: str) -> dict[str, str]:
    if not isinstance(meta, dict):
        raise _bad(source, "its __metadata__ is not a JSON object")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise _bad(source, f"its __metadata__ maps {key!r} to {value!r}, not to a string")
    return meta


def _raw_dtypes(meta: Mapping[str, str]) -> dict[str, Any]:
    try:
        return dict(json.loads(meta["ckptstore"]).get("dtypes") or {})
    except (KeyError, ValueError, TypeError, AttributeError):
        return {}


def _layout(
    header: Mapping[str, Any], data_bytes: int, source: str
) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """Each tensor's (dtype, shape, start, end); its bytes tile the data exactly."""
    specs = {name: _spec(name, spec, source) for name, spec in header.items()}
    pos, before = 0, None
    for name, (_, _, a, b) in sorted(specs.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if a < pos:
            raise _bad(source, f"tensor {name!r} (bytes {a}-{b}) overlaps tensor {before!r}")
        if a > pos:
            raise _bad(source, f"bytes {pos}-{a} of its data belong to no tensor")
        pos, before = b, name
    if pos != data_bytes:
        what = "belong to no tensor" if pos < data_bytes else "are missing (truncated)"
        raise _bad(
            source, f"bytes {min(pos, data_bytes)}-{max(pos, data_bytes)} of its data {what}"
        )
    return specs


def _spec(name: str, spec: Any, source: str) -> tuple[torch.dtype, list[int], int, int]:
    from .formats.torchfile import SAFETENSORS_DTYPES

    where = f"tensor {name!r}"
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise _bad(source, f"{where} lacks a dtype, shape or data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    torch_dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}.get(dtype)
    if torch_dtype is None:
        if dtype in KNOWN_DTYPES:
            raise CorruptCheckpointError(
                f"{source}: {where} has dtype {dtype}, which torch has no type for: convert it "
                "to one torch has (e.g. F32) before importing"
            )
        raise _bad(source, f"{where} has dtype {dtype!r}, not one of {', '.join(KNOWN_DTYPES)}")
    if not isinstance(shape, list) or not all(_count(x) for x in shape):
        raise _bad(source, f"{where} has shape {shape!r}: dimensions are integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_count, offsets)):
        raise _bad(source, f"{where} has data_offsets {offsets!r}: two integers >= 0")
    a, b = offsets
    need = math.prod(shape) * torch.empty((), dtype=torch_dtype).element_size()
    if b - a != need:
        raise _bad(source, f"{where} holds bytes {a}-{b}: shape {shape} of {dtype} needs {need}")
    return torch_dtype, shape, a, b


def _count(x: Any) -> bool:
    return type(x) is int and x >= 0

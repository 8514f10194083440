"""State <-> (JSON tree, tensor table): how a state dict is stored without pickle.

A state is a dict whose values are objects with ``state_dict()``/``load_state_dict()``, tensors, or
plain containers. ``encode_state`` calls ``state_dict()`` on the objects and turns everything into
a JSON tree in which each tensor is a reference ``{"$t": "tensor", "k": key}`` into a table of
tensors. JSON cannot say "tuple", "int key", "NaN" or "torch.float32", so those get small tagged
objects; a user dict that happens to contain the tag key is itself tagged, so decoding is exact.
Anything else (arbitrary Python objects) is refused at save time with the path to the value:
loading must never need to unpickle.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError, IncompatibleCheckpointError

TAG = "$t"
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


@dataclass(slots=True)
class TensorSpec:
    """What the tree needs to know about a stored tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    group: str  # the top-level state key the tensor was first met under
    path: tuple[Any, ...] = ()  # where it was first met: state keys and list indices

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass(slots=True)
class EncodedState:
    """A state ready to write: a JSON tree plus the tensors it references (in first-seen order)."""

    tree: dict[str, Any]
    types: dict[str, str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    paths: dict[tuple[Any, ...], str] = field(default_factory=dict)  # every path -> its key

    def group_keys(self, group: str) -> list[str]:
        return [k for k, s in self.specs.items() if s.group == group]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise IncompatibleCheckpointError(
            f"tensor dtype {name!r} is unknown to torch {torch.__version__}; upgrade torch"
        )
    return dt


def has_state_dict(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def encode_state(state: Mapping[str, Any], *, allow_dtensor: bool = False) -> EncodedState:
    """Call ``state_dict()`` where there is one and encode everything (foreground, no copies)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of name -> value, got {type(state).__name__}")
    enc = EncodedState(tree={}, types={})
    seen: dict[tuple[Any, ...], str] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"state keys must be non-empty strings, got {name!r}")
        if has_state_dict(value) and not isinstance(value, torch.Tensor):
            enc.types[name] = f"{type(value).__module__}.{type(value).__qualname__}"
            value = value.state_dict()
        else:
            enc.types[name] = type(value).__name__
        enc.tree[name] = _Encoder(enc, seen, name, allow_dtensor).encode(value, [name])
    return enc


class _Encoder:
    def __init__(
        self, enc: EncodedState, seen: dict[tuple[Any, ...], str], group: str, dtensor: bool
    ) -> None:
        self.enc, self.seen, self.group, self.dtensor = enc, seen, group, dtensor

    def encode(self, obj: Any, path: list[Any]) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            if _INT64_MIN <= obj <= _UINT64_MAX:
                return int(obj)  # IntEnum and friends become plain ints
            return {TAG: "int", "v": str(obj)}
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {TAG: "float", "v": repr(float(obj))}
        if isinstance(obj, torch.Tensor):
            return {TAG: "tensor", "k": self.tensor(obj, path)}
        if isinstance(obj, Mapping):
            return self.mapping(obj, path)
        if isinstance(obj, list):
            return [self.encode(v, [*path, i]) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            if isinstance(obj, torch.Size):
                return {TAG: "size", "v": list(obj)}
            return {TAG: "tuple", "v": [self.encode(v, [*path, i]) for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {TAG: "dtype", "v": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {TAG: "device", "v": str(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return {TAG: "bytes", "v": base64.b64encode(bytes(obj)).decode()}
        if type(obj).__module__ == "numpy":
            return self.numpy(obj, path)
        raise CheckpointError(
            f"cannot save {fmt_path(path)} of type {type(obj).__module__}.{type(obj).__qualname__}:"
            " ckptstore stores tensors, objects with state_dict()/load_state_dict(), and "
            "dict/list/tuple/int/float/str/bool/None (never pickles); convert it, e.g. to a "
            "tensor or a str"
        )

    def mapping(self, obj: Mapping[Any, Any], path: list[Any]) -> Any:
        plain = all(isinstance(k, str) for k in obj) and TAG not in obj
        if plain:
            body: Any = {k: self.encode(v, [*path, k]) for k, v in obj.items()}
        else:
            body = {
                TAG: "dict",
                "items": [
                    [self.encode(k, [*path, "<key>"]), self.encode(v, [*path, k])]
                    for k, v in obj.items()
                ],
            }
        meta = getattr(obj, "_metadata", None)
        if isinstance(obj, OrderedDict) and isinstance(meta, dict):
            # nn.Module state dicts carry per-submodule versions that load_state_dict reads.
            return {TAG: "odict", "v": body, "m": self.encode(dict(meta), [*path, "_metadata"])}
        return body

    def numpy(self, obj: Any, path: list[Any]) -> Any:
        if hasattr(obj, "shape") and hasattr(obj, "dtype") and hasattr(obj, "tolist"):
            if getattr(obj, "ndim", 1) == 0 or not hasattr(obj, "__array__"):
                return self.encode(obj.item(), path)  # numpy scalar -> Python scalar
            try:
                t = torch.from_numpy(obj.copy())
            except TypeError as e:
                raise CheckpointError(f"cannot save numpy array {fmt_path(path)}: {e}") from e
            return {TAG: "ndarray", "k": self.tensor(t, path)}
        return self.encode(obj.item(), path)

    def tensor(self, t: torch.Tensor, path: list[Any]) -> str:
        where = fmt_path(path)
        if _is_dtensor(t):
            if not self.dtensor:
                raise CheckpointError(
                    f"{where} is a DTensor (sharded); the 'torch' format writes one file from "
                    "rank 0: use CheckpointStore(..., format='dcp')"
                )
        elif t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise CheckpointError(f"cannot save {where}: {_unsaveable(t)}")
        ident = None
        if not _is_dtensor(t) and t.numel() > 0:
            ident = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
                t.device,
            )
            if ident in self.seen:  # tied weights: stored once, referenced twice
                self.enc.paths[tuple(path)] = self.seen[ident]
                return self.seen[ident]
        key = self.unique_key(path)
        if ident is not None:
            self.seen[ident] = key
        self.enc.paths[tuple(path)] = key
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        self.enc.tensors[key] = t.detach()
        self.enc.specs[key] = TensorSpec(
            key, dtype_name(t.dtype), tuple(t.shape), self.group, tuple(path)
        )
        return key

    def unique_key(self, path: list[Any]) -> str:
        # The name torch.distributed.checkpoint gives the same value ("model.layer.weight",
        # "optim.state.0.exp_avg"), so a standard reader sees the names it expects.
        key = ".".join(str(p) for p in path)
        n, base = 1, key
        while key in self.enc.tensors:
            n += 1
            key = f"{base}~{n}"
        return key


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def fmt_path(path: list[Any]) -> str:
    return "state" + "".join(f"[{p!r}]" for p in path)


def tensor_keys(tree: Any) -> list[str]:
    """Tensor keys referenced anywhere below ``tree``, in order, without duplicates."""
    out: dict[str, None] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            tag = node.get(TAG)
            if tag in ("tensor", "ndarray"):
                out[str(node["k"])] = None
            elif tag is None:
                for v in node.values():
                    walk(v)
            else:
                for k, v in node.items():
                    if k != TAG:
                        walk(v)

    walk(tree)
    return list(out)


def tensor_paths(tree: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Where each tensor key sits in the state (its first place): the path ``encode_state``
    met it at, read back from the tree, whatever naming scheme wrote the keys."""
    out: dict[str, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))
            return
        if not isinstance(node, dict):
            return
        tag = node.get(TAG)
        if tag is None:
            for k, v in node.items():
                walk(v, (*path, k))
        elif tag in ("tensor", "ndarray"):
            out.setdefault(str(node["k"]), path)
        elif tag in ("odict", "tuple"):
            walk(node["v"], path)
        elif tag == "dict":
            for k, v in node["items"]:
                walk(v, (*path, _hashable(decode(k, {}))))

    for name, node in tree.items():
        walk(node, (name,))
    return out


def like_tensors(
    tree: Mapping[str, Any], like: Mapping[str, Any], keys: Sequence[str]
) -> dict[str, tuple[torch.Tensor, bool]]:
    """The caller's tensors at the same place (path) as each checkpoint tensor key, and
    whether the checkpoint may be read straight into them: only under entries restored in
    place (tensors, objects with ``load_state_dict``; a plain container is replaced, and its
    old tensors are left alone). The format decides which fit (device, dtype, shape); a sharded
    tensor anywhere says how to read its key."""
    mine = {k: like[k] for k in keys if k in like and k in tree}
    if not mine:
        return {}
    try:
        enc = encode_state(mine, allow_dtensor=True)
    except (CheckpointError, TypeError):
        return {}  # e.g. a state_dict() with values we cannot read into: plain loading then
    out = {}
    for key, path in tensor_paths({k: tree[k] for k in mine}).items():
        if path in enc.paths:
            top = mine[path[0]]
            inplace = isinstance(top, torch.Tensor) or has_state_dict(top)
            out[key] = (enc.tensors[enc.paths[path]], inplace)
    return out


def decode(node: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of the encoder: JSON tree + loaded tensors -> Python values."""
    if isinstance(node, list):
        return [decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    tag = node.get(TAG)
    if tag is None:
        return {k: decode(v, tensors) for k, v in node.items()}
    if tag == "tensor":
        return _lookup(tensors, node["k"])
    if tag == "dict":
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in node["items"]}
    if tag == "odict":
        out: OrderedDict[Any, Any] = OrderedDict(decode(node["v"], tensors))
        out._metadata = decode(node["m"], tensors)  # type: ignore[attr-defined]
        return out
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in node["v"])
    if tag == "size":
        return torch.Size(node["v"])
    if tag == "int":
        return int(node["v"])
    if tag == "float":
        return float(node["v"])
    if tag == "dtype":
        return dtype_from_name(node["v"])
    if tag == "device":
        return torch.device(node["v"])
    if tag == "bytes":
        return base64.b64decode(node["v"])
    if tag == "ndarray":
        return _lookup(tensors, node["k"]).numpy()
    raise IncompatibleCheckpointError(
        f"unknown value tag {tag!r} in checkpoint tree; it was written by a newer ckptstore"
    )


def _lookup(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors[key]
    except KeyError:
        raise IncompatibleCheckpointError(
            f"checkpoint tree references missing tensor {key!r}"
        ) from None


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _unsaveable(t: torch.Tensor) -> str:
    """What kind of tensor ``t`` is that ckptstore does not store, and what to store instead."""
    if t.device.type == "meta":
        return (
            "a tensor on the meta device (a shape without values, e.g. of a model built with "
            "device='meta'): give it values first (module.to_empty(device='cpu') and an "
            "initialisation, or a load)"
        )
    if t.is_quantized:
        return (
            f"a quantized tensor ({t.dtype}): save t.dequantize(), or t.int_repr() with its "
            "scale and zero point"
        )
    return f"a tensor of layout {t.layout}: convert it to a dense one first (t.to_dense())"

"""The ``torch`` format: one pickle-free file, written by rank 0.

Layout of ``state.<token>.ckpt``::

    b"CKSTORE1" | u64 little-endian header length | header JSON | zero pad to 4096
    | tensor bytes, each top-level entry starting on a 4096 boundary, each tensor on 64

The header (also copied into the manifest, so a reader plans its reads before touching the
payload) holds the state tree and, per tensor, dtype, shape, offset and size. Loading is
``torch.frombuffer``-style views into freshly read, verified memory: there is nothing to
unpickle, so a crafted file cannot run code; a file that *is* a pickle is refused by its magic.
``ckptstore export`` turns any checkpoint into a plain ``torch.save`` file.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import torch

from ..buffers import (
    ALIGN,
    TENSOR_ALIGN,
    align_up,
    aligned_empty,
    as_bytes,
    copy_bytes,
    zero_bytes,
)
from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..manifest import Manifest
from ..storage import BufferPayload, Dest, IOEngine, SegmentPayload
from ..tree import EncodedState, decode, dtype_from_name, tensor_keys
from . import LoadContext, SaveContext

MAGIC = b"CKSTORE1"
_PREFIX = struct.Struct("<8sQ")
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def build_header(enc: EncodedState) -> tuple[bytes, dict[str, Any], int]:
    """(file prefix + header bytes, header object, total file size) for an encoded state."""
    tensors: dict[str, dict[str, Any]] = {}
    groups: dict[str, list[str]] = {}
    for key, spec in enc.specs.items():
        groups.setdefault(spec.group, []).append(key)
    pos = 0
    for keys in groups.values():
        pos = align_up(pos, ALIGN)
        for key in keys:
            spec = enc.specs[key]
            pos = align_up(pos, TENSOR_ALIGN)
            tensors[key] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "offset": pos,  # relative to data_offset until fixed below
                "nbytes": spec.nbytes,
                "group": spec.group,
            }
            pos += spec.nbytes
    data_size = pos
    header: dict[str, Any] = {"version": 1, "tree": enc.tree, "types": enc.types}
    # The data offset depends on the header length, which depends on the offsets: iterate.
    data_offset = 0
    while True:
        header["data_offset"] = data_offset
        header["tensors"] = {
            k: {**v, "offset": v["offset"] + data_offset} for k, v in tensors.items()
        }
        blob = orjson.dumps(header)
        need = align_up(_PREFIX.size + len(blob), ALIGN)
        if need == data_offset:
            break
        data_offset = need
    prefix = _PREFIX.pack(MAGIC, len(blob)) + blob
    return prefix, header, data_offset + data_size


class TorchFormat:
    """One file, written by rank 0; every rank reads (and verifies) what its state needs."""

    name = "torch"

    def writes_on(self, rank: int, world_size: int) -> bool:
        return rank == 0

    def stage(self, enc: EncodedState | None, ctx: SaveContext) -> Any:
        if enc is None:
            return None
        prefix, header, size = build_header(enc)
        specs = header["tensors"]
        if not ctx.background:
            segs = [(0, torch.frombuffer(bytearray(prefix), dtype=torch.uint8))]
            segs += [(specs[k]["offset"], as_bytes(t)) for k, t in enc.tensors.items()]
            return SegmentPayload(size, segs), None, header
        cuda = any(t.is_cuda for t in enc.tensors.values())
        buf = ctx.arena.take(align_up(size), pin=cuda)
        _snapshot(buf, prefix, specs, enc.tensors, cuda, ctx.io)
        event = None
        if cuda:
            # Copies were queued on the current stream; the writer waits for them, the caller
            # does not (later kernels on that stream run after the copies anyway).
            event = torch.cuda.Event()
            event.record()
        return BufferPayload(buf, size), event, header

    def persist(self, staged: Any, ctx: SaveContext) -> None:
        if staged is None:
            return
        payload, event, header = staged
        if event is not None:
            event.synchronize()
        name = f"state.{ctx.token}.ckpt"
        ctx.storage.makedirs(ctx.step_dir)  # here, not in stage(): an fsync the caller skips
        entry = ctx.storage.write_payload(
            ctx.storage.join(ctx.step_dir, name), payload, ctx.io, background=ctx.background
        )
        ctx.commit([entry], {"file": name, "header": header})

    def load(
        self, manifest: Manifest, ctx: LoadContext, keys: Sequence[str], like: Mapping[str, Any]
    ) -> dict[str, Any]:
        header, entry, problem = _header(manifest)
        path = ctx.storage.join(ctx.step_dir, entry.path)
        url = ctx.storage.url(path)
        if problem:  # look at the payload first: a pickle deserves the clearer message
            prefix = torch.empty(_PREFIX.size, dtype=torch.uint8)
            ctx.storage.read_into(path, entry, [Dest(0, prefix)], ctx.io)
            _check_prefix(bytes(prefix.tolist()), header, url)
            raise CorruptCheckpointError(f"{manifest.url}: malformed 'torch' header ({problem})")
        tree, specs = header["tree"], header["tensors"]
        wanted = {k for key in keys for k in tensor_keys(tree[key])}
        by_group: dict[str, list[str]] = {}
        for k in wanted:
            by_group.setdefault(str(specs[k]["group"]), []).append(k)
        dests: list[Dest] = [Dest(0, torch.empty(_PREFIX.size, dtype=torch.uint8))]
        spans: list[tuple[Dest, list[str]]] = []
        for ks in by_group.values():
            nonempty = [k for k in ks if specs[k]["nbytes"]]
            if not nonempty:
                continue
            lo = min(specs[k]["offset"] for k in nonempty) // ALIGN * ALIGN
            hi = max(specs[k]["offset"] + specs[k]["nbytes"] for k in nonempty)
            d = Dest(lo, aligned_empty(hi - lo))
            dests.append(d)
            spans.append((d, nonempty))
        ctx.storage.read_into(path, entry, dests, ctx.io)
        _check_prefix(bytes(dests[0].buf.tolist()), header, url)
        tensors: dict[str, torch.Tensor] = {}
        for d, ks in spans:
            for k in ks:
                s = specs[k]
                a = s["offset"] - d.offset
                raw = d.buf[a : a + s["nbytes"]]
                tensors[k] = raw.view(dtype_from_name(s["dtype"])).view(s["shape"])
        for k in wanted - tensors.keys():
            s = specs[k]
            tensors[k] = torch.empty(s["shape"], dtype=dtype_from_name(s["dtype"]))
        return {key: decode(tree[key], tensors) for key in keys}

    def describe(self, manifest: Manifest, ctx: LoadContext) -> dict[str, Any]:
        header, entry, problem = _header(manifest)
        return {
            **({"problem": f"malformed 'torch' header ({problem})"} if problem else {}),
            "tree": header["tree"],
            "types": header.get("types", {}),
            "tensors": [
                {
                    "key": k,
                    "dtype": s["dtype"],
                    "shape": s["shape"],
                    "nbytes": s["nbytes"],
                    "file": entry.path,
                }
                for k, s in header["tensors"].items()
            ],
        }


def _snapshot(
    buf: torch.Tensor,
    prefix: bytes,
    specs: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    cuda: bool,
    io: IOEngine,
) -> None:
    """Copy the whole file image into ``buf``; padding is zeroed so files are deterministic."""
    copy_bytes(buf[: len(prefix)], torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    pos = len(prefix)
    pairs = []
    for k, t in tensors.items():
        off, n = specs[k]["offset"], specs[k]["nbytes"]
        zero_bytes(buf[pos:off])
        if n:
            pairs.append((buf[off : off + n], as_bytes(t)))
        pos = off + n
    zero_bytes(buf[pos : align_up(pos)])
    io.copy_all(pairs, cuda=cuda)


def _header(manifest: Manifest) -> tuple[dict[str, Any], Any, str]:
    """(header, file entry, problem with the tensor table or "")."""
    fd = manifest.format_data
    try:
        header = fd["header"]
        entry = manifest.file(fd["file"])
        tensors = header["tensors"]
        tree = header["tree"]
        int(header["data_offset"])
        if not isinstance(tree, dict) or not isinstance(tensors, dict):
            raise TypeError("tree and tensors must be objects")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{manifest.url}: malformed 'torch' header ({e})") from None
    try:
        for k, s in tensors.items():
            shape = [int(x) for x in s["shape"]]
            nbytes = int(s["nbytes"])
            off = int(s["offset"])
            itemsize = dtype_from_name(str(s["dtype"])).itemsize
            if min(shape, default=0) < 0 or nbytes != itemsize * _prod(shape):
                raise ValueError(f"tensor {k!r}: size does not match shape and dtype")
            if off < 0 or off + nbytes > entry.size:
                raise ValueError(f"tensor {k!r}: bytes {off}-{off + nbytes} outside the file")
            str(s["group"])
    except IncompatibleCheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        return header, entry, str(e)
    return header, entry, ""


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _check_prefix(got: bytes, header: Mapping[str, Any], url: str) -> None:
    if got.startswith(_PICKLE_MAGICS):
        raise CorruptCheckpointError(
            f"{url}: this payload is a pickle (torch.save) file, not a ckptstore file; refusing "
            "to unpickle it (that could run arbitrary code)"
        )
    magic, hlen = _PREFIX.unpack(got)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{url}: not a ckptstore 'torch' file (bad magic {magic!r})")
    if _PREFIX.size + hlen > int(header["data_offset"]):
        raise CorruptCheckpointError(f"{url}: header length {hlen} overruns the data")

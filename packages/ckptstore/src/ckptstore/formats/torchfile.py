"""The ``torch`` format: one pickle-free file, written by rank 0, in the safetensors layout.

``state.<token>.safetensors`` is a safetensors file: a u64 little-endian header length, a JSON
header (per tensor its dtype, shape and data offsets; ``__metadata__`` holds ckptstore's state
tree as a JSON string), then the raw tensor bytes, back to back. So any safetensors reader
(``safetensors.torch.load_file``, and the readers of every other framework) loads the tensors as
they are, without ckptstore. The header is padded with spaces so the data starts on a 4096-byte
boundary, and the tensors are ordered by element size, largest first, so every tensor starts at
a multiple of its element size: ckptstore's reader views them in place, without copies.

Tensor names are the paths of the values (``model.layer.weight``, ``optim.state.0.exp_avg``);
tied weights are stored once (under the first name). A dtype safetensors has no name for
(complex128, some float8/float4 variants) is stored as ``U8`` bytes of shape ``[nbytes]``;
``__metadata__`` names its real dtype and shape.

The header is also copied into the manifest, so a reader plans its reads before touching the
payload. Loading views freshly read, verified memory, or reads straight into the caller's
tensors: there is nothing to unpickle, so a crafted file cannot run code, and a file that *is*
a pickle is refused. Files of the first release (``state.<token>.ckpt``: ``b"CKSTORE1"``, a u64
header length, a JSON header, aligned tensor bytes) are still read.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import torch

from ..buffers import (
    ALIGN,
    align_up,
    aligned_empty,
    as_bytes,
    copy_bytes,
    zero_bytes,
)
from ..errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..manifest import Manifest
from ..storage import BufferPayload, Dest, IOEngine, SegmentPayload
from ..tree import EncodedState, decode, dtype_from_name, like_tensors, tensor_keys
from . import LoadContext, SaveContext
from .mapped import MappedFile, mappable

MAGIC = b"CKSTORE1"  # the first release's files
_V1_PREFIX = struct.Struct("<8sQ")
_LENGTH = struct.Struct("<Q")
_PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")
HEADER_VERSION = 2
SUFFIX = ".safetensors"
_MERGE_GAP = 1 << 20  # wanted tensors closer than this are read as one span

# torch dtype -> safetensors dtype name (the names every safetensors reader knows)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _st


def build_header(enc: EncodedState) -> tuple[bytes, dict[str, Any], int]:
    """(file prefix: length + space-padded JSON header, the header as the manifest keeps it,
    total file size) for an encoded state."""
    groups = {g: i for i, g in enumerate(dict.fromkeys(s.group for s in enc.specs.values()))}
    order = sorted(
        enc.specs,
        key=lambda k: (-dtype_from_name(enc.specs[k].dtype).itemsize, groups[enc.specs[k].group]),
    )  # a stable sort: first-seen order within a size class and group
    st: dict[str, Any] = {}
    raw_dtypes: dict[str, dict[str, Any]] = {}
    rel: dict[str, int] = {}
    pos = 0
    for key in order:
        spec = enc.specs[key]
        dtype = dtype_from_name(spec.dtype)
        name = SAFETENSORS_DTYPES.get(dtype)
        shape = list(spec.shape)
        if name is None:
            name, shape = "U8", [spec.nbytes]
            raw_dtypes[key] = {"dtype": spec.dtype, "shape": list(spec.shape)}
        st[key] = {"dtype": name, "shape": shape, "data_offsets": [pos, pos + spec.nbytes]}
        rel[key] = pos
        pos += spec.nbytes
    own = {"version": HEADER_VERSION, "tree": enc.tree, "types": enc.types, "dtypes": raw_dtypes}
    meta = {"format": "pt", "ckptstore": orjson.dumps(own).decode()}
    blob = orjson.dumps({"__metadata__": meta, **st})
    data_offset = align_up(_LENGTH.size + len(blob), ALIGN)
    blob += b" " * (data_offset - _LENGTH.size - len(blob))  # safetensors allows space padding
    header: dict[str, Any] = {
        "version": HEADER_VERSION,
        "layout": "safetensors",
        "tree": enc.tree,
        "types": enc.types,
        "data_offset": data_offset,
        "tensors": {
            k: {
                "dtype": enc.specs[k].dtype,
                "shape": list(enc.specs[k].shape),
                "offset": data_offset + rel[k],
                "nbytes": enc.specs[k].nbytes,
                "group": enc.specs[k].group,
            }
            for k in order
        },
    }
    return _LENGTH.pack(len(blob)) + blob, header, data_offset + pos


class TorchFormat:
    """One file, written by rank 0; every rank reads (and verifies) what its state needs."""

    name = "torch"
    takes_dtensor = False  # rank 0 writes whole tensors: a DTensor must be gathered first

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
        name = f"state.{ctx.token}{SUFFIX}"
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
        head = Dest(0, torch.empty(_V1_PREFIX.size + 1, dtype=torch.uint8))
        if problem:  # look at the payload first: a pickle deserves the clearer message
            ctx.storage.read_into(path, entry, [head], ctx.io)
            _check_prefix(bytes(head.buf.tolist()), header, url)
            raise CorruptCheckpointError(f"{manifest.url}: malformed 'torch' header ({problem})")
        tree, specs = header["tree"], header["tensors"]
        wanted = list(dict.fromkeys(k for key in keys for k in tensor_keys(tree[key])))
        targets = like_tensors(tree, like, keys)
        dests, tensors, loose = [head], {}, []
        for k in wanted:
            s, (t, inplace) = specs[k], targets.get(k, (None, False))
            if t is not None and inplace and _fits(t, s) and s["nbytes"]:
                dests.append(Dest(s["offset"], as_bytes(t)))  # straight into the caller's tensor
                tensors[k] = t
            elif s["nbytes"]:
                loose.append(k)
        local = ctx.storage.local_path(path)
        if loose and mappable(local, ctx.io):  # fresh tensors: the mapped file, verified
            assert local is not None
            mapped = MappedFile(local, entry, url)
            ranges = [(specs[k]["offset"], specs[k]["offset"] + specs[k]["nbytes"]) for k in loose]
            mapped.verify(ranges)
            for k in loose:
                s = specs[k]
                dtype = dtype_from_name(s["dtype"])
                tensors[k] = mapped.tensor(s["offset"], s["nbytes"], dtype, s["shape"])
            loose = []
        spans = [(Dest(lo, aligned_empty(hi - lo)), ks) for lo, hi, ks in _spans(loose, specs)]
        dests += [d for d, _ in spans]
        ctx.storage.read_into(path, entry, dests, ctx.io)
        _check_prefix(bytes(head.buf.tolist()), header, url)
        for d, ks in spans:
            for k in ks:
                s = specs[k]
                a = s["offset"] - d.offset
                raw = d.buf[a : a + s["nbytes"]]
                tensors[k] = raw.view(dtype_from_name(s["dtype"])).view(s["shape"])
        for k in wanted:
            if k not in tensors:  # no bytes: empty tensors
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


def _fits(t: torch.Tensor, spec: Mapping[str, Any]) -> bool:
    """Whether the saved bytes can be read straight into ``t`` (no cast, no reshape)."""
    return (
        type(t).__name__ != "DTensor"
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.dtype == dtype_from_name(spec["dtype"])
        and list(t.shape) == list(spec["shape"])
    )


def _spans(keys: Sequence[str], specs: Mapping[str, Any]) -> list[tuple[int, int, list[str]]]:
    """Page-aligned file ranges ``[lo, hi)`` covering ``keys`` (tensors of one dtype close
    together in the file share one range: one buffer, one read), each with the keys it holds.
    One dtype per buffer: ``torch.save`` refuses views of one storage as different types."""
    out: list[tuple[int, int, list[str]]] = []
    last = None
    for k in sorted(keys, key=lambda k: int(specs[k]["offset"])):
        a, b = int(specs[k]["offset"]), int(specs[k]["offset"]) + int(specs[k]["nbytes"])
        same_dtype, last = specs[k]["dtype"] == last, specs[k]["dtype"]
        if out and same_dtype and a - out[-1][1] <= _MERGE_GAP:
            lo, hi, ks = out[-1]
            out[-1] = (lo, max(hi, b), [*ks, k])
        else:
            out.append((a // ALIGN * ALIGN, b, [k]))
    return out


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
    for k in sorted(tensors, key=lambda k: int(specs[k]["offset"])):
        off, n = specs[k]["offset"], specs[k]["nbytes"]
        zero_bytes(buf[pos:off])
        if n:
            pairs.append((buf[off : off + n], as_bytes(tensors[k])))
        pos = max(pos, off + n)
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
    data_offset = int(header["data_offset"])
    if int(header.get("version", 1)) == 1:
        magic, hlen = _V1_PREFIX.unpack(got[: _V1_PREFIX.size])
        if magic != MAGIC:
            raise CorruptCheckpointError(
                f"{url}: not a ckptstore 'torch' file (bad magic {magic!r})"
            )
        if _V1_PREFIX.size + hlen > data_offset:
            raise CorruptCheckpointError(f"{url}: header length {hlen} overruns the data")
        return
    (hlen,) = _LENGTH.unpack(got[: _LENGTH.size])
    if _LENGTH.size + hlen != data_offset or got[_LENGTH.size : _LENGTH.size + 1] != b"{":
        raise CorruptCheckpointError(
            f"{url}: not the safetensors file its manifest describes (header length {hlen}, "
            f"data at {data_offset})"
        )

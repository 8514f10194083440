"""The ``dcp`` format: a real ``torch.distributed.checkpoint`` checkpoint, written by
ckptstore's storage layer.

DCP does the planning: every rank offers the state as a user would pass it to ``dcp.save``
(state dicts of the objects, nested), replicated tensors (DDP) are assigned to one rank each
(DCP's dedup), and a later load on any world size plans which chunks each rank reads. ckptstore
does the bytes, in DCP's own file layout: each rank writes one ``shard-rNNNNN.<token>.distcp``
in which every tensor chunk is a ``torch.save`` archive (built around the raw bytes, which are
written in place, checksummed, page-aligned when large) and every other value a ``torch.save``
pickle; the coordinator's ``finish`` writes DCP's ``.metadata`` (a pickle, as DCP's readers
expect) and then the manifest (the commit), only after every rank's ``write_data`` returned,
i.e. after every payload is durable. So ``dcp.load(state, checkpoint_id=step_dir)`` reads a
ckptstore checkpoint without ckptstore, on any world size DCP supports.

ckptstore itself never reads ``.metadata`` nor the pickles: the manifest carries the tree of
non-tensor values as JSON and, per tensor, where its raw bytes sit (file, offset, length, chunk
offsets); loading reads those bytes and nothing else. A tensor DCP would pickle inside another
value (in a tuple, a numpy array) is also written raw under ``__ckptstore__.<key>``, for this
reader. Checkpoints of the first release (``shard-rNNNNN.<token>.bin``: raw bytes, no
``.metadata``) still load.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..buffers import ALIGN, TENSOR_ALIGN, align_up, aligned_empty, as_bytes
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    unreachable,
    unreachable_error,
)
from ..manifest import CRC_CHUNK, Checksum, FileEntry, Manifest, _file_from_json
from ..storage import Dest, SegmentPayload, crc_chunks
from ..tree import EncodedState, decode, dtype_from_name, dtype_name, like_tensors, tensor_keys
from . import LoadContext, SaveContext
from .mapped import MappedFile, mappable
from .torchzip import wrap

_BIG = 1 << 20  # tensors this large start on a page boundary so O_DIRECT can read them in place
PRIVATE = "__ckptstore__"  # raw copies of tensors DCP would only pickle (see the docstring)
DCP_METADATA = ".metadata"
FORMAT_VERSION = 2


def _chunk_key(fqn: str, offsets: Sequence[int]) -> str:
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


class DCPFormat:
    """Each rank writes its shard; replicated tensors once; loadable on any world size."""

    name = "dcp"
    takes_dtensor = True  # each rank writes its shard

    def writes_on(self, rank: int, world_size: int) -> bool:
        return True

    def stage(self, enc: EncodedState | None, ctx: SaveContext) -> Any:
        assert enc is not None
        flat: dict[str, torch.Tensor] = dict(enc.tensors)
        event = None
        if ctx.background:
            # Sharded (DTensor) values: this rank's shard is what it writes, so the snapshot is
            # a copy of the local shard, re-wrapped with the same sharding spec for DCP's plan.
            local = {k: _local(t) for k, t in flat.items()}
            cuda = any(t.is_cuda for t in local.values())
            offsets, pos = {}, 0
            for k, t in local.items():
                pos = align_up(pos, TENSOR_ALIGN)
                offsets[k] = pos
                pos += t.numel() * t.element_size()
            buf = ctx.arena.take(max(pos, 1), pin=cuda)
            snap, pairs = {}, []
            for k, t in local.items():
                n = t.numel() * t.element_size()
                view = buf[offsets[k] : offsets[k] + n]
                if n:
                    pairs.append((view, as_bytes(t)))
                copy = view.view(t.dtype).view(t.shape) if n else torch.empty_like(t, device="cpu")
                snap[k] = _rewrap(flat[k], copy)
            ctx.io.copy_all(pairs, cuda=cuda)
            flat = snap
            if cuda:
                event = torch.cuda.Event()
                event.record()
        dcp_state, fqns = _dcp_view(enc, flat)
        return dcp_state, fqns, enc, event

    def persist(self, staged: Any, ctx: SaveContext) -> None:
        dcp_state, fqns, enc, event = staged
        if event is not None:
            event.synchronize()
        writer = _Writer(ctx, enc, fqns)
        try:
            with _quiet():
                dcp.save(
                    dcp_state,
                    storage_writer=writer,
                    planner=dcp.DefaultSavePlanner(),
                    process_group=ctx.group,
                    no_dist=ctx.group is None,
                )
        except dcp.CheckpointException as e:
            raise _unwrap(e) from e

    def load(
        self, manifest: Manifest, ctx: LoadContext, keys: Sequence[str], like: Mapping[str, Any]
    ) -> dict[str, Any]:
        tree, tmeta = _tree_and_meta(manifest)
        wanted = list(dict.fromkeys(k for key in keys for k in tensor_keys(tree[key])))
        mine = like_tensors(tree, like, keys)
        for k in wanted:
            if k not in tmeta:
                raise CorruptCheckpointError(f"{manifest.url}: tree references unknown {k!r}")
        fresh = [k for k in wanted if k not in mine or not (mine[k][1] or _is_dtensor(mine[k][0]))]
        mapped = _mapped(manifest, ctx, tmeta, fresh)
        targets: dict[str, torch.Tensor] = {}
        for k in wanted:
            if k in mapped:
                continue
            m = tmeta[k]
            dtype, size = dtype_from_name(m["dtype"]), [int(x) for x in m["size"]]
            nbytes = dtype.itemsize * _prod(size)
            t, inplace = mine.get(k, (None, False))
            if t is not None and _is_dtensor(t) and list(t.shape) == size:
                # the caller's tensor is sharded (FSDP2): DCP reads just this rank's shard, in
                # the saved dtype (load_state_dict casts it, e.g. fp32 weights into bf16 ones)
                targets[k] = torch.empty_like(t, dtype=dtype)
            elif t is not None and inplace and _fits(t, dtype, size):
                targets[k] = t  # read straight into the caller's tensor (a resume)
            elif nbytes >= _BIG:
                targets[k] = aligned_empty(nbytes).view(dtype).view(size)
            else:
                targets[k] = torch.empty(size, dtype=dtype)
        if targets:
            reader = _Reader(manifest, ctx, tmeta)
            try:
                with _quiet():
                    dcp.load(
                        targets,
                        storage_reader=reader,
                        planner=dcp.DefaultLoadPlanner(),
                        process_group=ctx.group,
                        no_dist=ctx.group is None,
                    )
            except dcp.CheckpointException as e:
                raise _unwrap(e) from e
        return {key: decode(tree[key], {**targets, **mapped}) for key in keys}

    def describe(self, manifest: Manifest, ctx: LoadContext) -> dict[str, Any]:
        tree, tmeta = _tree_and_meta(manifest)
        return {
            "tree": tree,
            "types": manifest.format_data.get("types", {}),
            "tensors": [
                {
                    "key": k,
                    "dtype": m["dtype"],
                    "shape": m["size"],
                    "nbytes": dtype_from_name(m["dtype"]).itemsize * _prod(m["size"]),
                    "file": ",".join(sorted({c["file"] for c in m["chunks"]})),
                }
                for k, m in tmeta.items()
            ],
        }


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    return t.to_local().detach() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _rewrap(original: torch.Tensor, local_copy: torch.Tensor) -> torch.Tensor:
    """``local_copy`` as ``original`` was: a DTensor with the same sharding spec (mesh,
    placements, global shape) around the copy of its shard, or the plain copy.

    The DTensor constructor takes the local tensor as it is (``DTensor.from_local`` would move
    a CPU copy back to the mesh's GPU); torch's own async DCP staging does the same.
    """
    if not _is_dtensor(original):
        return local_copy
    from torch.distributed.tensor import DTensor

    return DTensor(local_copy, original._spec, requires_grad=False)  # type: ignore[attr-defined]


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dcp.save/load warn on every single-process call, which is how we use them outside a
    job; silence exactly that warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _mapped(
    manifest: Manifest, ctx: LoadContext, tmeta: Mapping[str, Any], keys: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Fresh tensors of ``keys`` straight from the mapped shard files (verified), for tensors
    stored whole in one chunk on a local disk; the rest go through DCP's planning."""
    whole: dict[str, list[str]] = {}
    for k in keys:
        m, chunks = tmeta[k], tmeta[k]["chunks"]
        nbytes = dtype_from_name(m["dtype"]).itemsize * _prod(m["size"])
        one = len(chunks) == 1 and not any(chunks[0]["offsets"])
        if one and chunks[0]["sizes"] == m["size"] and int(chunks[0]["length"]) == nbytes:
            whole.setdefault(str(chunks[0]["file"]), []).append(k)
    out: dict[str, torch.Tensor] = {}
    for fname, ks in whole.items():
        path = ctx.storage.join(ctx.step_dir, fname)
        local = ctx.storage.local_path(path)
        if not mappable(local, ctx.io):
            return {}
        assert local is not None
        mapped = MappedFile(local, manifest.file(fname), ctx.storage.url(path))
        spans = [
            (int(tmeta[k]["chunks"][0]["offset"]), int(tmeta[k]["chunks"][0]["length"])) for k in ks
        ]
        mapped.verify([(a, a + n) for a, n in spans])
        for k, (a, n) in zip(ks, spans, strict=True):
            out[k] = mapped.tensor(a, n, dtype_from_name(tmeta[k]["dtype"]), tmeta[k]["size"])
    return out


def _fits(t: torch.Tensor, dtype: torch.dtype, size: Sequence[int]) -> bool:
    """Whether the saved chunks can be read straight into ``t`` (no cast, no reshape)."""
    return (
        not _is_dtensor(t)
        and t.device.type == "cpu"
        and t.is_contiguous()
        and t.dtype == dtype
        and list(t.shape) == list(size)
    )


def _dcp_view(
    enc: EncodedState, flat: Mapping[str, torch.Tensor]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The state as a user would hand it to ``dcp.save`` (every entry's state dict, nested),
    rebuilt from the tree around ``flat`` (the tensors, or their snapshot), and the name DCP
    gives each of our tensor keys. Tensors DCP would only pickle (in a tuple, a numpy array)
    are added raw under ``PRIVATE``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    if PRIVATE in enc.tree:
        raise CheckpointError(f"state key {PRIVATE!r} is reserved by the 'dcp' format; rename it")
    view = {name: decode(node, flat) for name, node in enc.tree.items()}
    try:
        flattened, _ = flatten_state_dict(view)
    except ValueError as e:  # "duplicated flatten key": DCP's names are dotted paths
        raise CheckpointError(
            f"the 'dcp' format cannot name every value of this state ({e}): two paths join to "
            "the same dotted name; rename a key, or use format='torch'"
        ) from None
    seen: dict[int, str] = {}
    for fqn, v in flattened.items():
        if isinstance(v, torch.Tensor):
            seen.setdefault(id(v), fqn)
    fqns: dict[str, str] = {}
    hidden: dict[str, torch.Tensor] = {}
    for k, t in flat.items():
        if id(t) in seen:
            fqns[k] = seen[id(t)]
        else:
            hidden[k] = t
            fqns[k] = f"{PRIVATE}.{k}"
    if hidden:
        view[PRIVATE] = hidden
    return view, fqns


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _unwrap(e: BaseException) -> Exception:
    """DCP wraps per-rank failures; surface ours (corruption, disk full) with their message."""
    failures = getattr(e, "failures", None) or {}
    inners = [(r, err[0] if isinstance(err, tuple) else err) for r, err in sorted(failures.items())]
    for rank, inner in inners:
        if isinstance(inner, CheckpointError):
            return type(inner)(f"rank {rank}: {inner}")
    for rank, inner in inners:
        if isinstance(inner, (RuntimeError, ValueError)):
            return IncompatibleCheckpointError(f"rank {rank}: {type(inner).__name__}: {inner}")
    if inners:  # storage trouble (OSError, botocore, ...): the caller may try another copy
        rank, inner = inners[0]
        if unreachable(inner):
            return unreachable_error(inner, f"rank {rank}'s part")
        return OSError(f"rank {rank}: {inner!r}")
    return CheckpointError(f"torch.distributed.checkpoint failed: {e}")


def _tree_and_meta(manifest: Manifest) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        tree, tmeta = manifest.format_data["tree"], manifest.format_data["tensors"]
        if not isinstance(tree, dict) or not isinstance(tmeta, dict):
            raise TypeError("tree and tensors must be objects")
        for m in tmeta.values():
            dtype_from_name(str(m["dtype"]))
            for c in m["chunks"]:
                manifest.file(str(c["file"]))
                if int(c["offset"]) < 0 or int(c["length"]) < 0:
                    raise ValueError("negative offset")
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{manifest.url}: malformed 'dcp' metadata ({e})") from None
    return tree, tmeta


class _Writer(StorageWriter):
    def __init__(self, ctx: SaveContext, enc: EncodedState, fqns: Mapping[str, str]) -> None:
        super().__init__()
        self.ctx, self.enc, self.fqns = ctx, enc, fqns

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        ctx = self.ctx
        shard = _Shard(f"shard-r{ctx.rank:05d}.{ctx.token}.distcp")
        placed = [(item, shard.add(item, planner.resolve_data(item))) for item in plan.items]
        results: list[WriteResult] = []
        if placed:
            ctx.storage.makedirs(ctx.step_dir)
            path = ctx.storage.join(ctx.step_dir, shard.name)
            entry = ctx.storage.write_payload(
                path, SegmentPayload(shard.size, shard.segments), ctx.io, background=ctx.background
            )
            file_json = FileEntry(entry.path, entry.size, entry.checksum, ctx.rank).to_json()
            for i, (item, sd) in enumerate(placed):
                if i == 0:
                    sd = {**sd, "entry": file_json}
                results.append(
                    WriteResult(index=item.index, size_in_bytes=sd["blob"][1], storage_data=sd)
                )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileEntry] = {}
        where: dict[str, dict[str, Any]] = {}
        storage_data: dict[MetadataIndex, Any] = {}
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                if "entry" in sd:
                    entry = _file_from_json(sd["entry"])
                    files[entry.path] = entry
                offsets = wr.index.offset if wr.index.offset is not None else ()
                where[_chunk_key(wr.index.fqn, offsets)] = sd
                storage_data[wr.index] = dcp_fs._StorageInfo(
                    sd["file"], sd["blob"][0], sd["blob"][1]
                )
        key_of = {fqn: k for k, fqn in self.fqns.items()}
        tensors: dict[str, Any] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or fqn not in key_of:
                continue  # a pickled value, or the second name of a tied weight
            chunks = []
            for c in md.chunks:
                sd = where[_chunk_key(fqn, c.offsets)]
                chunks.append(
                    {
                        "offsets": list(c.offsets),
                        "sizes": list(c.sizes),
                        "file": sd["file"],
                        "offset": sd["offset"],
                        "length": sd["length"],
                    }
                )
            tensors[key_of[fqn]] = {
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
                "chunks": chunks,
                "fqn": fqn,
            }
        missing = sorted(set(self.fqns) - set(tensors))
        if missing:
            raise CheckpointError(f"DCP planned no storage for tensors {missing[:5]}")
        files[DCP_METADATA] = self._write_dcp_metadata(metadata, storage_data)
        format_data = {
            "version": FORMAT_VERSION,
            "tree": self.enc.tree,
            "types": self.enc.types,
            "tensors": tensors,
        }
        self.ctx.commit(sorted(files.values(), key=lambda f: f.path), format_data)

    def _write_dcp_metadata(
        self, metadata: Metadata, storage_data: dict[MetadataIndex, Any]
    ) -> FileEntry:
        """DCP's own ``.metadata`` (a pickle, as DCP's readers expect), durable before the
        manifest; ckptstore never reads it back."""
        ctx = self.ctx
        metadata.storage_data = storage_data
        metadata.storage_meta = StorageMeta(
            checkpoint_id=ctx.storage.url(ctx.step_dir), save_id=ctx.token
        )
        metadata.version = getattr(dcp_fs, "CURRENT_DCP_VERSION", "1.0.0")
        blob = pickle.dumps(metadata)
        ctx.storage.write_small(ctx.storage.join(ctx.step_dir, DCP_METADATA), blob)
        crcs = tuple(crc for _, crc in crc_chunks(memoryview(blob), 0))
        return FileEntry(DCP_METADATA, len(blob), Checksum(CRC_CHUNK, crcs), ctx.rank)


class _Shard:
    """One rank's shard file being laid out: every tensor chunk a ``torch.save`` archive around
    its raw bytes (large ones page-aligned), every other value DCP's pickle; the same tensor
    (tied weights) is written once and named twice."""

    def __init__(self, name: str) -> None:
        self.name, self.size = name, 0
        self.segments: list[tuple[int, torch.Tensor]] = []
        self._seen: dict[tuple[Any, ...], dict[str, Any]] = {}

    def add(self, item: Any, data: Any) -> dict[str, Any]:
        if item.type == WriteItemType.BYTE_IO:
            raw = bytes(data.getbuffer())
            sd: dict[str, Any] = {"file": self.name, "blob": [self.size, len(raw)]}
            self._put(raw)
            return sd
        assert isinstance(data, torch.Tensor)
        t = data.detach()
        ident = None
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            ident = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if ident in self._seen:
                return self._seen[ident]
        b = as_bytes(t)
        n = b.numel()
        start = self.size
        head, tail = wrap(
            t.dtype, tuple(t.shape), start=start, align=ALIGN if n >= _BIG else TENSOR_ALIGN
        )
        self._put(head)
        sd = {"file": self.name, "offset": self.size, "length": n, "blob": []}
        if n:
            self.segments.append((self.size, b))
            self.size += n
        self._put(tail)
        sd["blob"] = [start, self.size - start]
        if ident is not None:
            self._seen[ident] = sd
        return sd

    def _put(self, raw: bytes) -> None:
        if raw:
            self.segments.append((self.size, torch.frombuffer(bytearray(raw), dtype=torch.uint8)))
            self.size += len(raw)


class _Reader(StorageReader):
    def __init__(self, manifest: Manifest, ctx: LoadContext, tmeta: dict[str, Any]) -> None:
        super().__init__()
        self.manifest, self.ctx, self.tmeta = manifest, ctx, tmeta
        self.where: dict[str, dict[str, Any]] = {
            _chunk_key(fqn, c["offsets"]): c for fqn, m in tmeta.items() for c in m["chunks"]
        }

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = {
            fqn: TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(m["dtype"])),
                size=torch.Size(m["size"]),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"])
                    )
                    for c in m["chunks"]
                ],
            )
            for fqn, m in self.tmeta.items()
        }
        return Metadata(state_dict_metadata=md)  # type: ignore[arg-type]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise CorruptCheckpointError(
                    f"{self.manifest.url}: unexpected non-tensor item {req.storage_index.fqn!r}"
                )
            idx: MetadataIndex = req.storage_index
            c = self.where[_chunk_key(idx.fqn, idx.offset or ())]
            per_file.setdefault(c["file"], []).append((req, c))
        for fname, reqs in per_file.items():
            self._read_file(fname, reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, fname: str, reqs: list[Any], planner: LoadPlanner) -> None:
        entry = self.manifest.file(fname)
        dests: list[Dest] = []
        later: list[tuple[Any, torch.Tensor, Any]] = []
        direct: list[tuple[Any, torch.Tensor]] = []
        for req, c in reqs:
            target = planner.resolve_tensor(req).detach()
            whole = list(req.lengths) == list(c["sizes"]) and not any(req.storage_offsets)
            if whole and target.is_contiguous() and target.device.type == "cpu":
                dests.append(Dest(int(c["offset"]), as_bytes(target)))
                direct.append((req, target))
            else:
                tmp = torch.empty(int(c["length"]), dtype=torch.uint8)
                dests.append(Dest(int(c["offset"]), tmp))
                later.append((req, tmp, c))
        path = self.ctx.storage.join(self.ctx.step_dir, fname)
        self.ctx.storage.read_into(path, entry, dests, self.ctx.io)
        for req, target in direct:
            planner.commit_tensor(req, target)
        for req, tmp, c in later:
            m = self.tmeta[req.storage_index.fqn]
            t = tmp.view(dtype_from_name(m["dtype"])).view(c["sizes"])
            for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                t = t.narrow(dim, off, n)
            target = planner.resolve_tensor(req).detach()
            target.copy_(t)
            planner.commit_tensor(req, target)

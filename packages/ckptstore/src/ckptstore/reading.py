"""Loading: which checkpoints to try, in what order, and trying them on every rank at once.

Rank 0 lists the candidates (the primary and the mirror, newest commit first); every rank reads
and verifies what its own state needs; after each candidate the ranks agree, so they all fall
back to the same older checkpoint, never to different ones.
"""

from __future__ import annotations

import contextlib
import inspect
import io as _io
import pickle
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._dist import all_gather
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    NoCheckpointError,
    warn,
)
from .foreign import why_refused
from .formats import LoadContext, get_format
from .layout import Location
from .manifest import Manifest
from .storage import IOEngine, Storage
from .tree import has_state_dict

Loaded = tuple[Manifest, dict[str, Any]]
Verdict = tuple[str, str] | None  # ("absent" | "skip" | "fatal", why), or None: fine


@dataclass(frozen=True, slots=True)
class Candidate:
    where: str  # a key of the locations: "primary", "mirror", "external"
    step: int
    step_dir: str


@dataclass(frozen=True, slots=True)
class Skip:
    reason: str
    silent: bool = False  # a save that never committed: it does not exist, say nothing


def candidates(
    locs: Mapping[str, Location], step: int | None, head: int | None = None
) -> list[Candidate]:
    """Rank 0: checkpoints to try, in order; ``step`` None means "latest": ``head`` (the newest
    commit across all locations, by commit time, so a rewound run's head beats the abandoned
    timeline's higher steps) first, then older steps, then steps above the head."""
    dirs = _listings(locs)
    if step is not None:
        return [Candidate(n, step, d[step]) for n, d in dirs.items() if step in d]
    steps = sorted(set().union(*(d.keys() for d in dirs.values())))
    if not steps:
        return []
    head = steps[-1] if head is None else head  # nothing committed: try them all, newest first
    order = [s for s in reversed(steps) if s <= head] + [s for s in reversed(steps) if s > head]
    return [Candidate(n, s, d[s]) for s in order for n, d in dirs.items() if s in d]


def _listings(locs: Mapping[str, Location]) -> dict[str, dict[int, str]]:
    """Step folders per location; an unreachable mirror is skipped with a warning (the
    primary's failure is the caller's error)."""
    dirs = {name: _listing(name, loc) for name, loc in locs.items()}
    return {name: d for name, d in dirs.items() if d is not None}


def _listing(name: str, loc: Location) -> dict[int, str] | None:
    try:
        return loc.step_dirs()
    except (OSError, CheckpointError) as e:
        if name == "primary":
            raise
        warn(f"ckptstore: {name} {loc.url} unreachable, using the primary alone: {e}")
        return None


class Reader:
    """Tries candidates on every rank of the store's group; see the module docstring."""

    def __init__(self, *, rank: int, world_size: int, group: Any, io: IOEngine) -> None:
        self.rank, self.world_size, self.group, self.io = rank, world_size, group, io

    def load_ctx(self, loc: Location, step_dir: str) -> LoadContext:
        return LoadContext(
            storage=loc.storage,
            step_dir=step_dir,
            rank=self.rank,
            world_size=self.world_size,
            group=self.group,
            io=self.io,
        )

    def first_loadable(
        self,
        cands: Sequence[Candidate],
        locs: Mapping[str, Location],
        request: Request,
        protect: Callable[[int], contextlib.AbstractContextManager[None]],
    ) -> tuple[Loaded | None, list[str]]:
        """The first candidate that loads (warning about each one skipped), and the reasons
        every skipped one gave."""
        skipped: list[str] = []
        for i, c in enumerate(cands):
            with protect(c.step):
                result = self.try_one(locs[c.where], c, request)
            if not isinstance(result, Skip):
                return result, skipped
            skipped.append(result.reason)
            if not result.silent:
                _warn_skip(result.reason, cands[i + 1] if i + 1 < len(cands) else None, request)
        return None, skipped

    def try_one(self, loc: Location, c: Candidate, request: Request) -> Loaded | Skip:
        """A loaded candidate, or why it was skipped. Every rank reaches the same verdict."""
        manifest, want, verdict = self._plan(loc, c, request)
        if (skip := self._settle(verdict, silent="absent")) is not None:
            return skip
        assert manifest is not None
        values, verdict = self._fetch(loc, c, manifest, want, request)
        if (skip := self._settle(verdict)) is not None:
            return skip
        return manifest, values

    def _plan(
        self, loc: Location, c: Candidate, request: Request
    ) -> tuple[Manifest | None, list[str], Verdict]:
        try:
            manifest = loc.read_manifest(c.step_dir)
            return manifest, self._keys_to_read(manifest, loc, request), None
        except FileNotFoundError:
            url = loc.storage.url(c.step_dir)
            return None, [], ("absent", f"{url}: no manifest.json (not committed)")
        except Exception as e:
            return None, [], _verdict(e, loc.storage.url(c.step_dir))

    def _fetch(
        self, loc: Location, c: Candidate, manifest: Manifest, want: list[str], request: Request
    ) -> tuple[dict[str, Any], Verdict]:
        try:
            fmt = get_format(manifest.format)()
            ctx = self.load_ctx(loc, c.step_dir)
            return fmt.load(manifest, ctx, want, request.like), None
        except (RuntimeError, ValueError) as e:  # e.g. torch refusing a size mismatch
            return {}, ("fatal", f"{type(e).__name__}: {e}")
        except Exception as e:
            return {}, _verdict(e, manifest.url)

    def _settle(self, verdict: Verdict, silent: str = "") -> Skip | None:
        verdict = self.agree(verdict)
        if verdict is None:
            return None
        if verdict[0] == "fatal":
            raise IncompatibleCheckpointError(verdict[1])
        return Skip(verdict[1], silent=verdict[0] == silent)

    def agree(self, verdict: Verdict) -> Verdict:
        """Every rank's verdict, merged: a fatal one wins, then the first rank's skip."""
        if self.group is None:
            return verdict
        got = all_gather(self.group, verdict)
        bad = [(r, v) for r, v in enumerate(got) if v is not None]
        if not bad:
            return None
        fatal = [(r, v) for r, v in bad if v[0] == "fatal"]
        r, v = (fatal or bad)[0]
        return v[0], f"(rank {r}) {v[1]}"

    def _keys_to_read(self, manifest: Manifest, loc: Location, request: Request) -> list[str]:
        tree = get_format(manifest.format)().describe(manifest, self.load_ctx(loc, ""))["tree"]
        if request.keys is None:
            return list(tree)
        missing = [k for k in request.keys if k not in tree]
        if missing and request.strict:
            raise IncompatibleCheckpointError(
                f"{manifest.url} has no {missing} (it has {sorted(tree)}); pass strict=False to "
                "load the rest (on the command line: `ckptstore export URL --step N --key KEY "
                "--out FILE` writes the entries it has, for a tool that starts from them)"
            )
        if missing:
            warn(f"ckptstore: {manifest.url} has no {missing}; left unchanged (strict=False)")
        return [k for k in request.keys if k in tree]


@dataclass(frozen=True, slots=True)
class Request:
    """What a caller wants from a checkpoint."""

    keys: Sequence[str] | None
    like: Mapping[str, Any]
    strict: bool
    latest: bool  # falling back to an older checkpoint is fine (it is not for an explicit step)


def _verdict(e: Exception, url: str) -> Verdict:
    if isinstance(e, CorruptCheckpointError):
        return "skip", str(e)
    if isinstance(e, CheckpointError):
        return "fatal", f"{type(e).__name__}: {e}"
    return "skip", f"{url}: cannot read ({e!r})"  # unreachable storage: try the next


def _warn_skip(reason: str, nxt: Candidate | None, request: Request) -> None:
    if nxt is not None:
        warn(f"ckptstore: skipped {reason}; trying step {nxt.step} ({nxt.where})")
    elif request.latest:
        warn(f"ckptstore: skipped {reason}")


# -- applying loaded values ------------------------------------------------------------------
def apply_values(state: MutableMapping[str, Any], values: Mapping[str, Any], strict: bool) -> None:
    """Objects through ``load_state_dict``, tensors in place; other entries are replaced."""
    for key, value in values.items():
        target = state[key]
        where = f"state[{key!r}]"
        if isinstance(target, torch.Tensor):
            _copy_tensor(target, value, where)
        elif has_state_dict(target):
            _load_state_dict(target, value, strict, where)
        else:
            state[key] = own_storage(value)


def _copy_tensor(target: torch.Tensor, value: Any, where: str) -> None:
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
        raise IncompatibleCheckpointError(
            f"{where} is a tensor of shape {tuple(target.shape)}; checkpoint has {got}"
        )
    with torch.no_grad():
        target.copy_(value)


def own_storage(v: Any) -> Any:
    """Tensors handed back to the caller get storage of their own: loaded tensors are views
    into one read buffer, and some torch APIs (``torch.set_rng_state``!) ignore a view's
    storage offset."""
    if isinstance(v, torch.Tensor):
        whole = v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.nbytes
        return v if whole else v.clone()
    if isinstance(v, dict):
        out = type(v)((k, own_storage(x)) for k, x in v.items())
        if hasattr(v, "_metadata"):
            out._metadata = v._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(v, list):
        return [own_storage(x) for x in v]
    if isinstance(v, tuple):
        return tuple(own_storage(x) for x in v)
    return v


def _load_state_dict(target: Any, value: Any, strict: bool, where: str) -> None:
    fn = target.load_state_dict
    try:
        accepts_strict = "strict" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        accepts_strict = False
    try:
        out = fn(value, strict=strict) if accepts_strict else fn(value)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise IncompatibleCheckpointError(
            f"{where}.load_state_dict() refused the checkpoint: {e}"
        ) from e
    missing = getattr(out, "missing_keys", None)
    unexpected = getattr(out, "unexpected_keys", None)
    if not strict and (missing or unexpected):
        warn(f"ckptstore: {where}: missing keys {missing}, unexpected keys {unexpected}")


# -- a checkpoint at a path ------------------------------------------------------------------
@contextlib.contextmanager
def _refused_pickle(url: str) -> Iterator[None]:
    try:
        yield
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as e:
        why = why_refused(e)
        raise CorruptCheckpointError(
            f"{url}: refused: not loadable with weights_only=True ({why}); ckptstore never "
            "unpickles arbitrary objects, which could run code. Load it yourself only if you "
            "trust its origin, and re-save with ckptstore"
        ) from None


def read_torch_save(storage: Storage, path: str, request: Request) -> Loaded:
    """A plain torch.save file (e.g. from before ckptstore), read with weights_only=True."""
    url = storage.url(path)
    with _refused_pickle(url):
        data = storage.read_small(path)
        obj = torch.load(_io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict):
        obj = {"model": obj}
    want = list(obj) if request.keys is None else list(request.keys)
    missing = [k for k in want if k not in obj]
    if missing and request.strict:
        raise IncompatibleCheckpointError(f"{url} has no {missing} (it has {sorted(obj)})")
    step = obj.get("step", -1)
    manifest = Manifest(
        step=step if isinstance(step, int) else -1,
        format="torch.save",
        time=0.0,
        world_size=1,
        files=(),
        url=url,
    )
    return manifest, {k: obj[k] for k in want if k in obj}


def no_checkpoint(where: str, step: int | None, have: Sequence[int]) -> NoCheckpointError:
    if step is None:
        return NoCheckpointError(f"no checkpoint in {where}")
    return NoCheckpointError(f"no checkpoint for step {step} in {where} (have: {list(have)})")

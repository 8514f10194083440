"""Where an experiment lives on storage, and what names are valid there.

``ROOT/EXPERIMENT/`` holds ``step-%08d/`` folders (payload + ``manifest.json``), the ``latest``
pointer and, while a writer runs, ``writer.lock``. A step folder is a checkpoint only with a valid
manifest; one whose manifest cannot be trusted (invalid JSON, a step that does not match its
folder, missing fields) is *broken*, and is reported as such, never silently skipped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    unreachable,
    unreachable_error,
)
from .manifest import LATEST_NAME, MANIFEST_NAME, Manifest, parse_step_dir, step_dir_name
from .smallfile import UnreadableFileError
from .storage import Storage, open_storage

_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
EXPERIMENT_RULE = (
    "use letters, digits, '.', '_', '-' (and '/' between parts), each part starting with a "
    "letter or digit and at most 128 characters, 255 in all; it must stay inside the root"
)
# A temp file of the `latest` pointer, left by a kill between its write and its rename.
_STALE_POINTER_RE = re.compile(re.escape(LATEST_NAME) + r"\.tmp-[0-9a-f]+")
# Files the store itself creates inside a step directory; prune removes only these.
OWN_FILE_RE = re.compile(
    r"(manifest\.json|\.metadata|state\.[A-Za-z0-9]+\.(ckpt|safetensors)"
    r"|shard-r\d+\.[A-Za-z0-9]+\.(bin|distcp))(\.tmp-[0-9a-f]+)?"
)
MAX_STEP = 10**15


def validate_experiment_name(name: str) -> str:
    """``name`` if it is a valid experiment name, else ValueError (one line, with the rule)."""
    parts = name.split("/") if isinstance(name, str) else [""]
    if not all(_PART_RE.fullmatch(p) for p in parts) or len(name) > 255:
        raise ValueError(f"experiment {name!r} is not a valid name: {EXPERIMENT_RULE}")
    return name


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        raise ValueError(f"step must be an integer in [0, 1e15), got {step!r}")
    return step


@dataclass(frozen=True, slots=True)
class StepSpec:
    """Which checkpoint a caller means: the latest, one step, or one at a path/URL (a step
    folder of any store, or a plain ``torch.save`` file). ``parse`` is the one parser of
    "latest", ``42``, ``"42"``, ``"step-00000042"`` and paths."""

    step: int | None = None
    path: str | None = None

    @property
    def latest(self) -> bool:
        return self.step is None and self.path is None

    @classmethod
    def parse(cls, spec: int | str | StepSpec) -> StepSpec:
        if isinstance(spec, StepSpec):
            return spec
        if not isinstance(spec, str):
            return cls(step=check_step(spec))
        if spec == "latest":
            return cls()
        if spec.isdigit():
            return cls(step=check_step(int(spec)))
        n = parse_step_dir(spec)
        return cls(step=n) if n is not None else cls(path=spec)

    def __str__(self) -> str:
        return "latest" if self.latest else str(self.step if self.path is None else self.path)


def folder_step(path: str) -> int | None:
    """The step a step folder's name says (``.../step-00000042`` -> 42), else None."""
    return parse_step_dir(path.rstrip("/").rsplit("/", 1)[-1])


def split_step_url(url: str) -> tuple[str, int | None]:
    """``(root, step)`` of a URL that ends in a step folder; ``(url, None)`` otherwise."""
    url = url.rstrip("/") or "/"
    head, slash, last = url.rpartition("/")
    step = parse_step_dir(last) if slash else None
    return (head or "/", step) if step is not None else (url, None)


@dataclass(frozen=True, slots=True)
class ExperimentLocation:
    """Where an experiment lives: its URL (``~`` expanded, absolute, for local paths) and, on
    a local disk, its folder (where an application may keep logs beside the checkpoints)."""

    url: str
    local_path: str | None


def experiment_location(
    url: str, experiment: str | None = None, storage_options: dict[str, Any] | None = None
) -> ExperimentLocation:
    """Where ``CheckpointStore(url, experiment=...)`` keeps its checkpoints (no I/O)."""
    return Location.open(url, experiment, storage_options).where


@dataclass(frozen=True, slots=True)
class Scan:
    """Every step folder of an experiment, judged by its manifest (payloads not re-read)."""

    url: str
    checkpoints: dict[int, Manifest] = field(default_factory=dict)
    broken: dict[int, str] = field(default_factory=dict)  # step -> why it cannot be trusted
    incomplete: tuple[int, ...] = ()  # no manifest: an interrupted save, not a checkpoint
    pointer: int | None = None  # the step `latest` names, whatever state it is in
    pointer_problem: str = ""
    newer: dict[int, str] = field(default_factory=dict)  # step -> written by a newer ckptstore

    @property
    def head(self) -> int | None:
        """The newest commit: the committed step with the latest commit time (the manifest is
        the commit; the `latest` pointer moves after it, so a kill in between leaves the
        pointer one save behind). On equal times the pointer's step, then the higher step."""
        if not self.checkpoints:
            return None
        return max(self.checkpoints, key=self._commit_order)

    def _commit_order(self, step: int) -> tuple[float, bool, int]:
        return self.checkpoints[step].time, step == self.pointer, step

    @property
    def newer_latest(self) -> str:
        """Why "latest" is not for this ckptstore, or "": the newest checkpoint (the one
        ``latest`` names, or one above every step this ckptstore reads) was written by a newer
        ckptstore. The rule everywhere (load, verify, list, trainers): refuse, in one line;
        never fall back past it to an older step unasked."""
        s, head = self.newer_latest_step, self.head
        if s is None:
            return ""
        older = f"; step {head} is the newest this one reads: name it to load that" if head else ""
        return f"{self.newer[s]}{older}"

    @property
    def newer_latest_step(self) -> int | None:
        """The step of ``newer_latest``, or None."""
        head = self.head
        steps = [s for s in self.newer if head is None or s > head or s == self.pointer]
        return max(steps) if steps else None

    def problems(self) -> list[str]:
        """One line per thing that cannot be trusted (broken manifests, a bad pointer) or
        needs a newer ckptstore."""
        out = [f"step {s}: {why}" for s, why in sorted(self.broken.items())]
        out += [f"step {s}: {why}" for s, why in sorted(self.newer.items())]
        return out + ([self.pointer_problem] if self.pointer_problem else [])


class Location:
    """One experiment folder on one storage (the primary or the mirror) and its layout."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage, self.root = storage, root
        self.url = storage.url(root)

    @classmethod
    def open(
        cls, url: str | Storage, experiment: str | None, options: dict[str, Any] | None = None
    ) -> Location:
        if not (isinstance(url, str) and url) and not hasattr(url, "list_dir"):
            raise ValueError(
                "url must be a local path, an fsspec URL (e.g. /ckpt or s3://b/ckpt) or a Storage"
            )
        storage = open_storage(url, options) if isinstance(url, str) else url
        if experiment is None:
            return cls(storage, storage.root)
        return cls(storage, storage.join(storage.root, validate_experiment_name(experiment)))

    @property
    def where(self) -> ExperimentLocation:
        return ExperimentLocation(self.url, self.storage.local_path(self.root))

    def path(self, *names: str) -> str:
        return self.storage.join(self.root, *names)

    def step_dir(self, step: int) -> str:
        return self.path(step_dir_name(step))

    def step_dirs(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for name in self.storage.list_dir(self.root):
            step = parse_step_dir(name)
            if step is not None and (step not in out or name == step_dir_name(step)):
                out[step] = self.path(name)
        return out

    def read_manifest(self, step_dir: str, step: int | None = None) -> Manifest:
        """The manifest in ``step_dir``, checked against the step its folder names (if any).
        FileNotFoundError when absent (not a checkpoint); CheckpointError if it is bad."""
        data = self.storage.read_small(self.storage.join(step_dir, MANIFEST_NAME))
        m = Manifest.from_json(data, url=self.storage.url(step_dir))
        step = folder_step(step_dir) if step is None else step
        if step is not None and m.step != step:
            raise CorruptCheckpointError(
                f"{m.url}: manifest says step {m.step}, its folder says step {step}"
            )
        return m

    def judge(self, step: int, step_dir: str) -> Manifest | str | None:
        """The manifest of a committed step, why it cannot be trusted, or None (no manifest)."""
        try:
            return self.read_manifest(step_dir, step)
        except FileNotFoundError:
            return None
        except IncompatibleCheckpointError:
            raise  # not broken: written by a newer ckptstore (the scan keeps it apart)
        except (CheckpointError, OSError) as e:
            if unreachable(e):
                raise unreachable_error(e, self.storage.url(step_dir)) from e  # not broken
            return str(e)

    def scan(self) -> Scan:
        good: dict[int, Manifest] = {}
        bad: dict[int, str] = {}
        newer: dict[int, str] = {}
        incomplete: list[int] = []
        for step, d in sorted(self.step_dirs().items()):
            try:
                verdict = self.judge(step, d)
            except IncompatibleCheckpointError as e:
                newer[step] = str(e)
                continue
            if verdict is None:
                incomplete.append(step)
            elif isinstance(verdict, str):
                bad[step] = verdict
            else:
                good[step] = verdict
        pointer, problem = self.read_pointer()
        if pointer not in newer:
            problem = problem or _pointer_problem(pointer, good, bad, incomplete)
        return Scan(self.url, good, bad, tuple(incomplete), pointer, problem, newer)

    def read_pointer(self) -> tuple[int | None, str]:
        """(the step `latest` names or None, what is wrong with the pointer file or "")."""
        try:
            text = self.storage.read_small(self.path(LATEST_NAME))
        except UnreadableFileError as e:  # a FIFO, a device, gigabytes: broken, not absent
            return None, str(e)
        except OSError as e:
            if unreachable(e):
                raise unreachable_error(e, self.storage.url(self.path(LATEST_NAME))) from e
            return None, ""
        name = text.decode(errors="replace").strip()
        step = parse_step_dir(name)
        if step is None:
            return None, f"{self.path(LATEST_NAME)} holds {name[:40]!r}, not a step folder name"
        return step, ""

    def write_pointer(self, step: int) -> None:
        self.storage.write_small(self.path(LATEST_NAME), f"{step_dir_name(step)}\n".encode())

    def remove_checkpoint(self, step_dir: str, keep: Sequence[str] = ()) -> None:
        """Uncommit (manifest first), then delete our own files; foreign files stay."""
        self.storage.delete(self.storage.join(step_dir, MANIFEST_NAME))
        self.remove_own_files(step_dir, keep)
        self.storage.rmdir(step_dir)

    def remove_own_files(self, step_dir: str, keep: Sequence[str] = ()) -> None:
        for name in self.storage.list_dir(step_dir):
            if name not in keep and OWN_FILE_RE.fullmatch(name):
                self.storage.delete(self.storage.join(step_dir, name))

    def sweep_interrupted(self, *, below: int, protected: set[int]) -> list[int]:
        """Remove step folders without a manifest older than a step just committed, and stale
        temp files of the ``latest`` pointer: what a kill during a save or a prune left. No one
        writes them any more (one writer per experiment; a save in flight is protected), and
        without a manifest they are not checkpoints. Only our own files go: a foreign file
        keeps its folder."""
        for name in self.storage.list_dir(self.root):
            if _STALE_POINTER_RE.fullmatch(name):  # our pointer was renamed into place already
                self.storage.delete(self.path(name))
        swept = []
        for s, d in self.step_dirs().items():
            if s < below and s not in protected and MANIFEST_NAME not in self.storage.list_dir(d):
                self.remove_checkpoint(d)
                swept.append(s)
        return swept

    def experiments(self, depth: int = 3, max_folders: int = 500) -> list[str]:
        """Names of experiment folders below this one (folders holding step folders or a
        `latest` pointer), for a user who pointed a tool at the root of several. Looks at most
        ``depth`` levels down and lists at most ``max_folders`` folders (a root may be $HOME)."""
        found: list[str] = []
        todo = [(n, self.path(n), depth) for n in self.storage.list_dir(self.root) if _child(n)]
        for _ in range(max_folders):
            if not todo:
                break
            name, path, left = todo.pop(0)
            names = self.storage.list_dir(path)
            if LATEST_NAME in names or any(parse_step_dir(n) is not None for n in names):
                found.append(name)
            elif left > 1:
                todo += [(f"{name}/{n}", self.storage.join(path, n), left - 1) for n in names]
        return sorted(found)


def _child(name: str) -> bool:
    """A folder name that may be an experiment (not one of a checkpoint's own entries)."""
    return parse_step_dir(name) is None and name != LATEST_NAME


def _pointer_problem(
    pointer: int | None, good: dict[int, Manifest], bad: dict[int, str], incomplete: list[int]
) -> str:
    if pointer is None or pointer in good:
        return ""
    if pointer in bad:
        return f"latest names step {pointer}, whose manifest cannot be trusted"
    if pointer in incomplete:
        return f"latest names step {pointer}, which has no manifest.json (not committed)"
    return f"latest names step {pointer}, which does not exist"

"""``import_checkpoint``: a foreign checkpoint (see ``foreign.py``) saved as a verified
ckptstore checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, CorruptCheckpointError
from .foreign import Foreign, read_foreign, step_problem
from .manifest import Manifest
from .store import CheckpointStore


class ImportRefusedError(CheckpointError, ValueError):
    """The import would change what the experiment's next resume loads, and no flag said to:
    nothing was written (the command line exits 2: pass the flag, or choose another target)."""


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What ``import_checkpoint`` did: the foreign checkpoint and the one it wrote."""

    foreign: Foreign
    manifest: Manifest
    url: str  # the experiment folder it went into

    def summary(self) -> str:
        f = self.foreign
        took = ", ".join(f"{k} ({v})" for k, v in f.took.items())
        left = "; ".join(f"{k}: {v}" for k, v in f.left.items()) or "nothing"
        line = (
            f"imported {f.kind} checkpoint {f.source} as step {self.manifest.step} of {self.url} "
            f"(verified, {self.manifest.bytes} bytes): took {took}; left out {left}"
        )
        return line + (f"; {f.incomplete()}" if f.missing else "")


def import_checkpoint(
    source: str,
    dest: str,
    *,
    step: int | None = None,
    experiment: str | None = None,
    format: str = "torch",
    storage_options: dict[str, Any] | None = None,
    source_storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    rewind: bool = False,
    into_run: bool = False,
) -> ImportReport:
    """Read ``source`` (see ``read_foreign``) and save it as step ``step`` (default: the step
    the source recorded) of the experiment at ``dest[/experiment]``, then verify it.

    Refuses (:class:`ImportRefusedError`, nothing written): an experiment that holds a run's
    checkpoints (any not written by an import) unless ``into_run`` -- the import would become
    its newest checkpoint, and the run's next resume would load it, lacking what the run's
    checkpoints hold beyond it; replacing an existing step unless ``overwrite``; a step below
    the experiment's latest (which it would become: a resume would go back) unless ``rewind``.
    """
    foreign = read_foreign(source, storage_options=source_storage_options)
    if not foreign.state:
        raise CheckpointError(
            f"{source} is an empty {foreign.kind} checkpoint (it holds no entries): nothing to "
            "import; check that it is the file you meant"
        )
    step = foreign.step if step is None else step
    if step is None:
        raise CheckpointError(
            f"{source} {step_problem(foreign.state)} (a {foreign.kind} checkpoint): say which "
            "step it is with --step N"
        )
    meta = {"imported_from": source, "kind": foreign.kind, "took": foreign.took}
    meta |= {"left": foreign.left, "missing": foreign.missing}
    with CheckpointStore(
        dest,
        experiment=experiment,
        format=format,
        storage_options=storage_options,
        distributed=False,
    ) as store:
        if not into_run:
            _check_no_run(store, step, foreign)
        _check_target(store, step, overwrite=overwrite, rewind=rewind)
        store.save(step, foreign.state, metadata=meta)
        report = store.verify(step)
        if not report.ok:
            raise CorruptCheckpointError(f"the imported checkpoint does not verify: {report}")
        return ImportReport(foreign, store.manifest(step), store.url)


def _check_no_run(store: CheckpointStore, step: int, foreign: Foreign) -> None:
    """Refuse to add to an experiment a run writes: a resume there loads its newest checkpoint,
    and an import (weights, perhaps an optimizer) is no checkpoint of that run."""
    scan = store.scan()
    run = {s: m for s, m in scan.checkpoints.items() if not _imported(m.metadata)}
    if not run:
        return
    latest = max(run)
    lacks = _lacks(store, latest, foreign)
    raise ImportRefusedError(
        f"{store.url} holds a run's checkpoints (up to step {latest}): the import would become "
        f"its newest checkpoint (step {step}) and the run's next resume would load it{lacks}; "
        "import into a new experiment (another URL, or --experiment NAME) and start a run "
        f"from its weights there (pyrecover-train: `pyrecover-train import-checkpoint "
        f"{foreign.source} --experiment-name NEW`, then --resume-from-checkpoint latest), or "
        "pass --into-run to add it anyway"
    )


def _imported(metadata: Mapping[str, Any]) -> bool:
    return isinstance(metadata, Mapping) and "imported_from" in metadata


def _lacks(store: CheckpointStore, latest: int, foreign: Foreign) -> str:
    """What the run's checkpoints hold and the import does not (what a resume from it misses)."""
    try:
        entries = list(store.inspect(latest)["types"])
    except (CheckpointError, OSError):  # only for the message
        return ""
    lacks = [e for e in entries if e not in foreign.state]
    if not lacks:
        return ""
    holds = ", ".join(map(str, foreign.state))
    return f", which holds {holds} but not the run's {', '.join(map(str, lacks))}"


def _check_target(store: CheckpointStore, step: int, *, overwrite: bool, rewind: bool) -> None:
    """Refuse to replace a step, or to make an older step the latest, unless asked to."""
    if step in store.steps() and not overwrite:
        raise ImportRefusedError(
            f"{store.url} already has step {step}: pass --overwrite to replace it, or "
            "--step N to import under another step"
        )
    latest = store.latest_step()
    if latest is not None and step < latest and not rewind:
        raise ImportRefusedError(
            f"{store.url} is at step {latest}: step {step} would become its latest checkpoint, "
            f"so a resume would go back {latest - step} steps (and its saves replace steps up "
            f"to {latest}); import into a new experiment, as a step above {latest} (--step N), "
            "or pass --rewind if going back is what you want"
        )

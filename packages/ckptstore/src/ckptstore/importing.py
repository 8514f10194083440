"""``import_checkpoint``: a foreign checkpoint (see ``foreign.py``) saved as a verified
ckptstore checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, CorruptCheckpointError
from .foreign import Foreign, read_foreign, step_problem
from .manifest import Manifest
from .store import CheckpointStore


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
) -> ImportReport:
    """Read ``source`` (see ``read_foreign``) and save it as step ``step`` (default: the step
    the source recorded) of the experiment at ``dest[/experiment]``, then verify it. Refuses
    to replace an existing step unless ``overwrite``, and to import below the experiment's
    latest step (which it would become: a resume would go back) unless ``rewind``."""
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
        _check_target(store, step, overwrite=overwrite, rewind=rewind)
        store.save(step, foreign.state, metadata=meta)
        report = store.verify(step)
        if not report.ok:
            raise CorruptCheckpointError(f"the imported checkpoint does not verify: {report}")
        return ImportReport(foreign, store.manifest(step), store.url)


def _check_target(store: CheckpointStore, step: int, *, overwrite: bool, rewind: bool) -> None:
    """Refuse to replace a step, or to make an older step the latest, unless asked to."""
    if step in store.steps() and not overwrite:
        raise CheckpointError(
            f"{store.url} already has step {step}: pass --overwrite to replace it, or "
            "--step N to import under another step"
        )
    latest = store.latest_step()
    if latest is not None and step < latest and not rewind:
        raise CheckpointError(
            f"{store.url} is at step {latest}: step {step} would become its latest checkpoint, "
            f"so a resume would go back {latest - step} steps (and its saves replace steps up "
            f"to {latest}); import into a new experiment, as a step above {latest} (--step N), "
            "or pass --rewind if going back is what you want"
        )

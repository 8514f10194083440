"""``import_checkpoint``: a foreign checkpoint (see ``foreign.py``) saved as a verified
ckptstore checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError, CorruptCheckpointError
from .foreign import Foreign, read_foreign
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
        return (
            f"imported {f.kind} checkpoint {f.source} as step {self.manifest.step} of {self.url} "
            f"(verified, {self.manifest.bytes} bytes): took {took}; left out {left}"
        )


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
) -> ImportReport:
    """Read ``source`` (see ``read_foreign``) and save it as step ``step`` (default: the step
    the source recorded) of the experiment at ``dest[/experiment]``, then verify it. Refuses
    to replace an existing step unless ``overwrite``."""
    foreign = read_foreign(source, storage_options=source_storage_options)
    step = foreign.step if step is None else step
    if step is None:
        raise CheckpointError(
            f"{source} records no step (a {foreign.kind} checkpoint): say which with --step N"
        )
    meta = {"imported_from": source, "kind": foreign.kind, "took": foreign.took}
    meta["left"] = foreign.left
    with CheckpointStore(
        dest,
        experiment=experiment,
        format=format,
        storage_options=storage_options,
        distributed=False,
    ) as store:
        if step in store.steps() and not overwrite:
            raise CheckpointError(
                f"{store.url} already has step {step}: pass --overwrite to replace it, or "
                "--step N to import under another step"
            )
        store.save(step, foreign.state, metadata=meta)
        report = store.verify(step)
        if not report.ok:
            raise CorruptCheckpointError(f"the imported checkpoint does not verify: {report}")
        return ImportReport(foreign, store.manifest(step), store.url)

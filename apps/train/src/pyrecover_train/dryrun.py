"""``--dry-run``: one step, one save to a scratch experiment, one verified load and comparison,
then the scratch is removed. Checks a set-up (storage, credentials, format, memory) before a long
queue wait."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import ckptstore
import ddpkit

from .config import TrainConfig
from .state import TrainState, clone_tree, tensors_equal

log = logging.getLogger("pyrecover_train")


def dry_run(
    cfg: TrainConfig,
    dist: ddpkit.Dist,
    state: TrainState,
    *,
    take_step: Callable[[], Any],
    checkpoint: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    """Raises RuntimeError when something does not hold; ``checkpoint()`` gives (state to save,
    metadata) as a real save would."""
    t0 = time.perf_counter()
    take_step()
    step_s = time.perf_counter() - t0
    name = _scratch_name(cfg, dist)
    scratch = ckptstore.CheckpointStore(
        cfg.store_url, format=cfg.format, storage_options=cfg.storage_options, experiment=name
    )
    ok = False
    try:
        t1 = time.perf_counter()
        payload, metadata = checkpoint()
        scratch.save(state.step, payload, metadata=metadata)
        scratch.wait()
        save_s = time.perf_counter() - t1
        report = scratch.verify(state.step)
        if not report.ok:
            raise RuntimeError(f"dry run: the checkpoint does not verify: {report.summary()}")
        live = state.live()
        loaded = _read_back(scratch, state.step, live, sharded=state.sharded)
        diffs = tensors_equal(live, {k: loaded[k] for k in live})
        if diffs:
            raise RuntimeError(
                f"dry run: what was loaded differs from what was saved at {diffs[:5]}"
            )
        ok = True
        dist.barrier()  # every rank has read it back before rank 0 removes it
    finally:
        if not ok or dist.is_main:
            _remove_experiment(scratch, cfg, name)
        else:
            with contextlib.suppress(Exception):
                scratch.close()
    log.info(
        "dry run OK: 1 step %.2f s; save %.2f s (%.1f MB), verified, read back equal "
        "(scratch experiment removed)",
        step_s,
        save_s,
        report.bytes_checked / 1e6,
    )


def _read_back(
    store: ckptstore.CheckpointStore, step: int, live: dict[str, Any], *, sharded: bool
) -> dict[str, Any]:
    """The saved values as they were saved: sharded state is read into copies of the live
    DTensors (each rank reads its own shards, as a resume does), the rest as plain values."""
    if not sharded:
        return store.read(step)[1]
    template = clone_tree(live)
    store.load(template, step)
    return template


def _scratch_name(cfg: TrainConfig, dist: ddpkit.Dist) -> str:
    """A fresh scratch folder of its own (rank 0 names it for all ranks): never one that exists
    already, which may be the user's (an experiment may be called "x.dry-run")."""
    name = dist.all_gather_object(f"{cfg.experiment_name[:100]}.dry-run-{secrets.token_hex(4)}")[0]
    exists = dist.all_gather_object(dist.is_main and _scratch_exists(cfg, name))[0]
    if exists:  # all ranks agree, so none waits for the others
        raise RuntimeError(f"dry run: scratch folder {name} exists already; run it again")
    return str(name)


def _scratch_path(cfg: TrainConfig, name: str) -> tuple[Any, str]:
    """The scratch experiment's folder, where ckptstore lays it out, as an fsspec path."""
    import fsspec

    url = ckptstore.experiment_location(cfg.store_url, name, cfg.storage_options).url
    fs, path = fsspec.core.url_to_fs(url, **(cfg.storage_options or {}))
    return fs, path


def _scratch_exists(cfg: TrainConfig, name: str) -> bool:
    fs, path = _scratch_path(cfg, name)
    return bool(fs.exists(path))


def _remove_experiment(store: ckptstore.CheckpointStore, cfg: TrainConfig, name: str) -> None:
    """Delete the dry run's scratch experiment (only that folder, which the dry run created)."""
    with contextlib.suppress(Exception):
        store.close()
    try:
        fs, path = _scratch_path(cfg, name)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as e:  # leaving a scratch folder behind is not worth failing for
        log.warning("dry run: could not remove the scratch checkpoint folder: %s", e)

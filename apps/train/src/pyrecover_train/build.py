"""Set-up, separated from the loop: from a config and a process group to the parts a run needs.

The store comes first: this run becomes the experiment's one writer before any work, so a second
trainer on the same experiment is refused at once. Then the order matters for the bitwise
guarantee (the RNGs are seeded first, then consumed in the same order by every run): seed ->
precision -> data -> where to start -> model -> optimizer -> schedule -> (resume) -> time budget.
The model is built on the meta device and gets memory once cast and sharded: a fresh start
initialises it, a resume materialises it from the checkpoint (nothing is initialised only to be
overwritten; with FSDP no rank ever holds the whole model). Every problem
found here is a :class:`UsageError`: one line, exit 2, nothing written yet.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ckptstore
import ddpkit
import slurmclock

from . import data as data_mod
from . import resume as resume_mod
from . import state as state_mod
from .config import TrainConfig, UsageError, first_line
from .foreign import ForeignCheckpoint
from .lr_schedule import warmup_cosine
from .metrics import VAL_LOSS
from .model import GPT, ModelConfig, empty_model, materialise, preset_config
from .precision import Precision, PrecisionError, resolve_precision

log = logging.getLogger("pyrecover_train")

ASSUMED_SAVE_BANDWIDTH = 200e6  # bytes/s, for the first save-time estimate (then measured)
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's and its Triton kernels' caches
COMPILE_CACHE = "compile-cache"  # their folder in the experiment's, unless the user set one


@dataclass(slots=True)
class Parts:
    """What set-up builds; the trainer composes them."""

    precision: Precision
    data: data_mod.Data
    model_cfg: ModelConfig
    state: state_mod.TrainState
    train_model: nn.Module  # the model as trained: DDP and/or torch.compile around state.model
    store: ckptstore.CheckpointStore
    start: resume_mod.Start  # where --resume-from-checkpoint starts (checked, not yet loaded)
    new_folders: list[Path] = field(default_factory=list)  # made by the writer lock

    def undo(self) -> None:
        """A refused start: see :func:`undo_start`."""
        undo_start(self.store, self.new_folders)


def check_launcher(cfg: TrainConfig) -> ddpkit.DistInfo:
    try:
        info = ddpkit.detect()
    except ValueError as e:  # DistConfigError: inconsistent launcher variables
        raise UsageError(str(e)) from None
    if cfg.distributed and info.launcher == "single":
        raise UsageError(
            "--distributed needs a launcher: run under `torchrun --nproc-per-node N "
            "pyrecover-train ...`, `srun` or `mpirun` (no torchrun, SLURM step or MPI launcher "
            "variables found)"
        )
    if not cfg.distributed and info.world_size > 1:
        raise UsageError(
            f"launched as {info.world_size} processes by {info.launcher} but --distributed is "
            "not set: add --distributed (each process would otherwise train alone)"
        )
    return info


def join(
    cfg: TrainConfig,
    *,
    abort: Callable[[], bool] | None = None,
    timeout: float | None = None,
) -> ddpkit.Dist:
    """The process group. While waiting for the other ranks, SIGTERM, Ctrl-C or ``abort()``
    end the wait at once with :class:`ddpkit.InitInterrupted`. ``timeout``: seconds a
    collective may take (None: ddpkit's ``PYRECOVER_DIST_TIMEOUT``, else 180 s)."""
    device = None if cfg.device == "auto" else cfg.device
    try:
        return ddpkit.init(distributed=cfg.distributed, device=device, abort=abort, timeout=timeout)
    except ddpkit.DistConfigError as e:  # raised before any network wait: a usage problem
        raise UsageError(f"--device/--distributed: {e}") from None


def _no_phase(part: str) -> None:
    return None


def parts(
    cfg: TrainConfig,
    dist: ddpkit.Dist,
    *,
    phase: Callable[[str], None] = _no_phase,
    limits: ckptstore.CallLimits | None = None,
) -> Parts:
    """Everything but the resume: the store first, then in the order the bitwise guarantee
    needs. ``phase(part)`` is called as each start-up part ends (``Startup.mark``)."""
    check_output_dirs(cfg)
    new = new_folders(cfg) if dist.is_main else []
    try:
        store = open_store(cfg, limits)
    except BaseException:
        undo_start(None, new)
        raise
    phase("store")
    try:
        made = _parts(cfg, dist, store, phase)
    except BaseException:
        undo_start(store, new)
        raise
    made.new_folders = new
    return made


def new_folders(cfg: TrainConfig) -> list[Path]:
    """The local folders of the experiment (and of its mirror) that do not exist yet, deepest
    first: taking the writer lock creates them (and ``--compile`` its cache folder)."""
    cache = cfg.exp_dir / COMPILE_CACHE
    out: list[Path] = [cache] if cfg.compile and not cache.exists() else []
    for url in filter(None, (cfg.store_url, cfg.checkpoint_mirror)):
        local = ckptstore.experiment_location(url, cfg.experiment_name, cfg.storage_options)
        folder = None if local.local_path is None else Path(local.local_path)
        while folder is not None and not folder.exists() and folder != folder.parent:
            out.append(folder)
            folder = folder.parent
    return out


def undo_start(store: ckptstore.CheckpointStore | None, new: list[Path]) -> None:
    """A refused start leaves nothing behind: close the store (releasing the writer lock), then
    remove the folders the lock created, each only if empty (never anything of anyone's)."""
    if store is not None:
        store.close()
    for folder in new:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _parts(
    cfg: TrainConfig,
    dist: ddpkit.Dist,
    store: ckptstore.CheckpointStore,
    phase: Callable[[str], None],
) -> Parts:
    set_determinism(cfg, dist)
    precision = _precision(cfg, dist.device)
    _init_device(dist.device)
    phase("device")
    data = _data(cfg, dist)
    phase("data")
    foreign = ForeignCheckpoint.find(cfg.resume_spec, cfg.storage_options)
    model_cfg = _model_config(cfg, data, foreign)
    tokenizer = data.tokenizer.fingerprint()
    start = resume_mod.plan(cfg, store, model_cfg=model_cfg, tokenizer=tokenizer, foreign=foreign)
    phase("resume")  # what to resume from; the load itself is counted there too
    # On the meta device first: cast, sharded or wrapped before any memory is allocated, then
    # initialised only for a fresh start (a resume's weights come from the checkpoint).
    model = empty_model(model_cfg)
    seed = None if start.loads_weights else cfg.seed
    train_model = _train_model(cfg, model, dist, precision, seed=seed)
    compute = precision.autocast_dtype or DTYPES[cfg.storage_dtype]
    if cfg.parallelism == "fsdp":
        precision = replace(precision, autocast_dtype=None)  # FSDP casts (mixed precision)
    optimizer = _optimizer(cfg, model)  # after sharding: it must see the sharded parameters
    state = state_mod.TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=_scheduler(cfg, optimizer),
        scaler=precision.scaler(dist.device),
        loader=data.train,
    )
    phase("model")
    if cfg.deterministic or dist.device.type != "cpu":
        log.info("attention: %s", _attention(cfg, model_cfg, dist.device, compute))
    return Parts(precision, data, model_cfg, state, train_model, store, start)


def _attention(
    cfg: TrainConfig, model_cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> str:
    """The attention kernel torch runs for this model's shapes, e.g. "flash (deterministic
    backward)": what --deterministic costs or saves is mostly here. With --deterministic on a
    GPU the fast kernels' backward is checked first (twice the same bits, on these shapes);
    where this torch build cannot, the math kernel takes over, and the log says why."""
    q = torch.empty((1, model_cfg.n_heads, cfg.sequence_length, model_cfg.head_dim), dtype=dtype)
    q = q.to(device)
    if cfg.deterministic and device.type == "cuda":
        why = ddpkit.attention_nondeterminism(q)
        if why is not None:
            ddpkit.set_determinism(device, True, attention="math")
            log.warning("--deterministic: fast attention is not deterministic here (%s)", why)
    return ddpkit.attention_kernel(q)


def _init_device(device: torch.device) -> None:
    """The GPU's context now (CUDA makes it at the first allocation), so that its start-up cost
    is measured as its own part rather than inside the model's."""
    if device.type == "cuda":
        torch.zeros((), device=device)
        torch.cuda.synchronize(device)


def check_output_dirs(cfg: TrainConfig) -> None:
    """Local folders the run will write to: a file in the way, or a read-only parent, is a
    usage error now (one line, before any work) rather than a traceback at the first write."""
    if cfg.store_is_local:
        flag = "--checkpoint-url" if cfg.checkpoint_url else "--checkpoint-dir"
        _check_writable_dir(cfg.exp_dir, flag)
    _check_writable_dir(cfg.metrics_path.parent, "--metrics")


def set_determinism(cfg: TrainConfig, dist: ddpkit.Dist) -> ddpkit.Determinism:
    """Seeds, and the kernels' determinism: CPU always (the bitwise-resume guarantee: same
    inputs, same kernels, same bits); CUDA with --deterministic, else fast (TF32 on)."""
    try:
        ddpkit.seed_everything(cfg.seed, dist.rank)
    except ValueError as e:  # seed + rank beyond numpy's 32 bits
        raise UsageError(f"--seed: {e}") from None
    # Before the first CUDA matmul: cuBLAS reads its workspace setting once.
    determinism = ddpkit.set_determinism(dist.device, True if cfg.deterministic else None)
    if cfg.deterministic or dist.device.type != "cpu":
        log.info("%s", determinism.describe())
    return determinism


def _precision(cfg: TrainConfig, device: torch.device) -> Precision:
    try:
        return resolve_precision(cfg.model_dtype, device)
    except PrecisionError as e:
        raise UsageError(str(e)) from None


def _data(cfg: TrainConfig, dist: ddpkit.Dist) -> data_mod.Data:
    # One process per node builds the shared caches; the others then find them ready.
    with _first(dist.info.local_rank == 0, dist):
        source, tokenizer, cache, dataset = data_mod.prepare(cfg)
    train_loader, val_loader = data_mod.loaders(
        cfg, cache, rank=dist.rank, world_size=dist.world_size
    )
    return data_mod.Data(source, tokenizer, cache, train_loader, val_loader, dataset)


def _model_config(
    cfg: TrainConfig, data: data_mod.Data, foreign: ForeignCheckpoint | None
) -> ModelConfig:
    try:
        return preset_config(
            cfg.model_size,
            vocab_size=data.tokenizer.vocab_size,
            max_seq_len=cfg.sequence_length,
            exact_vocab=None if foreign is None else foreign.vocab_size,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}


def _train_model(
    cfg: TrainConfig, model: GPT, dist: ddpkit.Dist, precision: Precision, *, seed: int | None
) -> nn.Module:
    """The model as trained: sharded in place (FSDP2) or wrapped in DDP, then maybe compiled;
    ``model`` (an :func:`empty_model`) stays the bare module, in its storage dtype, that
    checkpoints are made of. It gets memory on the device once cast and sharded (each rank
    only its shards), and weights from ``seed`` (None: a checkpoint fills them)."""
    storage = DTYPES[cfg.storage_dtype]
    train_model: nn.Module
    if cfg.parallelism == "fsdp":
        train_model = _shard(cfg, model, dist, storage, precision.autocast_dtype)
        materialise(model, dist.device, seed=seed)
    else:
        model.to(storage)
        materialise(model, dist.device, seed=seed)
        if cfg.activation_checkpointing:
            ddpkit.checkpoint_activations(model, blocks="layers")
        train_model = ddpkit.wrap_ddp(model, dist)
    if cfg.parallelism == "fsdp" or cfg.param_dtype or cfg.activation_checkpointing:
        log.info("%s", describe_parallelism(cfg, dist.world_size))
    return _compile(train_model, dist.device, cfg.exp_dir) if cfg.compile else train_model


def describe_parallelism(cfg: TrainConfig, world_size: int) -> str:
    """One line: how the model is spread and stored, e.g. for the start of the log."""
    how = (
        "FSDP2 (sharded)" if cfg.parallelism == "fsdp" else "DDP" if world_size > 1 else "1 process"
    )
    parts = [f"weights {cfg.storage_dtype}", f"compute {cfg.model_dtype}"]
    if cfg.parallelism == "fsdp":
        parts.append("gradients reduced in fp32" if cfg.model_dtype == "bf16" else "")
        parts.append("checkpoints sharded (dcp)")
    if cfg.activation_checkpointing:
        parts.append("activation checkpointing")
    return f"parallelism: {how} x{world_size}; " + ", ".join(p for p in parts if p)


def _shard(
    cfg: TrainConfig,
    model: GPT,
    dist: ddpkit.Dist,
    storage: torch.dtype,
    compute: torch.dtype | None,
) -> nn.Module:
    """FSDP2 over every rank, one unit per transformer layer. Mixed precision is FSDP's own:
    parameters are gathered in the compute dtype (half the traffic of fp32) and gradients are
    reduced in fp32, so no autocast runs around the model."""
    half = compute is not None and compute != storage
    low = compute in (torch.bfloat16, torch.float16) or storage == torch.bfloat16
    return ddpkit.shard_model(
        model,
        dist,
        blocks="layers",
        dtype=None if storage == torch.float32 else storage,
        param_dtype=compute if half else None,
        reduce_dtype=torch.float32 if low else None,
        activation_checkpointing=cfg.activation_checkpointing,
    )


def _compile(module: nn.Module, device: torch.device, exp_dir: Path) -> nn.Module:
    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        log.warning("--compile: no C++ compiler found for the CPU backend; running eagerly")
        return module
    cache = compile_cache(exp_dir / COMPILE_CACHE)  # before torch.compile: it reads the place
    try:
        compiled = torch.compile(module)
    except RuntimeError as e:  # e.g. an unsupported Python version
        log.warning("--compile: torch.compile is not available here (%s); running eagerly", e)
        return module
    if cache is not None:
        log.info("--compile: compile cache %s (a requeued allocation compiles warm)", cache)
    return compiled  # type: ignore[return-value]


def compile_cache(folder: Path) -> str | None:
    """Where torch.compile keeps what it compiled (call it before ``torch.compile``, which reads
    and fixes the place): the user's ``TORCHINDUCTOR_CACHE_DIR``, else ``folder``, beside the
    experiment on the file system every allocation sees. torch's default,
    /tmp/torchinductor_USER, is local to a node and often wiped with the job: a requeued
    allocation on another node would compile from scratch (bench/compile_cache.py). None:
    torch's default stays (the folder refuses locks)."""
    if own := os.environ.get(COMPILE_CACHE_ENV):
        return own
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _check_locks(folder)
    except OSError as e:
        log.warning(
            "--compile: cannot keep the compile cache in %s (%s); using torch's node-local default",
            folder,
            e,
        )
        return None
    os.environ[COMPILE_CACHE_ENV] = str(folder)
    return str(folder)


def _check_locks(folder: Path) -> None:
    """inductor locks its cache entries (flock), which some shared file systems refuse."""
    probe = folder / f".lock-probe-{os.getpid()}"
    try:
        with open(probe, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def _optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": decay_params(model, True), "weight_decay": cfg.weight_decay},
        {"params": decay_params(model, False), "weight_decay": 0.0},  # norms: decay only hurts
    ]
    kwargs: dict[str, Any] = {"lr": cfg.learning_rate, "betas": (0.9, 0.95), "eps": 1e-8}
    if cfg.fused_optimizer:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError) as e:
            log.warning("--fused-optimizer: fused AdamW unsupported here (%s); using foreach", e)
    return torch.optim.AdamW(groups, **kwargs)


def decay_params(model: nn.Module, decay: bool) -> list[nn.Parameter]:
    """The parameters of the optimizer's first group (decayed: matrices) or second (norms),
    in the model's order: the order of the optimizer's state indices."""
    return [p for p in model.parameters() if (p.ndim >= 2) == decay]


def _scheduler(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        warmup_cosine(
            warmup=cfg.warmup_steps,
            total=cfg.training_steps,
            min_ratio=cfg.effective_min_lr / cfg.learning_rate,
        ),
    )


def open_store(
    cfg: TrainConfig, limits: ckptstore.CallLimits | None = None
) -> ckptstore.CheckpointStore:
    """The experiment's checkpoint store, with this run as its one writer (every rank calls).
    A dry run only reads the experiment (it saves to a scratch one), so it takes no lock and
    runs beside a training that holds it. Refusals are one line, exit 2: another run writes
    the experiment (LockedError names it), or the location cannot be written (a missing bucket
    says how to create it; nothing is created)."""
    store = _store(cfg)
    if limits is not None:  # the first contact is bounded too, and a stop ends it
        store.set_limits(limits)
    if cfg.dry_run:
        return store
    try:
        store.acquire()
    except Exception as e:
        store.close()
        if isinstance(e, ckptstore.StoreUnreachableError):
            raise  # not a usage error: exit 74, the start is retried once the store is back
        if isinstance(e, ckptstore.StoreConfigError):
            raise UsageError(first_line(e)) from None  # its line says what to fix
        if isinstance(e, (ckptstore.LockedError, ckptstore.MirrorError)):
            raise UsageError(f"{first_line(e)}") from None
        raise UsageError(
            f"cannot write the checkpoint location {cfg.experiment_url}: {first_line(e)}"
        ) from None
    return store


def _store(cfg: TrainConfig) -> ckptstore.CheckpointStore:
    try:
        return ckptstore.CheckpointStore(
            cfg.store_url,
            format=cfg.format,
            keep_last=cfg.keep_last,
            keep_every=cfg.keep_every,
            keep_best=cfg.keep_best,
            best_metric=VAL_LOSS,
            best_mode="min",
            mirror=cfg.checkpoint_mirror,
            storage_options=cfg.storage_options,
            mirror_storage_options=cfg.storage_options,
            experiment=cfg.experiment_name,
            lock=not cfg.dry_run,
        )
    except (ValueError, ImportError) as e:
        raise UsageError(f"--checkpoint-dir/--checkpoint-url: {e}") from None


def budget(
    cfg: TrainConfig,
    model: nn.Module,
    stop_flag: slurmclock.StopFlag,
    *,
    resumed: Mapping[str, Any] | None = None,
) -> slurmclock.TimeBudget:
    """The time budget as the shipped defaults set it up: SLURM's deadline (or --time-limit),
    the stop margin measured (the exit and requeue of earlier allocations from the job's
    timeline, + slurmclock's slack) unless --stop-margin fixes it, SLURM's warning signal read as
    information (its lead from PYRECOVER_SIGNAL_LEAD, which the sbatch script exports), and the
    figures the resumed checkpoint measured (``resumed``: its metadata)."""
    try:
        watcher = slurmclock.DeadlineWatcher(time_limit=cfg.time_limit)
    except ValueError as e:
        raise UsageError(f"--time-limit: {e}") from None
    try:
        clock = slurmclock.TimeBudget(
            watcher,
            signals=stop_flag,
            timeline=slurmclock.JobTimeline(),  # outside a SLURM job: reads and writes nothing
            margin=cfg.stop_margin,
            initial_step_estimate=cfg.default_iter_time or 0.0,
            initial_save_estimate=first_save_estimate(cfg, model),
            warmup_steps=2 + (1 if cfg.compile else 0),
        )
    except ValueError as e:
        raise UsageError(f"--stop-margin/--default-iter-time/--default-ckpt-time: {e}") from None
    try:
        clock.load_state_dict((resumed or {}).get("time_budget") or {})
    except ValueError as e:  # measurements, not state: a bad entry costs first guesses only
        log.warning("the checkpoint's time budget figures are not used: %s", e)
    return clock


def async_saves(cfg: TrainConfig, device: torch.device) -> bool:
    """Periodic saves in the background? As --async-checkpoint/--no-async-checkpoint say, else
    (auto) on with CUDA: the snapshot is a copy to pinned host memory (0.03-0.4 s for a 1.5B
    model's 18 GB on an H100, where a blocking save takes 16 s; each rank its own shard with
    FSDP), and the writer thread does not compete with the GPU. Off on CPU, where it would
    compete with training for the cores."""
    if cfg.async_checkpoint is not None:
        return cfg.async_checkpoint
    return device.type == "cuda"


def first_save_estimate(cfg: TrainConfig, model: nn.Module) -> float:
    """The budget's guess of a save until one is measured: the original's --default-ckpt-time
    when given, else from the state size (weights + two Adam moments)."""
    if cfg.default_ckpt_time is not None:
        return cfg.default_ckpt_time
    state_bytes = state_mod.count_bytes(model.state_dict()) * 3
    return 1.0 + state_bytes / ASSUMED_SAVE_BANDWIDTH


@contextlib.contextmanager
def _first(leader: bool, dist: ddpkit.Dist) -> Iterator[None]:
    """The leader runs the body first, then the others (e.g. building a shared cache once)."""
    if not leader:
        dist.barrier()
    try:
        yield
    finally:
        if leader:
            dist.barrier()


def _check_writable_dir(path: Path, flag: str) -> None:
    """``path`` is, or can be created as, a folder this process can write into."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            return
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {existing} is not writable by this user")

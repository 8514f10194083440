"""Where a run starts: from step 0, from one of its checkpoints, or from another tool's
checkpoint (:mod:`.foreign`). Everything that can go wrong is found before anything is written,
and said in one line; what a resume with other flags than the checkpoint's does to the schedule
is said too."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ckptstore
import ddpkit

from .config import TrainConfig, UsageError, first_line
from .foreign import ForeignCheckpoint
from .lr_schedule import warmup_cosine
from .model import ModelConfig
from .state import TrainState

log = logging.getLogger("pyrecover_train")


@dataclass(frozen=True, slots=True)
class Start:
    """Where a run starts, known before its model is built (:func:`plan`): step 0 (fresh
    weights), one of the experiment's checkpoints (``which``, its ``metadata`` read: the model
    is materialised from it, never initialised first), or another tool's (``foreign``)."""

    which: int | str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    foreign: ForeignCheckpoint | None = None

    @property
    def loads_weights(self) -> bool:
        """Does a checkpoint of this experiment fill every weight (so none is initialised)?"""
        return self.which is not None


def plan(
    cfg: TrainConfig,
    store: ckptstore.CheckpointStore,
    *,
    model_cfg: ModelConfig,
    tokenizer: str,
    foreign: ForeignCheckpoint | None,
) -> Start:
    """Where ``--resume-from-checkpoint`` starts, or one line (UsageError) saying why not --
    before anything is built or written. ``latest`` is the newest commit on the primary or the
    mirror (ckptstore's)."""
    target = cfg.resume_spec
    if foreign is not None:
        _check_foreign(cfg, store, foreign)
        return Start(foreign=foreign)
    if target is not None and not target.latest:  # a step or a folder, named
        _latest_step(cfg, store, newer_ok=True)  # the location answers (credentials, bucket)
        which: int | str = _resolve(target)
    else:
        latest = _latest_step(cfg, store)
        if target is None:
            if latest is not None and not cfg.dry_run:  # a dry run saves to a scratch folder
                raise UsageError(
                    f"{_where_latest(cfg, store)} already holds checkpoints (latest step "
                    f"{latest}): pass --resume-from-checkpoint latest to continue, or pick "
                    "another --experiment_name / --checkpoint-dir (nothing was changed)"
                )
            return Start()
        if latest is None:
            log.info("--resume-from-checkpoint latest: no checkpoint yet, starting at step 0")
            return Start()
        which = "latest"
        _explain_pointer(store)
    meta = _peek(store, which)
    _check_not_imported(store, which, meta)
    _check_compatible(meta, model_cfg, tokenizer)
    return Start(which=which, metadata=meta)


def _explain_pointer(store: ckptstore.CheckpointStore) -> None:
    """One line when `latest` names a step folder that is gone (removed by hand): ckptstore
    falls back to the newest committed checkpoint; say which, and that the next save mends it."""
    try:
        scan = store.scan()
    except Exception:  # only for the message: the load says what is wrong
        return
    known = {*scan.checkpoints, *scan.broken, *scan.incomplete, *scan.newer}
    if scan.pointer_problem and scan.pointer not in known and scan.head is not None:
        log.info(
            "%s/latest names step %s, whose folder is gone: resuming from step %d, the newest "
            "committed checkpoint (this run's next save rewrites latest)",
            scan.url.rstrip("/"),
            scan.pointer,
            scan.head,
        )


def _check_not_imported(
    store: ckptstore.CheckpointStore, which: int | str, meta: dict[str, Any]
) -> None:
    """A checkpoint `ckptstore import` wrote (weights, perhaps an optimizer) is no checkpoint
    of a run: a resume from it would miss the run's state. Say how to start from it instead."""
    source = meta.get("imported_from")
    if source is None or "args" in meta:  # the app's own import-checkpoint records its args
        return
    took = meta.get("took")
    holds = ", ".join(map(str, took)) if isinstance(took, dict) and took else "another tool's state"
    run = [s for s, m in store.scan().checkpoints.items() if "imported_from" not in m.metadata]
    own = f", or resume the run from its own newest step: --resume-from-checkpoint {max(run)}"
    own = own if run else ""
    raise UsageError(
        f"--resume-from-checkpoint {which}: that checkpoint was imported with `ckptstore import` "
        f"from {str(source)[:200]!r} and holds {holds} only, not the optimizer, LR schedule, data "
        "position and RNG states a resume loads: start a new run from its weights with "
        f"`pyrecover-train --resume-from-checkpoint {str(source)[:200]} --experiment-name NEW` "
        f"(the rest starts fresh){own} (nothing was changed)"
    )


def _check_foreign(
    cfg: TrainConfig, store: ckptstore.CheckpointStore, foreign: ForeignCheckpoint
) -> None:
    """Another tool's checkpoint starts a new experiment (a run's own steps would mix with
    the checkpoints already there)."""
    if cfg.parallelism == "fsdp":
        raise UsageError(
            f"--resume-from-checkpoint {foreign.source}: another tool's checkpoint is "
            "imported with --parallelism ddp (its weights and optimizer are whole tensors): "
            "drop --parallelism fsdp"
        )
    latest = _latest_step(cfg, store)
    if latest is not None:
        raise UsageError(
            f"{_where_latest(cfg, store)} already holds checkpoints (latest step {latest}): "
            f"start from {foreign.source} in a new --experiment_name, or continue this one "
            "with --resume-from-checkpoint latest (nothing was changed)"
        )


def _latest_step(
    cfg: TrainConfig, store: ckptstore.CheckpointStore, *, newer_ok: bool = False
) -> int | None:
    """The newest step; ``newer_ok``: None when a newer ckptstore wrote it (a step named
    by the user is loaded without it, as ckptstore's refusal of "latest" suggests)."""
    try:
        return store.latest_step()
    except ckptstore.IncompatibleCheckpointError as e:  # its line says it all
        if newer_ok:
            return None
        raise UsageError(first_line(e)) from None
    except ckptstore.StoreUnreachableError:
        raise  # not a usage error: exit 74, the start is retried once the store is back
    except ckptstore.CheckpointError as e:
        raise UsageError(
            f"cannot read the checkpoint location {cfg.experiment_url}: {first_line(e)}"
        ) from None
    except Exception as e:  # no credentials, no bucket, no permission: fix and retry
        raise UsageError(
            f"cannot read the checkpoint location {cfg.experiment_url}: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from None


def _where_latest(cfg: TrainConfig, store: ckptstore.CheckpointStore) -> str:
    """The folder of the newest checkpoint: the experiment's, or its mirror's."""
    try:
        return store.manifest("latest").url.rsplit("/", 1)[0]
    except Exception:  # only for the message
        return cfg.experiment_url


def _peek(store: ckptstore.CheckpointStore, which: int | str) -> dict[str, Any]:
    """The checkpoint's metadata, read before anything is built or loaded."""
    try:
        return dict(store.manifest(which).metadata)
    except ckptstore.StoreUnreachableError:
        raise  # not a usage error: exit 74, the start is retried once the store is back
    except ckptstore.CheckpointError as e:
        raise UsageError(f"--resume-from-checkpoint: {first_line(e)}") from None
    except FileNotFoundError:
        raise UsageError(
            f"--resume-from-checkpoint {which}: no manifest.json there (not a committed checkpoint)"
        ) from None


def _check_compatible(meta: dict[str, Any], model_cfg: ModelConfig, tokenizer: str) -> None:
    saved = meta.get("model")
    if isinstance(saved, dict):
        diffs = model_cfg.differences(saved)
        if diffs:
            raise UsageError(
                "the checkpoint is of another model shape ("
                + "; ".join(diffs)
                + "): resume with the same --model-size/--tokenizer or start a new "
                "--experiment_name"
            )
    saved_tokenizer = meta.get("tokenizer")
    if saved_tokenizer and saved_tokenizer != tokenizer:
        raise UsageError(
            "the checkpoint was trained with another tokenizer: pass the same --tokenizer "
            "and --dataset as the run that wrote it"
        )


class Resume:
    """Restores ``state`` from where :func:`plan` said to start; ``run()`` says from where."""

    def __init__(
        self,
        cfg: TrainConfig,
        store: ckptstore.CheckpointStore,
        state: TrainState,
        dist: ddpkit.Dist,
    ) -> None:
        self.cfg, self.store, self.state, self.dist = cfg, store, state, dist
        self.metadata: dict[str, Any] = {}  # of the checkpoint resumed from (e.g. time_budget)

    def run(self, start: Start) -> str | None:
        """Load what ``start`` names; returns what it resumed from, None for step 0."""
        if start.foreign is not None:
            return self._start_from(start.foreign)
        if start.which is None:
            return None
        return self._load(start.which, start.metadata)

    def _start_from(self, foreign: ForeignCheckpoint) -> str:
        foreign.apply(self.state, self.cfg.model_size)  # logs its one line: the RNGs too
        ddpkit.reseed_rng(self.cfg.seed, self.state.step, self.dist.rank, self.dist.device)
        reapply_flags(self.state, self.cfg)
        return f"step {self.state.step} ({foreign.label})"

    def _load(self, which: int | str, meta: dict[str, Any]) -> str:
        args = meta.get("args")
        old_args: dict[str, Any] = args if isinstance(args, dict) else {}
        changes = schedule_changes(
            old_args, self.cfg, meta.get("world_size"), self.dist.world_size, meta.get("step")
        )
        template = self.state.template(
            with_scaler=old_args.get("model_dtype", "fp16") == "fp16",
            saved_as=old_args.get("parallelism", "ddp"),
        )
        try:
            # Restores model, optimizer, scheduler, scaler and loader in place; "rng" and
            # "step" come back as values.
            manifest = self.store.load(template, which)
        except ckptstore.StoreUnreachableError:
            raise  # not a usage error: exit 74, the start is retried once the store is back
        except ckptstore.IncompatibleCheckpointError as e:
            raise UsageError(_incompatible(e, which, self.store.url)) from None
        except ckptstore.CheckpointError as e:
            raise UsageError(f"--resume-from-checkpoint: {first_line(e)}") from None
        self.state.step = int(template["step"])
        self.metadata = dict(manifest.metadata)  # the one loaded (a fallback's, if it fell back)
        self._restore_rng(template["rng"], manifest.world_size)
        for line in changes:
            log.info("%s", line)
        reapply_flags(self.state, self.cfg)
        return f"step {self.state.step} ({manifest.url or which})"

    def _restore_rng(self, saved: dict[str, Any], saved_world: int) -> None:
        """Each rank's own RNG states back (same world size: bitwise), else re-seeded."""
        got = ddpkit.restore_rng(saved, self.dist, seed=self.cfg.seed, step=self.state.step)
        if got.how == "reseeded":
            now = self.dist.world_size
            why = f"world size changed ({saved_world} in the checkpoint, {now} now)"
            self._log_reseed(why, got.seed)

    def _log_reseed(self, why: str, seed: int | None) -> None:
        cfg, step, rank = self.cfg, self.state.step, self.dist.rank
        log.info(
            "%s: RNGs re-seeded from (seed %d, step %d, rank %d) -> %d; data continues at "
            "global position %d",
            why,
            cfg.seed,
            step,
            rank,
            seed,
            self.state.loader.position,
        )


def _incompatible(e: Exception, which: int | str, url: str) -> str:
    """ckptstore's "has no [...]; pass strict=False" is for its Python callers; on the command
    line, say what is missing and the commands that start a run from the weights it has."""
    line = first_line(e)
    if "pass strict=False" not in line:
        return f"--resume-from-checkpoint: {line}"
    missing = line.split("; pass strict=False", 1)[0]
    named = isinstance(which, str) and which != "latest"  # a checkpoint folder
    export = f"{which}" if named else f"{url} --step {which}"
    return (
        f"--resume-from-checkpoint: {missing}: not a checkpoint of this trainer's run, so it "
        f"cannot be resumed; start a new run from its weights: `ckptstore export {export} "
        "--key model --out weights.safetensors`, then `pyrecover-train "
        "--resume-from-checkpoint weights.safetensors --experiment-name NEW` (the optimizer, "
        "data position and RNGs start fresh)"
    )


def _resolve(target: ckptstore.StepSpec) -> int | str:
    """What ``store.load`` takes: "latest", a step, or a checkpoint folder that exists."""
    if target.step is not None:
        return target.step
    if target.path is None:
        return "latest"
    if "://" not in target.path and not Path(target.path).expanduser().exists():
        raise UsageError(
            f"--resume-from-checkpoint {target.path}: no such checkpoint (give 'latest', a step "
            "number, or an existing checkpoint directory)"
        )
    return target.path


def reapply_flags(state: TrainState, cfg: TrainConfig) -> None:
    """The optimizer and schedule come back with the checkpoint's learning rate and weight
    decay; this run's flags win (e.g. a lower --learning-rate after a divergence). With the
    same flags the values are the same floats, so a resume stays bitwise exact."""
    sched = state.scheduler
    old = list(sched.base_lrs)
    sched.base_lrs = [cfg.learning_rate for _ in old]
    factor = sched.lr_lambdas[0](sched.last_epoch)
    for group, decay in zip(state.optimizer.param_groups, (cfg.weight_decay, 0.0), strict=True):
        group["lr"] = cfg.learning_rate * factor  # what LambdaLR.step() computes
        group["weight_decay"] = decay
    sched._last_lr = [g["lr"] for g in state.optimizer.param_groups]
    if old != sched.base_lrs:
        log.info("--learning-rate %g replaces the checkpoint's %g", cfg.learning_rate, old[0])


def schedule_changes(
    old: dict[str, Any], cfg: TrainConfig, old_world: int | None, world: int, step: Any = None
) -> list[str]:
    """One line per flag that differs from the checkpoint's and changes the schedule: what
    changed and what that does (tokens per step, the data position, the LR schedule, the
    arithmetic). Refuses (UsageError) only what cannot work."""
    if not old:
        return []
    for name in ("sequence_length", "seed"):
        if name in old and old[name] != getattr(cfg, name):
            raise UsageError(
                f"--{name.replace('_', '-')} {getattr(cfg, name)} differs from the checkpoint's "
                f"{old[name]}: its data position counts windows of that order; resume with "
                f"--{name.replace('_', '-')} {old[name]} or start a new --experiment_name"
            )
    at = step if isinstance(step, int) else 0
    lines = [*_tokens_change(old, cfg, old_world, world), *_lr_change(old, cfg, at)]
    return lines + _dtype(old, cfg) + _storage(old, cfg) + _parallelism(old, cfg)


def _differs(old: dict[str, Any], cfg: TrainConfig, *names: str) -> list[str]:
    return [n for n in names if n in old and old[n] != getattr(cfg, n)]


def _tokens_change(
    old: dict[str, Any], cfg: TrainConfig, old_world: int | None, world: int
) -> list[str]:
    changed = _differs(old, cfg, "batch_size", "grad_accum")
    if not changed and old_world in (None, world):
        return []
    before = old.get("batch_size", cfg.batch_size) * old.get("grad_accum", cfg.grad_accum)
    before *= old.get("sequence_length", cfg.sequence_length) * (old_world or world)
    after = cfg.tokens_per_step * world
    what = ", ".join(f"--{n.replace('_', '-')} {old[n]} -> {getattr(cfg, n)}" for n in changed)
    if old_world not in (None, world):
        what = ", ".join(filter(None, [what, f"world size {old_world} -> {world}"]))
    return [
        f"resume with {what}: tokens per step {before:,} -> {after:,} (x{after / before:.3g}); "
        "the data goes on from the checkpoint's global position, "
        f"{cfg.batch_size * cfg.grad_accum * world} windows per step from now on"
    ]


def _lr_change(old: dict[str, Any], cfg: TrainConfig, step: int) -> list[str]:
    changed = _differs(old, cfg, "training_steps", "warmup_steps", "min_lr")
    if not changed:
        return []
    what = ", ".join(f"--{n.replace('_', '-')} {old[n]} -> {getattr(cfg, n)}" for n in changed)
    lr = old.get("learning_rate", cfg.learning_rate)
    old_min = old.get("min_lr")
    before = warmup_cosine(
        warmup=old.get("warmup_steps", cfg.warmup_steps),
        total=old.get("training_steps", cfg.training_steps),
        min_ratio=(lr * 0.1 if old_min is None else old_min) / lr,
    )
    after = warmup_cosine(
        warmup=cfg.warmup_steps,
        total=cfg.training_steps,
        min_ratio=cfg.effective_min_lr / cfg.learning_rate,
    )
    now, was = cfg.learning_rate * after(step), lr * before(step)
    end = old.get("training_steps")
    if isinstance(end, int) and step >= end and cfg.training_steps > step:
        return [_extended(what, step, end, cfg, now=now, was=was)]
    rate = (
        f"{now:.3g} instead of {was:.3g}"
        if f"{now:.3g}" != f"{was:.3g}"
        else f"{now:.3g} as before"
    )
    return [
        f"resume with {what}: the LR schedule now warms up for {cfg.warmup_steps} steps and "
        f"decays to --min-lr {cfg.effective_min_lr:g} at step {cfg.training_steps} (was step "
        f"{old.get('training_steps', '?')}); at the resumed step {step} the learning rate is "
        f"{rate}, and {max(cfg.training_steps - step, 0)} steps are left"
    ]


def _extended(what: str, step: int, end: int, cfg: TrainConfig, *, now: float, was: float) -> str:
    """A finished run trained further: its cosine decay is stretched to the new end, so the
    learning rate jumps from where it ended (a new decay); say so, and the way out."""
    return (
        f"resume with {what}: extends a finished run (step {step} of {end}): the cosine decay "
        f"is stretched to end at step {cfg.training_steps}, so the learning rate goes from "
        f"{was:.3g} (where it ended) to {now:.3g} at step {step} and decays to --min-lr "
        f"{cfg.effective_min_lr:g} again; to go on at {was:.3g} instead, pass --learning-rate "
        f"{was:.3g} --min-lr {was:.3g}"
    )


def _dtype(old: dict[str, Any], cfg: TrainConfig) -> list[str]:
    if not _differs(old, cfg, "model_dtype"):
        return []
    was, now = old["model_dtype"], cfg.model_dtype
    effects = {
        "fp64": "weights and optimizer state are converted to fp64",
        "fp32": "plain fp32 arithmetic, no autocast",
        "bf16": "weights and optimizer state stay fp32; the matmuls run under bf16 autocast",
        "fp16": "weights and optimizer state stay fp32; the matmuls run under fp16 autocast",
    }
    if cfg.storage_dtype == "bf16":
        effects["bf16"] = "the model computes in bf16 (and stores its weights in bf16: below)"
    scaler = ""
    if now == "fp16":
        scaler = "; a new GradScaler starts at its initial scale"
    elif was == "fp16":
        scaler = "; the checkpoint's GradScaler state is not needed and dropped"
    return [
        f"resume with --model-dtype {was} -> {now}: {effects[now]}{scaler} (the numbers are no "
        "longer bitwise those of a run that kept one dtype)"
    ]


def _storage(old: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """A new --param-dtype: the checkpoint's weights and AdamW moments are cast on load."""
    if "model_dtype" not in old:
        return []  # a checkpoint of before --param-dtype: stored in fp32 (fp64)
    was = old.get("param_dtype") or ("fp64" if old["model_dtype"] == "fp64" else "fp32")
    if was == cfg.storage_dtype:
        return []
    return [
        f"resume with --param-dtype {was} -> {cfg.storage_dtype}: the weights and AdamW moments "
        f"are cast to {cfg.storage_dtype} as they load (the numbers are no longer bitwise those "
        "of a run that kept one dtype)"
    ]


def _parallelism(old: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """A DDP checkpoint resumed with FSDP, or the other way (:meth:`TrainState.template`)."""
    was = old.get("parallelism", "ddp")
    if was == cfg.parallelism:
        return []
    how = "each rank keeps its shard of them" if cfg.parallelism == "fsdp" else "whole"
    return [
        f"resume with --parallelism {was} -> {cfg.parallelism}: the weights and AdamW moments "
        f"load as saved ({how}), the data position exactly; the steps from here are "
        f"{cfg.parallelism.upper()}'s arithmetic (other reduction orders: not bitwise those of "
        "a run that kept one --parallelism)"
    ]

"""Where a run starts: from step 0, from one of its checkpoints, or from another tool's
checkpoint (:mod:`.foreign`). Everything that can go wrong is found before anything is written,
and said in one line; what a resume with other flags than the checkpoint's does to the schedule
is said too."""

from __future__ import annotations

import logging
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


class Resume:
    """Restores ``state`` as ``--resume-from-checkpoint`` asks; ``run()`` says from where."""

    def __init__(
        self,
        cfg: TrainConfig,
        store: ckptstore.CheckpointStore,
        state: TrainState,
        dist: ddpkit.Dist,
        *,
        model_cfg: ModelConfig,
        tokenizer: str,
    ) -> None:
        self.cfg, self.store, self.state, self.dist = cfg, store, state, dist
        self.model_cfg, self.tokenizer = model_cfg, tokenizer
        self.metadata: dict[str, Any] = {}  # of the checkpoint resumed from (e.g. time_budget)

    def run(self, foreign: ForeignCheckpoint | None) -> str | None:
        """Resume (or refuse to clobber); returns what it resumed from, None for step 0.
        ``latest`` is the newest commit on the primary or the mirror (ckptstore's)."""
        target = self.cfg.resume_spec
        if foreign is not None:
            return self._start_from(foreign)
        if target is not None and not target.latest:  # a step or a folder, named
            self._latest_step(newer_ok=True)  # the location answers (credentials, bucket)
            return self._load(_resolve(target))
        latest = self._latest_step()
        if target is None:
            if latest is not None:
                raise UsageError(
                    f"{self._where_latest()} already holds checkpoints (latest step {latest}): "
                    "pass --resume-from-checkpoint latest to continue, or pick another "
                    "--experiment_name / --checkpoint-dir (nothing was changed)"
                )
            return None
        if latest is None:
            log.info("--resume-from-checkpoint latest: no checkpoint yet, starting at step 0")
            return None
        return self._load("latest")

    def _start_from(self, foreign: ForeignCheckpoint) -> str:
        """Another tool's checkpoint, into a new experiment (a run's own steps would mix with
        the checkpoints already there)."""
        if self.state.sharded:
            raise UsageError(
                f"--resume-from-checkpoint {foreign.source}: another tool's checkpoint is "
                "imported with --parallelism ddp (its weights and optimizer are whole tensors): "
                "drop --parallelism fsdp"
            )
        latest = self._latest_step()
        if latest is not None:
            raise UsageError(
                f"{self._where_latest()} already holds checkpoints (latest step {latest}): "
                f"start from {foreign.source} in a new --experiment_name, or continue this one "
                "with --resume-from-checkpoint latest (nothing was changed)"
            )
        foreign.apply(self.state, self.cfg.model_size)  # logs its one line: the RNGs too
        ddpkit.reseed_rng(self.cfg.seed, self.state.step, self.dist.rank, self.dist.device)
        reapply_flags(self.state, self.cfg)
        return f"step {self.state.step} ({foreign.label})"

    def _latest_step(self, *, newer_ok: bool = False) -> int | None:
        """The newest step; ``newer_ok``: None when a newer ckptstore wrote it (a step named
        by the user is loaded without it, as ckptstore's refusal of "latest" suggests)."""
        try:
            return self.store.latest_step()
        except ckptstore.IncompatibleCheckpointError as e:  # its line says it all
            if newer_ok:
                return None
            raise UsageError(first_line(e)) from None
        except ckptstore.StoreUnreachableError:
            raise  # not a usage error: exit 74, the start is retried once the store is back
        except ckptstore.CheckpointError as e:
            raise UsageError(
                f"cannot read the checkpoint location {self.cfg.experiment_url}: {first_line(e)}"
            ) from None
        except Exception as e:  # no credentials, no bucket, no permission: fix and retry
            raise UsageError(
                f"cannot read the checkpoint location {self.cfg.experiment_url}: "
                f"{type(e).__name__}: {first_line(e)}"
            ) from None

    def _where_latest(self) -> str:
        """The folder of the newest checkpoint: the experiment's, or its mirror's."""
        try:
            return self.store.manifest("latest").url.rsplit("/", 1)[0]
        except Exception:  # only for the message
            return self.cfg.experiment_url

    def _load(self, which: int | str) -> str:
        meta = self._peek(which)
        self._check_compatible(meta)
        args = meta.get("args")
        old_args: dict[str, Any] = args if isinstance(args, dict) else {}
        changes = schedule_changes(
            old_args, self.cfg, meta.get("world_size"), self.dist.world_size, meta.get("step")
        )
        template = self.state.template(with_scaler=old_args.get("model_dtype", "fp16") == "fp16")
        try:
            # Restores model, optimizer, scheduler, scaler and loader in place; "rng" and
            # "step" come back as values.
            manifest = self.store.load(template, which)
        except ckptstore.StoreUnreachableError:
            raise
        except ckptstore.CheckpointError as e:
            raise UsageError(f"--resume-from-checkpoint: {first_line(e)}") from None
        self.state.step = int(template["step"])
        self.metadata = dict(manifest.metadata)  # the one loaded (a fallback's, if it fell back)
        self._restore_rng(template["rng"], manifest.world_size)
        for line in changes:
            log.info("%s", line)
        reapply_flags(self.state, self.cfg)
        return f"step {self.state.step} ({manifest.url or which})"

    def _peek(self, which: int | str) -> dict[str, Any]:
        """The checkpoint's metadata, read before anything is loaded."""
        try:
            return dict(self.store.manifest(which).metadata)
        except ckptstore.StoreUnreachableError:
            raise
        except ckptstore.CheckpointError as e:
            raise UsageError(f"--resume-from-checkpoint: {first_line(e)}") from None
        except FileNotFoundError:
            raise UsageError(
                f"--resume-from-checkpoint {which}: no manifest.json there (not a committed "
                "checkpoint)"
            ) from None

    def _check_compatible(self, meta: dict[str, Any]) -> None:
        saved = meta.get("model")
        if isinstance(saved, dict):
            diffs = self.model_cfg.differences(saved)
            if diffs:
                raise UsageError(
                    "the checkpoint is of another model shape ("
                    + "; ".join(diffs)
                    + "): resume with the same --model-size/--tokenizer or start a new "
                    "--experiment_name"
                )
        args = meta.get("args")
        was = args.get("parallelism", "ddp") if isinstance(args, dict) else "ddp"
        if was != self.cfg.parallelism:
            raise UsageError(
                f"the checkpoint was written with --parallelism {was} (its optimizer state is "
                f"laid out for it): resume with --parallelism {was}, or start a new "
                "--experiment_name"
            )
        tokenizer = meta.get("tokenizer")
        if tokenizer and tokenizer != self.tokenizer:
            raise UsageError(
                "the checkpoint was trained with another tokenizer: pass the same --tokenizer "
                "and --dataset as the run that wrote it"
            )

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
    return lines + _dtype(old, cfg) + _storage(old, cfg)


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
    return [
        f"resume with {what}: the LR schedule now warms up for {cfg.warmup_steps} steps and "
        f"decays to --min-lr {cfg.effective_min_lr:g} at step {cfg.training_steps} (was step "
        f"{old.get('training_steps', '?')}); at the resumed step {step} the learning rate is "
        f"{cfg.learning_rate * after(step):.3g} instead of {lr * before(step):.3g}, and "
        f"{max(cfg.training_steps - step, 0)} steps are left"
    ]


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

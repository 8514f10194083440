"""A validated :class:`TrainConfig`, and the command line generated from one table of flags.

Every flag of the original PyRecover is accepted verbatim with its meaning, in both the dash and
the underscore spelling (``--sequence-length`` and ``--sequence_length``); help shows the dash
spelling. Flags whose best value depends on the model size (sequence length, batch size, learning
rate, steps, dtype, ...) default to the ``--model-size`` preset's value unless given; the presets
of the original's model sizes (``125m`` and up) use the original's defaults (sequence 2048, batch
1, lr 1e-5, 1000 steps, bf16). Defaults are written once: in :class:`TrainConfig` or, for the
preset-dependent ones, in :data:`PRESET_DEFAULTS`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import ckptstore
import parquetlm
from slurmclock import parse_human_duration, parse_time_limit

from .model import PRESETS

DTYPES = ("fp16", "bf16", "fp32", "fp64")
DEVICES = ("auto", "cpu", "cuda")
PARALLELISMS = ("ddp", "fsdp")
PARAM_DTYPES = ("fp32", "bf16")
MAX_INT = 2**63 - 1  # every count is stored as int64 (metrics, tensors, checkpoints)
MAX_SEED = 2**32 - 1  # numpy's legacy generator takes 32-bit seeds

# Defaults that depend on the model size. tiny/small are CPU-friendly (a no-argument run trains in
# about a minute on 2 cores); the larger presets take the original PyRecover's defaults.
_ORIGINAL: dict[str, Any] = {
    "sequence_length": 2048,
    "batch_size": 1,
    "learning_rate": 1e-5,
    "training_steps": 1000,
    "model_dtype": "bf16",
    "tokenizer": "bpe:8192",
    "warmup_steps": 100,
    "eval_every": 0,
}
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {
        "sequence_length": 128,
        "batch_size": 8,
        "learning_rate": 3e-3,
        "training_steps": 400,
        "model_dtype": "fp32",
        "tokenizer": "bpe:4096",
        "warmup_steps": 40,
        "eval_every": 100,
    },
    "small": {
        "sequence_length": 256,
        "batch_size": 16,
        "learning_rate": 1e-3,
        "training_steps": 2000,
        "model_dtype": "fp32",
        "tokenizer": "bpe:4096",
        "warmup_steps": 100,
        "eval_every": 200,
    },
    **{name: dict(_ORIGINAL) for name in ("125m", "350m", "1b", "8b")},
}
assert set(PRESET_DEFAULTS) == set(PRESETS)
_TINY = PRESET_DEFAULTS["tiny"]

DEFAULT_MTBF = 6 * 3600.0
DEFAULT_VAL_FRACTION = 0.02


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit status 2, nothing touched on disk."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; validated on creation (messages say how to fix)."""

    # The original PyRecover's flags.
    dataset: str | None = None
    sequence_length: int = _TINY["sequence_length"]
    batch_size: int = _TINY["batch_size"]
    learning_rate: float = _TINY["learning_rate"]
    training_steps: int = _TINY["training_steps"]
    distributed: bool = False
    model_dtype: str = _TINY["model_dtype"]
    checkpoint_dir: str = "checkpoints/"
    checkpoint_frequency: int = 10
    resume_from_checkpoint: str | None = None
    experiment_name: str = "default-exp"
    use_torch_distributed_ckpt: bool = False
    compile: bool = False
    fused_optimizer: bool = False
    # The original's other flags that have a meaning of their own here.
    timeaware_checkpointing: bool = False  # always on here; accepted, and said so
    verify_checkpoints: bool = False  # always on here (checksums in every manifest)
    use_flash_attention: bool = False  # SDPA picks FlashAttention kernels by itself
    default_iter_time: float | None = None
    default_ckpt_time: float | None = None
    log_loss_to_csv: bool = False
    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    # Checkpointing.
    checkpoint_url: str | None = None
    checkpoint_mirror: str | None = None
    async_checkpoint: bool | None = None  # None: auto (see ASYNC_SHOWN)
    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    checkpoint_interval_seconds: float | str | None = None  # seconds or "auto"
    storage_options: dict[str, Any] | None = None  # fsspec options for the checkpoint URLs
    mtbf: float = DEFAULT_MTBF
    # Time.
    time_limit: float | None = None
    stop_margin: float | None = None
    extra_saves: bool = True
    # Model, data, optimisation.
    model_size: str = "tiny"
    tokenizer: str = _TINY["tokenizer"]
    text_column: str = "text"
    cache_dir: str | None = None
    seed: int = 42
    grad_accum: int = 1
    warmup_steps: int = _TINY["warmup_steps"]
    min_lr: float | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "auto"
    # Parallelism, memory and reproducibility.
    parallelism: str = "ddp"
    param_dtype: str | None = None  # None: fp32 (fp64 with --model-dtype fp64)
    activation_checkpointing: bool = False
    deterministic: bool = False
    # Observability and evaluation.
    log_every: int = 10
    metrics: str | None = None
    wandb: bool = False
    eval_every: int = _TINY["eval_every"]
    eval_batches: int = 8
    val_fraction: float = DEFAULT_VAL_FRACTION
    peak_tflops: float | None = None
    dry_run: bool = False
    # Which flags the user gave explicitly (recorded in checkpoint metadata).
    explicit: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        self._expand_home()
        if self.checkpoint_frequency == -1:
            self.checkpoint_frequency = 0  # the original PyRecover's spelling of "off"
        _check_numbers(self)
        for name in ("sequence_length", "batch_size", "training_steps", "grad_accum"):
            _positive_int(name, getattr(self, name))
        for name in ("log_every", "eval_batches", "profile_step_start", "profile_step_end"):
            _positive_int(name, getattr(self, name))
        for name in ("checkpoint_frequency", "eval_every", "warmup_steps"):
            if getattr(self, name) < 0:
                off = "0 or -1" if name == "checkpoint_frequency" else "0"
                raise ValueError(
                    f"{_flag(name)} must be >= 0 ({off} turns it off), got {getattr(self, name)}"
                )
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed must be between 0 and {MAX_SEED}, got {self.seed}")
        self._check_choices()
        self._check_parallelism()
        self._check_optimisation()
        self._check_checkpointing()
        self._check_time()
        self._check_evaluation()
        _check_store(self)
        _check_tokenizer(self.tokenizer)

    def _expand_home(self) -> None:
        """``--checkpoint-dir=~/ckpt``: the shell expands ``~`` only at the start of a word, so
        the flag's value keeps it; every local path means the same folder for every consumer."""
        for name in ("checkpoint_dir", "checkpoint_mirror", "metrics", "cache_dir", "dataset"):
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("~") and "://" not in value:
                setattr(self, name, os.path.expanduser(value))

    def _check_choices(self) -> None:
        for name, choices in (
            ("model_dtype", DTYPES),
            ("model_size", tuple(PRESETS)),
            ("device", DEVICES),
            ("parallelism", PARALLELISMS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"unknown {_flag(name)} {getattr(self, name)!r}: pick one of "
                    + ", ".join(choices)
                )

    def _check_parallelism(self) -> None:
        if self.param_dtype not in (None, *PARAM_DTYPES):
            raise ValueError(
                f"unknown --param-dtype {self.param_dtype!r}: pick one of {', '.join(PARAM_DTYPES)}"
            )
        if self.param_dtype == "bf16" and self.model_dtype != "bf16":
            raise ValueError(
                f"--param-dtype bf16 computes in bf16 but --model-dtype is {self.model_dtype}: "
                "pass --model-dtype bf16 (or leave it out), or drop --param-dtype bf16"
            )
        if self.param_dtype == "fp32" and self.model_dtype == "fp64":
            raise ValueError(
                "--model-dtype fp64 keeps fp64 weights: drop --param-dtype fp32 (or pick "
                "another --model-dtype)"
            )
        if self.parallelism == "fsdp" and self.model_dtype == "fp16":
            raise ValueError(
                "--parallelism fsdp does not support --model-dtype fp16 (fp16 needs a loss "
                "scale that all shards agree on): use --model-dtype bf16, or --parallelism ddp"
            )

    def _check_optimisation(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.learning_rate:
            raise ValueError(f"--min-lr must be between 0 and --learning-rate, got {self.min_lr}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("--grad-clip and --weight-decay must be >= 0 (0 turns them off)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}")
        if self.profile_step_end < self.profile_step_start:
            raise ValueError(
                f"--profile-step-end {self.profile_step_end} is before --profile-step-start "
                f"{self.profile_step_start}: give an end >= the start"
            )

    def _check_checkpointing(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and value < 0:
                off = "0 turns it off" if name == "keep_every" else "0 keeps all"
                raise ValueError(f"{_flag(name)} must be >= 0 ({off}), got {value}")
        interval = self.checkpoint_interval_seconds
        if isinstance(interval, str) and interval != "auto":
            raise ValueError(
                "--checkpoint-interval-seconds must be a number of seconds or 'auto', "
                f"got {interval!r}"
            )
        if isinstance(interval, (int, float)) and not interval > 0:
            raise ValueError(f"--checkpoint-interval-seconds must be positive, got {interval}")
        if not self.mtbf > 0:
            raise ValueError(f"--mtbf must be positive seconds, got {self.mtbf}")
        if not self.checkpoint_url and not self.checkpoint_dir:
            raise ValueError("--checkpoint-dir is empty: give a directory (default checkpoints/)")
        for name in ("default_iter_time", "default_ckpt_time"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{_flag(name)} must be positive seconds, got {value}")

    def _check_time(self) -> None:
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"--time-limit must be positive, got {self.time_limit}")
        if self.stop_margin is not None and self.stop_margin < 0:
            raise ValueError(f"--stop-margin must be >= 0 seconds, got {self.stop_margin}")

    def _check_evaluation(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.eval_every and not self.val_fraction:
            raise ValueError("--eval-every needs a held-out split: pass --val-fraction > 0")
        if self.keep_best and not self.eval_every:
            raise ValueError("--keep-best ranks checkpoints by validation loss: set --eval-every N")

    @property
    def store_url(self) -> str:
        """Root URL of the checkpoint store (the experiment is a folder under it)."""
        return self.checkpoint_url or self.checkpoint_dir

    @property
    def location(self) -> ckptstore.ExperimentLocation:
        """Where the experiment's checkpoints live, as ckptstore lays them out (no I/O)."""
        return ckptstore.experiment_location(
            self.store_url, self.experiment_name, self.storage_options
        )

    @property
    def resume_spec(self) -> ckptstore.StepSpec | None:
        """``--resume-from-checkpoint`` as ckptstore reads it: latest, a step (``42`` or
        ``step-00000042``) or a path/URL (a checkpoint folder; a local file is the original's)."""
        target = self.resume_from_checkpoint
        return None if target is None else ckptstore.StepSpec.parse(target)

    @property
    def store_is_local(self) -> bool:
        return self.location.local_path is not None

    @property
    def experiment_url(self) -> str:
        """The experiment's checkpoint folder as a URL (``~`` expanded), for messages."""
        return self.location.url

    @property
    def exp_dir(self) -> Path:
        """Local folder for metrics and logs: the experiment's checkpoint folder when that is
        on a local disk, else ``./runs/EXPERIMENT`` (metrics are appended line by line; object
        stores cannot append)."""
        local = self.location.local_path
        return Path(local) if local is not None else Path("runs") / self.experiment_name

    @property
    def metrics_path(self) -> Path:
        return Path(self.metrics) if self.metrics else self.exp_dir / "metrics.jsonl"

    @property
    def effective_min_lr(self) -> float:
        return self.learning_rate * 0.1 if self.min_lr is None else self.min_lr

    @property
    def format(self) -> str:
        """The checkpoint format: FSDP's sharded state is always saved sharded (dcp)."""
        sharded = self.use_torch_distributed_ckpt or self.parallelism == "fsdp"
        return "dcp" if sharded else "torch"

    @property
    def storage_dtype(self) -> str:
        """What the weights, gradients and optimizer moments are stored in."""
        if self.param_dtype is not None:
            return self.param_dtype
        return "fp64" if self.model_dtype == "fp64" else "fp32"

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank consumes per optimizer step."""
        return self.batch_size * self.sequence_length * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["explicit"] = list(self.explicit)
        return d


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{_flag(name)} must be a positive integer, got {value}")


def _check_numbers(cfg: TrainConfig) -> None:
    """No NaN/inf in any float (``--grad-clip nan`` would silently turn clipping off: NaN is
    neither < 0 nor > 0), and every int fits the int64 it is stored as."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{_flag(f.name)} must be a finite number, got {value}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError(f"{_flag(f.name)} must be at most {MAX_INT}, got {value}")


def _check_store(cfg: TrainConfig) -> None:
    """The experiment name (ckptstore's rule) and the checkpoint URL, checked before any work."""
    try:
        ckptstore.validate_experiment_name(cfg.experiment_name)
    except ValueError as e:
        raise ValueError(f"--experiment_name: {e}") from None
    flag = "--checkpoint-url" if cfg.checkpoint_url else "--checkpoint-dir"
    _check_url(flag, cfg.store_url, cfg)
    if cfg.checkpoint_mirror:
        _check_url("--checkpoint-mirror", cfg.checkpoint_mirror, cfg)
    _check_resume(cfg)


def _check_url(flag: str, url: str, cfg: TrainConfig) -> None:
    """An unknown URL scheme, or one whose extra is not installed, fails here (no I/O)."""
    try:
        ckptstore.experiment_location(url, cfg.experiment_name, cfg.storage_options)
    except (ValueError, ImportError, ckptstore.CheckpointError) as e:
        raise ValueError(f"{flag} {url}: {first_line(e)}") from None


def _check_resume(cfg: TrainConfig) -> None:
    target = cfg.resume_from_checkpoint
    if target is None:
        return
    why = "" if target.strip() else "empty"
    try:
        cfg.resume_spec  # noqa: B018
    except ValueError as e:  # a step number beyond ckptstore's
        why = str(e)
    if why:
        raise ValueError(
            f"--resume-from-checkpoint {target!r}: {why} (give 'latest', a step number, a "
            "checkpoint folder, or an original PyRecover .pt file)"
        )


def _check_tokenizer(spec: str) -> None:
    """The form of ``--tokenizer`` (parquetlm's spec); whether a file exists is seen later."""
    try:
        parquetlm.parse_tokenizer_spec(spec, check_file=False)
    except parquetlm.TokenizerError as e:
        raise ValueError(f"--tokenizer {spec}: {e}") from None


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- value parsers (argparse turns ArgumentTypeError into one line and exit 2) -------------------


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _whole(text: str) -> int:
    """An integer, also written as ``1e6``; refused when it is not whole or does not fit int64."""
    try:
        value = Decimal(text.strip().replace("_", ""))
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    if abs(value) > MAX_INT:
        raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {MAX_INT})")
    return int(value)


def _interval(text: str) -> float | str:
    if text == "auto":
        return "auto"
    try:
        return _finite(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither seconds nor 'auto'") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        return ckptstore.parse_storage_options(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _duration(text: str) -> float:
    try:
        return parse_human_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _time_limit(text: str) -> float:
    try:
        seconds = parse_time_limit(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if math.isinf(seconds):  # SLURM's "no limit": here there would be nothing to stop before
        raise argparse.ArgumentTypeError(
            f"{text!r} means no time limit; leave --time-limit out to use SLURM's end time"
        )
    return seconds


# --- the table of flags ---------------------------------------------------------------------------

_MEASURED = "0: the first step is measured before the first stop decision"
_GUESS = "1 s + state size / 200 MB/s"
_STORAGE_HELP = (
    "fsspec options for --checkpoint-url/--checkpoint-mirror (JSON object), e.g. "
    '\'{"endpoint_url": "http://127.0.0.1:9000"}\''
)
_TIME_LIMIT_HELP = (
    "stop before this long after the process started, instead of SLURM's end time: as sbatch "
    "--time reads it (90 = 90 min, 1:30:00, 2-12:00) or with a unit (30s, 1h30m)"
)
_MARGIN_HELP = (
    "seconds kept free after the final save, for the exit and requeue (replaces the measured "
    "exit + slack)"
)
_MARGIN_SHOWN = (
    "measured: 1.25 x the longest exit-and-requeue of the last 5 allocations (10 s until one is "
    "measured) + 5 s slack"
)
_EXTRA_HELP = (
    "after a stop for time, when the final save ended early: train on and save again; a save "
    "not durable when the exit must begin is abandoned (the final save stands)"
)
_ASYNC_HELP = (
    "periodic saves snapshot the state and persist it in the background; the final save blocks"
)
_ASYNC_SHOWN = (
    "auto: on with CUDA (the snapshot is a copy to pinned memory), off on CPU (the writer "
    "would compete with training for the cores) and for FSDP-sharded state"
)
_TOKENIZER_HELP = "byte | gpt2 | bpe[:N] | path/to/tokenizer.json (or its folder)"
_CACHE_SHOWN = "$PYRECOVER_CACHE or ~/.cache/pyrecover"
_VAL_SHOWN = f"{DEFAULT_VAL_FRACTION} when evaluating, else 0"


@dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag: ``--NAME`` (dashes) sets the :class:`TrainConfig` field ``NAME``.

    ``type`` None (:data:`SWITCH`) is an on/off switch; ``negatable`` adds ``--no-NAME`` (for a
    switch whose default is decided at run time, None until given). ``shown`` is how help
    describes a default that is not a plain value of the field (derived, or "preset"); else help
    shows the field's default. ``group`` is the help section, set by :func:`_group`.
    """

    name: str
    type: Callable[[str], Any] | None
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    shown: str | None = None
    group: str = ""
    negatable: bool = False


SWITCH = None


def _group(title: str, *flags: Flag) -> tuple[Flag, ...]:
    return tuple(replace(f, group=title) for f in flags)


FLAGS: tuple[Flag, ...] = (
    *_group(
        "original PyRecover flags",
        Flag("dataset", str, "parquet file/dir/glob/URL", shown="the Shakespeare corpus"),
        Flag("sequence_length", _whole, "tokens per sample"),
        Flag("batch_size", _whole, "samples per rank per micro-step"),
        Flag("learning_rate", _finite, "peak learning rate"),
        Flag("training_steps", _whole, "optimizer steps in total"),
        Flag("distributed", SWITCH, "torch.distributed under torchrun or srun"),
        Flag(
            "model_dtype",
            str,
            "compute dtype; bf16/fp16 run over fp32 weights (see --param-dtype)",
            choices=DTYPES,
        ),
        Flag("checkpoint_dir", str, "local checkpoint root"),
        Flag("checkpoint_frequency", _whole, "save every N steps, 0 or -1 = off"),
        Flag(
            "resume_from_checkpoint",
            str,
            "'latest' (a fresh start when there is none yet), a step number, a checkpoint "
            "folder, or an original PyRecover .pt file (imported)",
            metavar="PATH|STEP|latest",
            shown="off",
        ),
        Flag("experiment_name", str, "folder under the checkpoint root (NAME or GROUP/NAME)"),
        Flag("use_torch_distributed_ckpt", SWITCH, "torch.distributed.checkpoint format (sharded)"),
        Flag("compile", SWITCH, "torch.compile the model"),
        Flag("fused_optimizer", SWITCH, "fused AdamW"),
        Flag("timeaware_checkpointing", SWITCH, "always on here: a final save before the deadline"),
        Flag(
            "default_iter_time",
            _duration,
            "the time budget's step estimate until a step is measured",
            shown=_MEASURED,
        ),
        Flag(
            "default_ckpt_time",
            _duration,
            "the time budget's save estimate until a save is measured",
            shown=_GUESS,
        ),
        Flag("verify_checkpoints", SWITCH, "always on here: every file is checksummed"),
        Flag("use_flash_attention", SWITCH, "accepted: SDPA picks FlashAttention kernels itself"),
        Flag("log_loss_to_csv", SWITCH, "also write EXP_DIR/EXPERIMENT_loss_log.csv"),
        Flag("profile", SWITCH, "torch.profiler trace (and cudaProfilerStart/Stop) of the steps"),
        Flag("profile_step_start", _whole, "first profiled step"),
        Flag("profile_step_end", _whole, "last profiled step"),
    ),
    *_group(
        "checkpointing",
        Flag("checkpoint_url", str, "any fsspec URL (s3://bucket/run); overrides --checkpoint-dir"),
        Flag("checkpoint_mirror", str, "second location every checkpoint is copied to"),
        Flag("async_checkpoint", SWITCH, _ASYNC_HELP, shown=_ASYNC_SHOWN, negatable=True),
        Flag("keep_last", _whole, "keep the newest N, 0 = all", aliases=("max_kept_checkpoints",)),
        Flag("keep_every", _whole, "also keep every checkpoint whose step is a multiple of N"),
        Flag("keep_best", _whole, "also keep the K with the lowest validation loss"),
        Flag(
            "checkpoint_interval_seconds",
            _interval,
            "save every N seconds; auto = Young/Daly sqrt(2 * save cost * MTBF)",
            metavar="N|auto",
        ),
        Flag("storage_options", _json_object, _STORAGE_HELP, metavar="JSON"),
        Flag("mtbf", _duration, "mean time between failures for auto"),
    ),
    *_group(
        "time",
        Flag("time_limit", _time_limit, _TIME_LIMIT_HELP, shown="SLURM's deadline"),
        Flag("stop_margin", _duration, _MARGIN_HELP, shown=_MARGIN_SHOWN),
        Flag("extra_saves", SWITCH, _EXTRA_HELP, shown="on", negatable=True),
    ),
    *_group(
        "model, data, optimisation",
        Flag("model_size", str, "preset shape", choices=tuple(PRESETS)),
        Flag("tokenizer", str, _TOKENIZER_HELP, aliases=("tokenizer_name_or_path",)),
        Flag("text_column", str, "parquet column with the text"),
        Flag("cache_dir", str, "corpus/tokenizer/token cache", shown=_CACHE_SHOWN),
        Flag("seed", _whole, "weights, data order and RNG seed"),
        Flag("grad_accum", _whole, "micro-batches per optimizer step"),
        Flag("warmup_steps", _whole, "linear warmup, then cosine", aliases=("lr_warmup_steps",)),
        Flag("min_lr", _finite, "learning rate at the end of the cosine", shown="lr/10"),
        Flag("weight_decay", _finite, "AdamW weight decay"),
        Flag("grad_clip", _finite, "clip the gradient norm, 0 = off", aliases=("grad_max_norm",)),
        Flag("device", str, "auto = CUDA when available", choices=DEVICES),
    ),
    *_group(
        "parallelism, memory, reproducibility",
        Flag(
            "parallelism",
            str,
            "ddp: every rank holds the whole model; fsdp: weights, gradients and optimizer "
            "state sharded over the ranks (FSDP2), checkpoints sharded (dcp)",
            choices=PARALLELISMS,
        ),
        Flag(
            "param_dtype",
            str,
            "what weights, gradients and AdamW moments are stored in; bf16 halves them (the "
            "original PyRecover's --model-dtype bf16; implies --model-dtype bf16)",
            choices=PARAM_DTYPES,
            shown="fp32 (fp64 with --model-dtype fp64)",
        ),
        Flag(
            "activation_checkpointing",
            SWITCH,
            "recompute each layer's activations in backward: less memory, ~1/3 more compute",
        ),
        Flag(
            "deterministic",
            SWITCH,
            "bitwise-reproducible GPU runs: deterministic kernels, no TF32, math attention "
            "(slower); CPU runs are deterministic anyway",
        ),
    ),
    *_group(
        "observability",
        Flag("log_every", _whole, "steps between progress lines", aliases=("logging_frequency",)),
        Flag("metrics", str, "JSONL metrics file", shown="EXP_DIR/metrics.jsonl"),
        Flag("wandb", SWITCH, "log to Weights & Biases (extra [wandb])"),
        Flag("eval_every", _whole, "validation every N steps, 0 = off"),
        Flag("eval_batches", _whole, "validation batches per rank"),
        Flag("val_fraction", _finite, "held-out share of the data", shown=_VAL_SHOWN),
        Flag("peak_tflops", _finite, "per-GPU peak for MFU", shown="the table of GPUs"),
        Flag("dry_run", SWITCH, "one step, one save, one verified load, exit 0"),
    ),
)
_FIELDS = {f.name: f for f in fields(TrainConfig)}
assert all(f.name in _FIELDS for f in FLAGS)


def _default_text(flag: Flag) -> str | None:
    if flag.type is SWITCH:
        return flag.shown  # off unless given, or decided at run time
    if flag.shown is not None:
        return flag.shown
    if flag.name in _TINY:
        return f"preset: tiny {_TINY[flag.name]}, 125m and up {_ORIGINAL[flag.name]}"
    default = _FIELDS[flag.name].default
    assert default is not MISSING
    if default is None:
        return "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


_METAVARS: dict[Callable[[str], Any], str] = {
    _whole: "N",
    _finite: "X",
    _duration: "DURATION",
    _time_limit: "TIME",
}


def spellings(name: str) -> list[str]:
    """--a-b first (the one help shows), then --a_b."""
    dashed = "--" + name.replace("_", "-")
    under = "--" + name.replace("-", "_")
    return [dashed] if under == dashed else [dashed, under]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


class _OneSpelling(argparse.HelpFormatter):
    """Help lists each flag in its dash spelling only; the underscore ones stay accepted."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for s in action.option_strings if "_" not in s]
        if not shown or not action.option_strings[0].startswith("--"):
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return ", ".join(shown)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{s} {metavar}" for s in shown)


DESCRIPTION = (
    "Time-aware GPT trainer: checkpoints before the SLURM deadline, resumes bit-exactly. "
    "Exit status: 0 finished, 75 stopped early (time or signal; requeue wanted), 1 error, "
    "2 usage error. Subcommands: `pyrecover-train report EXP_DIR` summarises and plots a run; "
    "`pyrecover-train import-checkpoint FILE.pt [FLAGS]` imports an original PyRecover "
    "checkpoint. Every flag is also accepted with underscores, as the original spelled them "
    "(--experiment_name = --experiment-name). 'default: preset' = the default depends on "
    "--model-size: tiny and small are sized for a CPU, 125m and up take the original "
    "PyRecover's defaults; a flag you give always wins."
)


def build_parser(prog: str = "pyrecover-train") -> argparse.ArgumentParser:
    """The parser of :data:`FLAGS`. Defaults are SUPPRESSed: a flag not given stays out of the
    namespace, so presets fill it in and the config records what the user chose."""
    p = _Parser(
        prog=prog,
        usage=f"{prog} [train] [FLAGS] | {prog} report EXP_DIR | "
        f"{prog} import-checkpoint FILE.pt [FLAGS]",
        description=DESCRIPTION,
        formatter_class=_OneSpelling,
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        group = groups.get(flag.group) or groups.setdefault(
            flag.group, p.add_argument_group(flag.group)
        )
        names = [s for n in (flag.name, *flag.aliases) for s in spellings(n)]
        shown = _default_text(flag)
        text = flag.help if shown is None else f"{flag.help} (default: {shown})"
        kwargs: dict[str, Any] = {
            "dest": flag.name,
            "default": argparse.SUPPRESS,
            "help": text.replace("%", "%%"),
        }
        if flag.type is SWITCH:
            kwargs["action"] = "store_true"
        else:
            metavar = flag.metavar or (None if flag.type is None else _METAVARS.get(flag.type))
            kwargs.update(type=flag.type, choices=flag.choices, metavar=metavar)
        group.add_argument(*names, **kwargs)
        if flag.negatable:
            no = spellings("no_" + flag.name)
            group.add_argument(
                *no, dest=flag.name, action="store_false", default=argparse.SUPPRESS,
                help=f"turn {spellings(flag.name)[0]} off",
            )  # fmt: skip
    return p


def config_from_args(argv: list[str] | None) -> TrainConfig:
    """Parse and validate; bad input raises :class:`UsageError` (argparse exits 2 by itself)."""
    ns = vars(build_parser().parse_args(argv))
    explicit = tuple(sorted(ns))
    size = ns.get("model_size", "tiny")
    values: dict[str, Any] = dict(PRESET_DEFAULTS.get(size, {}))
    if "val_fraction" not in ns:
        eval_every = ns.get("eval_every", values.get("eval_every", 0))
        values["val_fraction"] = DEFAULT_VAL_FRACTION if eval_every else 0.0
    values.update(ns)
    if values.get("param_dtype") == "bf16" and "model_dtype" not in ns:
        values["model_dtype"] = "bf16"  # bf16 storage computes in bf16
    if "checkpoint_interval_seconds" in ns and "checkpoint_frequency" not in ns:
        values["checkpoint_frequency"] = 0  # a time interval replaces the step frequency
    for name in ("keep_last", "keep_every", "keep_best"):
        if values.get(name) == 0:
            values[name] = None  # 0 = no limit, as ckptstore expects None
    try:
        return TrainConfig(explicit=explicit, **values)
    except ValueError as e:
        raise UsageError(str(e)) from None

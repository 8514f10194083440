"""Command-line flags -> a validated :class:`TrainConfig`.

Every flag of the original PyRecover is accepted verbatim with its default, in both the dash and
the underscore spelling (``--sequence-length`` and ``--sequence_length``). Flags whose best value
depends on the model size (sequence length, batch size, learning rate, steps, dtype, ...) default
to the ``--model-size`` preset's value unless given; the presets of the original's model sizes
(``125m`` and up) use the original's defaults (sequence 2048, batch 1, lr 1e-5, 1000 steps, bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .model import PRESETS

DTYPES = ("fp16", "bf16", "fp32", "fp64")
DEVICES = ("auto", "cpu", "cuda")

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

DEFAULT_MTBF = 6 * 3600.0
DEFAULT_VAL_FRACTION = 0.02


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit status 2, nothing touched on disk."""


def parse_duration(text: str) -> float:
    """Seconds from ``SECONDS`` (``90``, ``1.5``) or SLURM-style ``[D-][[H:]M:]S`` (``1:30:00``)."""
    s = text.strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+){0,2})(\.\d+)?", s)
    if m is None:
        raise ValueError(
            f"{text!r} is not a duration: use seconds (5400) or [D-][[H:]M:]S (1:30:00)"
        )
    days, clock, frac = m.groups()
    parts = [int(p) for p in clock.split(":")]
    if len(parts) > 1 and any(p >= 60 for p in parts[1:]):
        raise ValueError(f"{text!r}: minutes and seconds must be below 60")
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + p
    if days:
        if len(parts) == 1:  # SLURM reads D-H as days and hours
            seconds *= 3600
        seconds += int(days) * 86400
    return seconds + (float(frac) if frac else 0.0)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; validated on creation (messages say how to fix)."""

    # The original PyRecover's flags.
    dataset: str | None = None
    sequence_length: int = 128
    batch_size: int = 8
    learning_rate: float = 3e-3
    training_steps: int = 400
    distributed: bool = False
    model_dtype: str = "fp32"
    checkpoint_dir: str = "checkpoints/"
    checkpoint_frequency: int = 10
    resume_from_checkpoint: str | None = None
    experiment_name: str = "default-exp"
    use_torch_distributed_ckpt: bool = False
    compile: bool = False
    fused_optimizer: bool = False
    # Checkpointing.
    checkpoint_url: str | None = None
    checkpoint_mirror: str | None = None
    async_checkpoint: bool = False
    keep_last: int | None = 3
    keep_best: int | None = None
    checkpoint_interval_seconds: float | str | None = None  # seconds or "auto"
    storage_options: dict[str, Any] | None = None  # fsspec options for the checkpoint URLs
    mtbf: float = DEFAULT_MTBF
    # Time.
    time_limit: float | None = None
    stop_margin: float | None = None
    # Model, data, optimisation.
    model_size: str = "tiny"
    tokenizer: str = "bpe:4096"
    text_column: str = "text"
    cache_dir: str | None = None
    seed: int = 42
    grad_accum: int = 1
    warmup_steps: int = 40
    min_lr: float | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "auto"
    # Observability and evaluation.
    log_every: int = 10
    metrics: str | None = None
    wandb: bool = False
    eval_every: int = 100
    eval_batches: int = 8
    val_fraction: float = DEFAULT_VAL_FRACTION
    peak_tflops: float | None = None
    dry_run: bool = False
    # Which flags the user gave explicitly (recorded in checkpoint metadata).
    explicit: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.checkpoint_frequency == -1:
            self.checkpoint_frequency = 0  # the original PyRecover's spelling of "off"
        for name in ("sequence_length", "batch_size", "training_steps", "grad_accum"):
            _positive_int(name, getattr(self, name))
        for name in ("log_every", "eval_batches"):
            _positive_int(name, getattr(self, name))
        for name in ("checkpoint_frequency", "eval_every", "warmup_steps"):
            if getattr(self, name) < 0:
                off = "0 or -1" if name == "checkpoint_frequency" else "0"
                raise ValueError(
                    f"{_flag(name)} must be >= 0 ({off} turns it off), got {getattr(self, name)}"
                )
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise ValueError(f"--learning-rate must be positive, got {self.learning_rate}")
        if self.min_lr is not None and not 0 <= self.min_lr <= self.learning_rate:
            raise ValueError(f"--min-lr must be between 0 and --learning-rate, got {self.min_lr}")
        if self.model_dtype not in DTYPES:
            raise ValueError(
                f"unknown --model-dtype {self.model_dtype!r}: pick one of {', '.join(DTYPES)}"
            )
        if self.model_size not in PRESETS:
            raise ValueError(
                f"unknown --model-size {self.model_size!r}: pick one of {', '.join(PRESETS)}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"unknown --device {self.device!r}: pick one of {', '.join(DEVICES)}")
        _check_experiment_name(self.experiment_name)
        self._check_checkpointing()
        self._check_time()
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.eval_every and not self.val_fraction:
            raise ValueError("--eval-every needs a held-out split: pass --val-fraction > 0")
        if self.keep_best and not self.eval_every:
            raise ValueError("--keep-best ranks checkpoints by validation loss: set --eval-every N")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("--grad-clip and --weight-decay must be >= 0 (0 turns them off)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {self.peak_tflops}")

    def _check_checkpointing(self) -> None:
        for name in ("keep_last", "keep_best"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{_flag(name)} must be >= 0 (0 keeps all), got {value}")
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

    def _check_time(self) -> None:
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"--time-limit must be positive, got {self.time_limit}")
        if self.stop_margin is not None and self.stop_margin < 0:
            raise ValueError(f"--stop-margin must be >= 0 seconds, got {self.stop_margin}")

    @property
    def store_url(self) -> str:
        """Root URL of the checkpoint store (the experiment is a folder under it)."""
        return self.checkpoint_url or self.checkpoint_dir

    @property
    def store_is_local(self) -> bool:
        return "://" not in self.store_url or self.store_url.startswith("file://")

    @property
    def exp_dir(self) -> Path:
        """Local folder for metrics and logs: the experiment's checkpoint folder when that is
        local, else ``./runs/EXPERIMENT`` (metrics are appended line by line; object stores
        cannot append)."""
        if self.store_is_local:
            root = self.store_url.removeprefix("file://")
            return Path(root) / self.experiment_name
        return Path("runs") / self.experiment_name

    @property
    def metrics_path(self) -> Path:
        return Path(self.metrics) if self.metrics else self.exp_dir / "metrics.jsonl"

    @property
    def effective_min_lr(self) -> float:
        return self.learning_rate * 0.1 if self.min_lr is None else self.min_lr

    @property
    def format(self) -> str:
        return "dcp" if self.use_torch_distributed_ckpt else "torch"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["explicit"] = list(self.explicit)
        return d


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{_flag(name)} must be a positive integer, got {value}")


# ckptstore's rule for an experiment folder (checked here so a bad name fails before any work).
_EXPERIMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _check_experiment_name(name: str) -> None:
    if not name or name in (".", "..") or ".." in name or "/" in name or "\\" in name:
        raise ValueError(
            f"--experiment_name {name!r} must be a plain folder name (no '/', '\\' or '..'): "
            "it becomes one folder under the checkpoint directory"
        )
    if os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"--experiment_name {name!r} must not contain a path separator")
    if not _EXPERIMENT_RE.fullmatch(name):
        raise ValueError(
            f"--experiment_name {name!r}: use letters, digits, '.', '_' and '-' (at most 128), "
            "starting with a letter or digit"
        )


# --- argparse -------------------------------------------------------------------------------------


def _both(*names: str) -> list[str]:
    """Every spelling of a flag: --a-b and --a_b."""
    out: list[str] = []
    for n in names:
        for variant in (n, "--" + n[2:].replace("_", "-"), "--" + n[2:].replace("-", "_")):
            if variant not in out:
                out.append(variant)
    return out


def _interval(text: str) -> float | str:
    if text == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither seconds nor 'auto'") from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"anon\": true}'")
    return value


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "pyrecover-train") -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        description="Time-aware GPT trainer: checkpoints before the SLURM deadline, resumes bit-"
        "exactly. Exit status: 0 finished, 75 stopped early (time or signal; requeue wanted), "
        "1 error, 2 usage error. `pyrecover-train report EXP_DIR` plots a run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    S = argparse.SUPPRESS  # "not given": lets presets fill in, and records what the user chose
    g = p.add_argument_group("original PyRecover flags")
    g.add_argument(
        *_both("--dataset"),
        default=S,
        help="parquet file/dir/glob/URL (default: the Shakespeare corpus)",
    )
    g.add_argument(
        *_both("--sequence-length"),
        type=int,
        default=S,
        help="tokens per sample (preset; original 2048)",
    )
    g.add_argument(
        *_both("--batch-size"),
        type=int,
        default=S,
        help="samples per rank per micro-step (preset; original 1)",
    )
    g.add_argument(
        *_both("--learning-rate"),
        type=float,
        default=S,
        help="peak learning rate (preset; original 1e-5)",
    )
    g.add_argument(
        *_both("--training-steps"),
        type=int,
        default=S,
        help="optimizer steps in total (preset; original 1000)",
    )
    g.add_argument(
        *_both("--distributed"),
        action="store_true",
        default=S,
        help="torch.distributed under torchrun or srun",
    )
    g.add_argument(
        *_both("--model-dtype"),
        choices=DTYPES,
        default=S,
        help="bf16/fp16 = autocast with fp32 master weights (preset; original bf16)",
    )
    g.add_argument(
        *_both("--checkpoint-dir"), default=S, help="local checkpoint root (default checkpoints/)"
    )
    g.add_argument(
        *_both("--checkpoint-frequency"),
        type=int,
        default=S,
        help="save every N steps, 0 or -1 = off (default 10)",
    )
    g.add_argument(
        *_both("--resume-from-checkpoint"),
        metavar="PATH|latest",
        default=S,
        help="resume from a checkpoint; 'latest' starts fresh when there is none yet",
    )
    g.add_argument(
        *_both("--experiment_name"),
        default=S,
        help="folder under the checkpoint root (default default-exp)",
    )
    g.add_argument(
        *_both("--use-torch-distributed-ckpt"),
        action="store_true",
        default=S,
        help="torch.distributed.checkpoint format (each rank writes its shard)",
    )
    g.add_argument(
        *_both("--compile"), action="store_true", default=S, help="torch.compile the model"
    )
    g.add_argument(*_both("--fused-optimizer"), action="store_true", default=S, help="fused AdamW")

    c = p.add_argument_group("checkpointing")
    c.add_argument(
        *_both("--checkpoint-url"),
        default=S,
        help="any fsspec URL (s3://bucket/run); overrides --checkpoint-dir",
    )
    c.add_argument(
        *_both("--checkpoint-mirror"),
        default=S,
        help="second location every checkpoint is copied to",
    )
    c.add_argument(
        *_both("--async-checkpoint"),
        action="store_true",
        default=S,
        help="persist in the background",
    )
    c.add_argument(
        *_both("--keep-last"),
        type=int,
        default=S,
        help="keep the newest N checkpoints, 0 = all (default 3)",
    )
    c.add_argument(
        *_both("--keep-best"),
        type=int,
        default=S,
        help="also keep the K with the lowest validation loss",
    )
    c.add_argument(
        *_both("--checkpoint-interval-seconds"),
        type=_interval,
        default=S,
        metavar="N|auto",
        help="save every N seconds; auto = Young/Daly sqrt(2 * save cost * MTBF)",
    )
    c.add_argument(
        *_both("--storage-options"),
        type=_json_object,
        default=S,
        metavar="JSON",
        help="fsspec options for --checkpoint-url/--checkpoint-mirror (JSON object), e.g. "
        '\'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    c.add_argument(
        *_both("--mtbf"),
        type=_duration,
        default=S,
        help=f"mean time between failures for auto (default {DEFAULT_MTBF:.0f} s)",
    )

    t = p.add_argument_group("time")
    t.add_argument(
        *_both("--time-limit"),
        type=_duration,
        default=S,
        help="stop after this long, seconds or [[H:]M:]S from process start (overrides SLURM)",
    )
    t.add_argument(
        *_both("--stop-margin"),
        type=float,
        default=S,
        help="seconds kept free before the deadline (default: slurmclock's)",
    )

    m = p.add_argument_group("model, data, optimisation")
    m.add_argument(
        *_both("--model-size"),
        choices=tuple(PRESETS),
        default=S,
        help="preset shape (default tiny)",
    )
    m.add_argument(
        *_both("--tokenizer"),
        default=S,
        help="byte | gpt2 | bpe[:N] | path/to/tokenizer.json (preset)",
    )
    m.add_argument(
        *_both("--text-column"), default=S, help="parquet column with the text (default text)"
    )
    m.add_argument(
        *_both("--cache-dir"),
        default=S,
        help="corpus/tokenizer/token cache (default $PYRECOVER_CACHE or ~/.cache/pyrecover)",
    )
    m.add_argument(
        *_both("--seed"), type=int, default=S, help="weights, data order and RNG seed (default 42)"
    )
    m.add_argument(
        *_both("--grad-accum"),
        type=int,
        default=S,
        help="micro-batches per optimizer step (default 1)",
    )
    m.add_argument(
        *_both("--warmup-steps"),
        type=int,
        default=S,
        help="linear warmup, then cosine decay (preset)",
    )
    m.add_argument(
        *_both("--min-lr"),
        type=float,
        default=S,
        help="learning rate at the end of the cosine (default lr/10)",
    )
    m.add_argument(
        *_both("--weight-decay"), type=float, default=S, help="AdamW weight decay (default 0.1)"
    )
    m.add_argument(
        *_both("--grad-clip"),
        type=float,
        default=S,
        help="clip the gradient norm, 0 = off (default 1.0)",
    )
    m.add_argument(
        *_both("--device"), choices=DEVICES, default=S, help="auto = CUDA when available"
    )

    o = p.add_argument_group("observability")
    o.add_argument(
        *_both("--log-every"),
        type=int,
        default=S,
        help="steps between progress lines/metric samples (default 10)",
    )
    o.add_argument(
        *_both("--metrics"), default=S, help="JSONL metrics file (default EXP_DIR/metrics.jsonl)"
    )
    o.add_argument(
        *_both("--wandb"),
        action="store_true",
        default=S,
        help="log to Weights & Biases (extra [wandb])",
    )
    o.add_argument(
        *_both("--eval-every"),
        type=int,
        default=S,
        help="validation every N steps, 0 = off (preset)",
    )
    o.add_argument(
        *_both("--eval-batches"),
        type=int,
        default=S,
        help="validation batches per rank (default 8)",
    )
    o.add_argument(
        *_both("--val-fraction"),
        type=float,
        default=S,
        help=f"held-out share of the data (default {DEFAULT_VAL_FRACTION} when evaluating, else 0)",
    )
    o.add_argument(
        *_both("--peak-tflops"),
        type=float,
        default=S,
        help="per-GPU peak for MFU when the GPU is not in the table",
    )
    o.add_argument(
        *_both("--dry-run"),
        action="store_true",
        default=S,
        help="one step, one save, one verified load, exit 0",
    )
    del add
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
    if "checkpoint_interval_seconds" in ns and "checkpoint_frequency" not in ns:
        values["checkpoint_frequency"] = 0  # a time interval replaces the step frequency
    for name in ("keep_last", "keep_best"):
        if values.get(name) == 0:
            values[name] = None  # 0 = no limit, as ckptstore expects None
    try:
        return TrainConfig(explicit=explicit, **values)
    except ValueError as e:
        raise UsageError(str(e)) from None

"""A validated :class:`TrainConfig`, and the command line generated from its fields.

Each flag is written once, as a field of :class:`TrainConfig`: its type, default, help text,
aliases, choices and check sit in that field's declaration; the parser, ``--help`` and the
per-value validation are generated from them. Checks that involve two flags are methods of the
config (contradictions with no sane run are errors; those that leave one are
:meth:`TrainConfig.warnings`).

Every flag of the original PyRecover is accepted verbatim with its meaning, in both the dash and
the underscore spelling (``--sequence-length`` and ``--sequence_length``); help shows the dash
spelling. Flags whose best value depends on the model size (sequence length, batch size, learning
rate, steps, dtype, ...) default to the ``--model-size`` entry of :data:`~.sizes.SIZES` unless
given; the original's model sizes (``125m`` and up) use the original's defaults (sequence 2048,
batch 1, lr 1e-5, 1000 steps, bf16).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import ckptstore
import parquetlm
from slurmclock import BudgetConfig, parse_human_duration, parse_time_limit
from slurmclock.budget import EXIT_GUESS, EXIT_GUESS_BASE, EXIT_PER_LAUNCH

from .sizes import DEFAULT_SIZE, PRESET_FLAGS, SIZES, describe_preset, preset_defaults

DTYPES = ("fp16", "bf16", "fp32", "fp64")
DEVICES = ("auto", "cpu", "cuda")
PARALLELISMS = ("ddp", "fsdp")
PARAM_DTYPES = ("fp32", "bf16")
MAX_INT = 2**63 - 1  # every count is stored as int64 (metrics, tensors, checkpoints)
MAX_SEED = 2**32 - 1  # numpy's legacy generator takes 32-bit seeds
DEFAULT_MTBF = 6 * 3600.0
DEFAULT_VAL_FRACTION = 0.02
_TINY = SIZES[DEFAULT_SIZE].defaults

__all__ = ["TrainConfig", "UsageError", "build_parser", "config_from_args"]


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit status 2, nothing touched on disk."""


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


def _count_or_all(text: str) -> int | None:
    """A retention count: 0 means no limit (None, as ckptstore takes it)."""
    return _whole(text) or None


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


# --- checks of one value: check(flag, value) raises ValueError saying how to fix -----------------

Check = Callable[[str, Any], None]


def positive_int(flag: str, value: Any) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{flag} must be a positive integer, got {value}")


def positive(unit: str = "") -> Check:
    def check(flag: str, value: Any) -> None:
        if not value > 0:
            raise ValueError(f"{flag} must be positive{unit}, got {value}")

    return check


def at_least_zero(meaning: str = "", unit: str = "") -> Check:
    """>= 0; ``meaning`` says what 0 does (shown in the message)."""
    said = f" ({meaning})" if meaning else ""

    def check(flag: str, value: Any) -> None:
        if value < 0:
            raise ValueError(f"{flag} must be >= 0{unit}{said}, got {value}")

    return check


def between(low: float, high: float) -> Check:
    def check(flag: str, value: Any) -> None:
        if not low <= value <= high:
            raise ValueError(f"{flag} must be between {low} and {high}, got {value}")

    return check


def _fraction(flag: str, value: Any) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"{flag} must be in [0, 1), got {value}")


def _interval_value(flag: str, value: Any) -> None:
    if isinstance(value, str) and value != "auto":
        raise ValueError(f"{flag} must be a number of seconds or 'auto', got {value!r}")
    if isinstance(value, (int, float)) and not value > 0:
        raise ValueError(f"{flag} must be positive, got {value}")


def _experiment_name(flag: str, value: Any) -> None:
    """ckptstore's rule; the original spelled this flag with an underscore, and so do we."""
    try:
        ckptstore.validate_experiment_name(value)
    except ValueError as e:
        raise ValueError(f"--experiment_name: {e}") from None


def _resume_target(flag: str, target: Any) -> None:
    why = "" if target.strip() else "empty"
    try:
        ckptstore.StepSpec.parse(target)
    except ValueError as e:  # a step number beyond ckptstore's
        why = why or str(e)
    if why:
        raise ValueError(
            f"{flag} {target!r}: {why} (give 'latest', a step number, a checkpoint folder, or "
            "another tool's checkpoint file or folder)"
        )


def _tokenizer_spec(flag: str, spec: Any) -> None:
    """The form of ``--tokenizer`` (parquetlm's spec); whether a file exists is seen later."""
    try:
        parquetlm.parse_tokenizer_spec(spec, check_file=False)
    except parquetlm.TokenizerError as e:
        raise ValueError(f"{flag} {spec}: {e}") from None


# --- one flag's metadata, and the sections of the help that declare them -------------------------


@dataclass(frozen=True, slots=True)
class Flag:
    """What the command line needs of one :class:`TrainConfig` field ``name``: ``--a-b`` and
    ``--a_b`` (for the field ``a_b``) set it, and so do the ``aliases`` in both spellings.

    ``type`` parses the text (None: from the field's annotation: int, float, str, or a switch
    for bool); a bool field whose default is not False (on, or None for "decided at run time")
    also gets ``--no-NAME``. ``shown`` is how help describes a default that is not a plain value
    of the field (derived, or "off"); a field of :class:`~.sizes.Defaults` shows the sizes'.
    ``check(flag, value)`` validates a value that is not None (raising ValueError that says how
    to fix it); ``choices`` also does. ``path``: ``~`` is
    expanded (the shell leaves it after ``=``). ``group``: the help section.
    """

    help: str
    group: str
    name: str = ""
    type: Callable[[str], Any] | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    shown: str | None = None
    check: Check | None = None
    path: bool = False
    negatable: bool = False


class Section:
    """A section of ``--help``: ``field: T = SECTION(default, help, ...)`` declares a flag."""

    def __init__(self, title: str) -> None:
        self.title = title

    def __call__(self, default: Any, help: str, **flag: Any) -> Any:
        return field(default=default, metadata={"flag": Flag(help, self.title, **flag)})


ORIGINAL = Section("original PyRecover flags")
CHECKPOINTING = Section("checkpointing")
TIME = Section("time")
TRAINING = Section("model, data, optimisation")
PARALLEL = Section("parallelism, memory, reproducibility")
OBSERVE = Section("observability")

_MEASURED = "0: the first step is measured before the first stop decision"
_GUESS = "1 s + state size / 200 MB/s"
_RESUME_HELP = (
    "'latest' (a fresh start when there is none yet), a step number, a checkpoint folder, or "
    "another tool's checkpoint to start from: a torch.save file (an original PyRecover .pt too), "
    "a dcp.save folder, a safetensors file, a Lightning .ckpt, a Hugging Face checkpoint-N folder"
)
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
_BUDGET = BudgetConfig()  # slurmclock's defaults: help cannot drift from them
_MARGIN_SHOWN = (
    f"measured: 1.25 x the longest exit-and-requeue of the last {_BUDGET.exit_window} "
    f"allocations (until one is measured: {EXIT_GUESS_BASE:g} s + {EXIT_PER_LAUNCH:g} x the "
    f"measured launch on one node, else {EXIT_GUESS:g} s) + "
    f"{_BUDGET.slack:g} s slack"
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
_PARALLELISM_HELP = (
    "ddp: every rank holds the whole model; fsdp: weights, gradients and optimizer state "
    "sharded over the ranks (FSDP2), checkpoints sharded (dcp)"
)
_PARAM_DTYPE_HELP = (
    "what weights, gradients and AdamW moments are stored in; bf16 halves them (the original "
    "PyRecover's --model-dtype bf16; implies --model-dtype bf16)"
)
_AC_HELP = "recompute each layer's activations in backward: less memory, ~1/3 more compute"
_DETERMINISTIC_HELP = (
    "bitwise-reproducible GPU runs: deterministic kernels, no TF32, math attention (slower); "
    "CPU runs are deterministic anyway"
)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; validated on creation (messages say how to fix).

    The fields are the flags, in the order ``--help`` lists them.
    """

    # The original PyRecover's flags, and its other flags that have a meaning of their own here.
    dataset: str | None = ORIGINAL(
        None, "parquet file/dir/glob/URL", shown="the Shakespeare corpus", path=True
    )
    sequence_length: int = ORIGINAL(_TINY.sequence_length, "tokens per sample", check=positive_int)
    batch_size: int = ORIGINAL(
        _TINY.batch_size, "samples per rank per micro-step", check=positive_int
    )
    learning_rate: float = ORIGINAL(_TINY.learning_rate, "peak learning rate", check=positive())
    training_steps: int = ORIGINAL(
        _TINY.training_steps, "optimizer steps in total", check=positive_int
    )
    distributed: bool = ORIGINAL(False, "torch.distributed under torchrun, srun or mpirun")
    model_dtype: str = ORIGINAL(
        _TINY.model_dtype,
        "compute dtype; bf16/fp16 run over fp32 weights (see --param-dtype)",
        choices=DTYPES,
    )
    checkpoint_dir: str = ORIGINAL("checkpoints/", "local checkpoint root", path=True)
    checkpoint_frequency: int = ORIGINAL(
        10, "save every N steps, 0 or -1 = off", check=at_least_zero("0 or -1 turns it off")
    )
    resume_from_checkpoint: str | None = ORIGINAL(
        None, _RESUME_HELP, metavar="PATH|STEP|latest", shown="off", check=_resume_target
    )
    experiment_name: str = ORIGINAL(
        "default-exp",
        "folder under the checkpoint root (NAME or GROUP/NAME)",
        check=_experiment_name,
    )
    use_torch_distributed_ckpt: bool = ORIGINAL(
        False, "torch.distributed.checkpoint format (sharded)"
    )
    compile: bool = ORIGINAL(False, "torch.compile the model")
    fused_optimizer: bool = ORIGINAL(False, "fused AdamW")
    timeaware_checkpointing: bool = ORIGINAL(
        False, "always on here: a final save before the deadline"
    )
    default_iter_time: float | None = ORIGINAL(
        None,
        "the time budget's step estimate until a step is measured",
        type=_duration,
        shown=_MEASURED,
        check=positive(" seconds"),
    )
    default_ckpt_time: float | None = ORIGINAL(
        None,
        "the time budget's save estimate until a save is measured",
        type=_duration,
        shown=_GUESS,
        check=positive(" seconds"),
    )
    verify_checkpoints: bool = ORIGINAL(False, "always on here: every file is checksummed")
    use_flash_attention: bool = ORIGINAL(
        False, "accepted: SDPA picks FlashAttention kernels itself"
    )
    log_loss_to_csv: bool = ORIGINAL(False, "also write EXP_DIR/EXPERIMENT_loss_log.csv")
    profile: bool = ORIGINAL(
        False, "torch.profiler trace (and cudaProfilerStart/Stop) of the steps"
    )
    profile_step_start: int = ORIGINAL(10, "first profiled step", check=positive_int)
    profile_step_end: int = ORIGINAL(12, "last profiled step", check=positive_int)
    # Checkpointing.
    checkpoint_url: str | None = CHECKPOINTING(
        None, "any fsspec URL (s3://bucket/run); overrides --checkpoint-dir"
    )
    checkpoint_mirror: str | None = CHECKPOINTING(
        None, "second location every checkpoint is copied to", path=True
    )
    async_checkpoint: bool | None = CHECKPOINTING(None, _ASYNC_HELP, shown=_ASYNC_SHOWN)
    keep_last: int | None = CHECKPOINTING(
        3,
        "keep the newest N, 0 = all",
        type=_count_or_all,
        aliases=("max_kept_checkpoints",),
        check=at_least_zero("0 keeps all"),
    )
    keep_every: int | None = CHECKPOINTING(
        None,
        "also keep every checkpoint whose step is a multiple of N",
        type=_count_or_all,
        check=at_least_zero("0 turns it off"),
    )
    keep_best: int | None = CHECKPOINTING(
        None,
        "also keep the K with the lowest validation loss",
        type=_count_or_all,
        check=at_least_zero("0 keeps all"),
    )
    checkpoint_interval_seconds: float | str | None = CHECKPOINTING(
        None,
        "save every N seconds; auto = Young/Daly sqrt(2 * save cost * MTBF)",
        type=_interval,
        metavar="N|auto",
        check=_interval_value,
    )
    storage_options: dict[str, Any] | None = CHECKPOINTING(
        None, _STORAGE_HELP, type=_json_object, metavar="JSON"
    )
    mtbf: float = CHECKPOINTING(
        DEFAULT_MTBF,
        "mean time between failures for auto",
        type=_duration,
        check=positive(" seconds"),
    )
    # Time.
    time_limit: float | None = TIME(
        None, _TIME_LIMIT_HELP, type=_time_limit, shown="SLURM's deadline", check=positive()
    )
    stop_margin: float | None = TIME(
        None,
        _MARGIN_HELP,
        type=_duration,
        shown=_MARGIN_SHOWN,
        check=at_least_zero(unit=" seconds"),
    )
    extra_saves: bool = TIME(True, _EXTRA_HELP, shown="on")
    # Model, data, optimisation.
    model_size: str = TRAINING(DEFAULT_SIZE, "preset shape", choices=tuple(SIZES))
    tokenizer: str = TRAINING(
        _TINY.tokenizer,
        _TOKENIZER_HELP,
        aliases=("tokenizer_name_or_path",),
        check=_tokenizer_spec,
    )
    text_column: str = TRAINING("text", "parquet column with the text")
    cache_dir: str | None = TRAINING(
        None, "corpus/tokenizer/token cache", shown=_CACHE_SHOWN, path=True
    )
    seed: int = TRAINING(42, "weights, data order and RNG seed", check=between(0, MAX_SEED))
    grad_accum: int = TRAINING(1, "micro-batches per optimizer step", check=positive_int)
    warmup_steps: int = TRAINING(
        _TINY.warmup_steps,
        "linear warmup, then cosine",
        aliases=("lr_warmup_steps",),
        check=at_least_zero("0 turns it off"),
    )
    min_lr: float | None = TRAINING(None, "learning rate at the end of the cosine", shown="lr/10")
    weight_decay: float = TRAINING(0.1, "AdamW weight decay", check=at_least_zero("0 turns it off"))
    grad_clip: float = TRAINING(
        1.0,
        "clip the gradient norm, 0 = off",
        aliases=("grad_max_norm",),
        check=at_least_zero("0 turns it off"),
    )
    device: str = TRAINING("auto", "auto = CUDA when available", choices=DEVICES)
    # Parallelism, memory and reproducibility.
    parallelism: str = PARALLEL("ddp", _PARALLELISM_HELP, choices=PARALLELISMS)
    param_dtype: str | None = PARALLEL(
        None,
        _PARAM_DTYPE_HELP,
        choices=PARAM_DTYPES,
        shown="fp32 (fp64 with --model-dtype fp64)",
    )
    activation_checkpointing: bool = PARALLEL(False, _AC_HELP)
    deterministic: bool = PARALLEL(False, _DETERMINISTIC_HELP)
    # Observability and evaluation.
    log_every: int = OBSERVE(
        10,
        "steps between progress lines",
        aliases=("logging_frequency",),
        check=positive_int,
    )
    metrics: str | None = OBSERVE(
        None, "JSONL metrics file", shown="EXP_DIR/metrics.jsonl", path=True
    )
    wandb: bool = OBSERVE(False, "log to Weights & Biases (extra [wandb])")
    eval_every: int = OBSERVE(
        _TINY.eval_every,
        "validation every N steps, 0 = off",
        check=at_least_zero("0 turns it off"),
    )
    eval_batches: int = OBSERVE(8, "validation batches per rank", check=positive_int)
    val_fraction: float = OBSERVE(
        DEFAULT_VAL_FRACTION, "held-out share of the data", shown=_VAL_SHOWN, check=_fraction
    )
    peak_tflops: float | None = OBSERVE(
        None, "per-GPU peak for MFU", shown="the table of GPUs", check=positive()
    )
    dry_run: bool = OBSERVE(False, "one step, one save, one verified load, exit 0")
    # Which flags the user gave explicitly (recorded in checkpoint metadata).
    explicit: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.checkpoint_frequency == -1:
            self.checkpoint_frequency = 0  # the original PyRecover's spelling of "off"
        _check_numbers(self)
        for flag in FLAGS:
            value = getattr(self, flag.name)
            if flag.path and isinstance(value, str):
                value = _expand_home(value)
                setattr(self, flag.name, value)
            if value is not None:
                _check_value(flag, value)
        self._check_dtypes()
        self._check_combinations()
        _check_store(self)

    def _check_dtypes(self) -> None:
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

    def _check_combinations(self) -> None:
        """Two flags that leave no sane run: one line saying which, and what to give."""
        if self.min_lr is not None and not 0 <= self.min_lr <= self.learning_rate:
            raise ValueError(f"--min-lr must be between 0 and --learning-rate, got {self.min_lr}")
        if self.profile_step_end < self.profile_step_start:
            raise ValueError(
                f"--profile-step-end {self.profile_step_end} is before --profile-step-start "
                f"{self.profile_step_start}: give an end >= the start"
            )
        if not self.checkpoint_url and not self.checkpoint_dir:
            raise ValueError("--checkpoint-dir is empty: give a directory (default checkpoints/)")
        if self.eval_every and not self.val_fraction:
            raise ValueError("--eval-every needs a held-out split: pass --val-fraction > 0")
        if self.keep_best and not self.eval_every:
            raise ValueError("--keep-best ranks checkpoints by validation loss: set --eval-every N")
        if self.checkpoint_mirror:
            _check_mirror(self)

    def warnings(self) -> list[str]:
        """Contradictions between flags that still leave a sane run (a short test run, say):
        one line each, said once when the run starts. Flags the user did not give are not
        blamed, except where the run would surprise them (the warm-up)."""
        return [line for rule in WARNINGS if (line := rule(self)) is not None]

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
        ``step-00000042``) or a path/URL (a checkpoint folder, or another tool's checkpoint)."""
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


# --- the flags, as the fields declare them --------------------------------------------------------

SWITCH = None  # Flag.type of an on/off switch
_PARSERS: dict[str, Callable[[str], Any] | None] = {
    "int": _whole,
    "float": _finite,
    "str": str,
    "bool": SWITCH,
}


def _flag_of(f: Field[Any]) -> Flag:
    """The field's flag, with its name and parser filled in from the field."""
    flag: Flag = f.metadata["flag"]
    parse = flag.type
    if parse is None:
        base = str(f.type).removesuffix(" | None")
        if base not in _PARSERS:
            raise TypeError(f"TrainConfig.{f.name}: give type= (no parser for {f.type})")
        parse = _PARSERS[base]
    negatable = parse is SWITCH and f.default is not False
    return replace(flag, name=f.name, type=parse, negatable=negatable)


FLAGS: tuple[Flag, ...] = tuple(_flag_of(f) for f in fields(TrainConfig) if "flag" in f.metadata)
_FIELDS = {f.name: f for f in fields(TrainConfig)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _expand_home(value: str) -> str:
    """``--checkpoint-dir=~/ckpt``: the shell expands ``~`` only at the start of a word, so the
    flag's value keeps it; every local path means the same folder for every consumer."""
    if value.startswith("~") and "://" not in value:
        return os.path.expanduser(value)
    return value


def _check_value(flag: Flag, value: Any) -> None:
    if flag.choices is not None and value not in flag.choices:
        raise ValueError(
            f"unknown {_flag(flag.name)} {value!r}: pick one of " + ", ".join(flag.choices)
        )
    if flag.check is not None:
        flag.check(_flag(flag.name), value)


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
    """The checkpoint URLs, checked before any work (an unknown scheme, or one whose extra is
    not installed, fails here; no I/O)."""
    primary = "--checkpoint-url" if cfg.checkpoint_url else "--checkpoint-dir"
    for flag, url in ((primary, cfg.store_url), ("--checkpoint-mirror", cfg.checkpoint_mirror)):
        if not url:
            continue
        try:
            ckptstore.experiment_location(url, cfg.experiment_name, cfg.storage_options)
        except (ValueError, ImportError, ckptstore.CheckpointError) as e:
            raise ValueError(f"{flag} {url}: {first_line(e)}") from None


def _check_mirror(cfg: TrainConfig) -> None:
    """ckptstore's check of the mirror (not the experiment's own folder, nor inside or around
    it; a local folder this user can write), before any work. A URL that cannot be opened is
    left to :func:`_check_store`."""
    assert cfg.checkpoint_mirror is not None
    try:
        ckptstore.check_mirror(
            cfg.store_url,
            cfg.checkpoint_mirror,
            experiment=cfg.experiment_name,
            storage_options=cfg.storage_options,
            mirror_storage_options=cfg.storage_options,
        )
    except ckptstore.CheckpointError:
        return
    except ValueError as e:
        raise ValueError(f"--checkpoint-mirror {first_line(e)}") from None


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- the parser, generated from FLAGS -------------------------------------------------------------


def _default_text(flag: Flag) -> str | None:
    if flag.type is SWITCH or flag.shown is not None:
        return flag.shown  # a switch is off unless given, or decided at run time
    if flag.name in PRESET_FLAGS:
        return describe_preset(flag.name)
    default = _FIELDS[flag.name].default
    assert default is not MISSING  # every flag field has a default (a Section requires one)
    if default is None:
        return "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


_METAVARS: dict[Callable[[str], Any], str] = {
    _whole: "N",
    _count_or_all: "N",
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
    "`pyrecover-train import-checkpoint SOURCE [FLAGS]` imports another tool's checkpoint "
    "(torch.save, dcp.save, safetensors, Lightning, Hugging Face Trainer). Every flag is also "
    "accepted with underscores, as the original PyRecover spelled them (--experiment_name = "
    "--experiment-name). 'default: preset' = the default depends on "
    "--model-size: tiny and small are sized for a CPU, 125m and up take the original "
    "PyRecover's defaults; a flag you give always wins."
)


def build_parser(prog: str = "pyrecover-train") -> argparse.ArgumentParser:
    """The parser of :data:`FLAGS`. Defaults are SUPPRESSed: a flag not given stays out of the
    namespace, so presets fill it in and the config records what the user chose."""
    p = _Parser(
        prog=prog,
        usage=f"{prog} [train] [FLAGS] | {prog} report EXP_DIR | "
        f"{prog} import-checkpoint SOURCE [FLAGS]",
        description=DESCRIPTION,
        formatter_class=_OneSpelling,
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        group = groups.get(flag.group) or groups.setdefault(
            flag.group, p.add_argument_group(flag.group)
        )
        _add_flag(group, flag)
    return p


def _add_flag(group: argparse._ArgumentGroup, flag: Flag) -> None:
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
        metavar = flag.metavar or _METAVARS.get(flag.type)
        kwargs.update(type=flag.type, choices=flag.choices, metavar=metavar)
    group.add_argument(*names, **kwargs)
    if flag.negatable:
        group.add_argument(
            *spellings("no_" + flag.name),
            dest=flag.name,
            action="store_false",
            default=argparse.SUPPRESS,
            help=f"turn {spellings(flag.name)[0]} off",
        )


def config_from_args(argv: list[str] | None) -> TrainConfig:
    """Parse and validate; bad input raises :class:`UsageError` (argparse exits 2 by itself)."""
    given = vars(build_parser().parse_args(argv))
    values = preset_defaults(given.get("model_size", DEFAULT_SIZE))
    values.update(given)
    values.update(_derived_defaults(values, given))
    try:
        return TrainConfig(explicit=tuple(sorted(given)), **values)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _derived_defaults(values: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """Defaults that follow another flag's value, for the flags not given."""
    out: dict[str, Any] = {}
    if "val_fraction" not in given:  # a held-out split only when something evaluates on it
        out["val_fraction"] = DEFAULT_VAL_FRACTION if values.get("eval_every") else 0.0
    if values.get("param_dtype") == "bf16" and "model_dtype" not in given:
        out["model_dtype"] = "bf16"  # bf16 storage computes in bf16
    if "checkpoint_interval_seconds" in given and "checkpoint_frequency" not in given:
        out["checkpoint_frequency"] = 0  # a time interval replaces the step frequency
    return out


# --- contradictions that leave a sane run: said once when the run starts --------------------------


def _warmup_past_the_end(cfg: TrainConfig) -> str | None:
    warmup, steps, lr = cfg.warmup_steps, cfg.training_steps, cfg.learning_rate
    if warmup <= steps:
        return None
    whose = "" if "warmup_steps" in cfg.explicit else " (the default)"
    return (
        f"--warmup-steps {warmup}{whose} > --training-steps {steps}: the learning rate never "
        f"reaches --learning-rate {lr:g} (at most {lr * steps / warmup:.3g}, {steps}/{warmup} of "
        "it); give --warmup-steps below --training-steps (0 = no warm-up)"
    )


def _frequency_past_the_end(cfg: TrainConfig) -> str | None:
    every, steps = cfg.checkpoint_frequency, cfg.training_steps
    if "checkpoint_frequency" not in cfg.explicit or not every or every <= steps:
        return None
    return (
        f"--checkpoint-frequency {every} > --training-steps {steps}: no periodic save falls in "
        "the run (the final save still comes); give N <= --training-steps, or 0 to say so"
    )


def _profile_outside_the_run(cfg: TrainConfig) -> str | None:
    if not cfg.profile:
        given = [_flag(n) for n in ("profile_step_start", "profile_step_end") if n in cfg.explicit]
        if not given:
            return None
        return f"{' and '.join(given)} without --profile: nothing is profiled; add --profile"
    start, steps = cfg.profile_step_start, cfg.training_steps
    if start <= steps:
        return None
    return (
        f"--profile-step-start {start} > --training-steps {steps}: no step is profiled; give "
        f"steps within 1-{steps}"
    )


def _margin_takes_all_the_time(cfg: TrainConfig) -> str | None:
    """Sane only as a check that a resume works: it stops at its first chance, and saves."""
    limit, margin = cfg.time_limit, cfg.stop_margin
    if limit is None or margin is None or margin < limit:
        return None
    return (
        f"--stop-margin {margin:g} s keeps all of --time-limit {limit:g} s free: the run stops "
        "at its first stop decision (with a final save); give a margin below the limit, or "
        "leave it out (measured)"
    )


def _mtbf_unused(cfg: TrainConfig) -> str | None:
    if "mtbf" not in cfg.explicit or cfg.checkpoint_interval_seconds == "auto":
        return None
    return (
        "--mtbf is read by --checkpoint-interval-seconds auto only: it changes nothing here; "
        "add --checkpoint-interval-seconds auto, or drop --mtbf"
    )


def _validation_unused(cfg: TrainConfig) -> str | None:
    if cfg.eval_every:
        return None
    if "val_fraction" in cfg.explicit and cfg.val_fraction:
        return (
            f"--val-fraction {cfg.val_fraction:g} holds out data that no validation uses "
            "(--eval-every is 0): that share is not trained on; give --eval-every N, or drop "
            "--val-fraction"
        )
    if "eval_batches" in cfg.explicit:
        return "--eval-batches changes nothing with --eval-every 0 (no validation runs)"
    return None


WARNINGS: tuple[Callable[[TrainConfig], str | None], ...] = (
    _warmup_past_the_end,
    _frequency_past_the_end,
    _profile_outside_the_run,
    _margin_takes_all_the_time,
    _mtbf_unused,
    _validation_unused,
)

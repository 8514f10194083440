"""Flag parsing: both spellings, the original's defaults, presets, and every bad input (one line,
exit 2, nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyrecover_train.cli import main
from pyrecover_train.config import (
    PRESET_DEFAULTS,
    TrainConfig,
    UsageError,
    build_parser,
    config_from_args,
    parse_duration,
)

ORIGINAL_FLAGS = [
    "--dataset",
    "--sequence-length",
    "--batch-size",
    "--learning-rate",
    "--training-steps",
    "--distributed",
    "--model-dtype",
    "--checkpoint-dir",
    "--checkpoint-frequency",
    "--resume-from-checkpoint",
    "--experiment_name",
    "--use-torch-distributed-ckpt",
    "--compile",
    "--fused-optimizer",
]


def option_strings() -> set[str]:
    return {s for a in build_parser()._actions for s in a.option_strings}


@pytest.mark.parametrize("flag", ORIGINAL_FLAGS)
def test_every_original_flag_in_both_spellings(flag: str) -> None:
    opts = option_strings()
    assert flag in opts
    assert "--" + flag[2:].replace("-", "_") in opts
    assert "--" + flag[2:].replace("_", "-") in opts


def test_every_flag_has_both_spellings() -> None:
    opts = {o for o in option_strings() if o.startswith("--") and o != "--help"}
    for o in opts:
        assert "--" + o[2:].replace("-", "_") in opts and "--" + o[2:].replace("_", "-") in opts, o


def test_spellings_parse_alike() -> None:
    a = config_from_args(["--sequence-length", "64", "--experiment-name", "x", "--keep-last", "2"])
    b = config_from_args(["--sequence_length", "64", "--experiment_name", "x", "--keep_last", "2"])
    assert a == b
    assert a.sequence_length == 64 and a.experiment_name == "x" and a.keep_last == 2


def test_no_arguments_is_the_tiny_cpu_run() -> None:
    cfg = config_from_args([])
    assert cfg.model_size == "tiny"
    assert cfg.dataset is None  # the Shakespeare corpus
    assert cfg.checkpoint_dir == "checkpoints/" and cfg.experiment_name == "default-exp"
    assert cfg.checkpoint_frequency == 10
    assert cfg.exp_dir == Path("checkpoints/default-exp")
    assert cfg.metrics_path == Path("checkpoints/default-exp/metrics.jsonl")
    for key, value in PRESET_DEFAULTS["tiny"].items():
        assert getattr(cfg, key) == value
    assert cfg.explicit == ()


@pytest.mark.parametrize("size", ["125m", "350m", "1b", "8b"])
def test_original_model_sizes_take_the_original_defaults(size: str) -> None:
    cfg = config_from_args(["--model-size", size])
    assert cfg.sequence_length == 2048
    assert cfg.batch_size == 1
    assert cfg.learning_rate == 1e-5
    assert cfg.training_steps == 1000
    assert cfg.model_dtype == "bf16"
    assert cfg.checkpoint_frequency == 10
    assert cfg.resume_from_checkpoint is None
    assert not (
        cfg.distributed or cfg.compile or cfg.fused_optimizer or cfg.use_torch_distributed_ckpt
    )


def test_explicit_flags_beat_the_preset() -> None:
    cfg = config_from_args(
        ["--model-size", "8b", "--sequence-length", "4096", "--model-dtype", "fp32"]
    )
    assert cfg.sequence_length == 4096 and cfg.model_dtype == "fp32"
    assert set(cfg.explicit) == {"model_size", "sequence_length", "model_dtype"}


def test_interval_replaces_the_step_frequency_unless_both_given() -> None:
    assert config_from_args(["--checkpoint-interval-seconds", "auto"]).checkpoint_frequency == 0
    both = config_from_args(["--checkpoint-interval-seconds", "30", "--checkpoint-frequency", "5"])
    assert both.checkpoint_frequency == 5 and both.checkpoint_interval_seconds == 30.0


def test_checkpoint_frequency_minus_one_is_the_originals_off() -> None:
    # The original PyRecover: "If set to -1 no checkpoints are created."
    assert config_from_args(["--checkpoint-frequency", "-1"]).checkpoint_frequency == 0
    assert config_from_args(["--checkpoint_frequency=-1"]).checkpoint_frequency == 0
    assert config_from_args(["--checkpoint-frequency", "0"]).checkpoint_frequency == 0


def test_experiment_names_ckptstore_accepts_pass() -> None:
    for name in ("default-exp", "run_1.v2", "A" * 128):
        assert config_from_args(["--experiment_name", name]).experiment_name == name


def test_console_command_and_python_m_form() -> None:
    """`pyrecover-train` (the console script) and `python -m pyrecover_train` are one command."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    (ep,) = entry_points(group="console_scripts", name="pyrecover-train")
    assert ep.value == "pyrecover_train.cli:main" and ep.load() is main
    script = Path(sys.executable).parent / "pyrecover-train"
    for argv in ([str(script)], [sys.executable, "-m", "pyrecover_train"]):
        if argv[0] == str(script) and not script.exists():
            continue  # not installed as a script in this environment (e.g. a bare checkout)
        r = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "--experiment_name" in r.stdout, r.stderr
        r = subprocess.run([*argv, "--model-dtype", "fp8"], capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_keep_zero_means_keep_all_and_dcp_flag_picks_the_format() -> None:
    cfg = config_from_args(["--keep-last", "0", "--use_torch_distributed_ckpt"])
    assert cfg.keep_last is None and cfg.format == "dcp"


def test_remote_checkpoints_keep_metrics_local() -> None:
    cfg = config_from_args(["--checkpoint-url", "s3://bucket/runs", "--experiment_name", "e"])
    assert cfg.store_url == "s3://bucket/runs" and not cfg.store_is_local
    assert cfg.exp_dir == Path("runs/e")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("1.5", 1.5),
        ("2:30", 150),
        ("1:00:00", 3600),
        ("1-00:00:00", 86400),
        ("1-2", 93600),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


BAD = [
    (["--model-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--training-steps", "0"], "--training-steps must be a positive integer"),
    (["--training_steps", "-5"], "--training-steps must be a positive integer"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--sequence-length", "-1"], "--sequence-length must be a positive integer"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer"),
    (["--learning-rate", "0"], "--learning-rate must be positive"),
    (["--experiment_name", "a/b"], "must be a plain folder name"),
    (["--experiment_name", ".."], "must be a plain folder name"),
    (["--experiment_name", "x..y"], "must be a plain folder name"),
    (["--experiment-name", ""], "must be a plain folder name"),
    (["--experiment_name", "my run"], "use letters, digits, '.', '_' and '-'"),
    (["--experiment_name", "_x"], "starting with a letter or digit"),
    (["--experiment_name", "x" * 129], "(at most 128)"),
    (["--checkpoint-frequency", "-2"], "--checkpoint-frequency must be >= 0 (0 or -1 turns it"),
    (["--time-limit", "soon"], "is not a duration"),
    (["--time-limit", "0"], "--time-limit must be positive"),
    (["--checkpoint-interval-seconds", "often"], "neither seconds nor 'auto'"),
    (["--checkpoint-interval-seconds", "-3"], "must be positive"),
    (["--keep-best", "2", "--eval-every", "0"], "--keep-best ranks checkpoints by validation loss"),
    (["--eval-every", "5", "--val-fraction", "0"], "--eval-every needs a held-out split"),
    (["--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
    (["--model-size", "huge"], "invalid choice: 'huge'"),
    (["--storage-options", "{nope"], "not JSON"),
    (["--storage-options", "[1]"], "must be a JSON object"),
    (["--no-such-flag"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    assert main([*argv, "--checkpoint-dir", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not ckpt.exists()  # a refused start writes nothing


def test_usage_error_messages_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="pick one of fp16, bf16, fp32, fp64"):
        TrainConfig(model_dtype="fp8")
    with pytest.raises(ValueError, match="no '/'"):
        TrainConfig(experiment_name="../up")
    with pytest.raises(UsageError, match="--warmup-steps must be >= 0"):
        config_from_args(["--warmup-steps", "-1"])


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--experiment_name" in out and "Exit status" in out

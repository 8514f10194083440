"""Flag parsing: both spellings, the original's defaults, presets, and every bad input (one line,
exit 2, nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyrecover_train.cli import main
from pyrecover_train.config import (
    FLAGS,
    TrainConfig,
    UsageError,
    _duration,
    _finite,
    build_parser,
    config_from_args,
)
from pyrecover_train.sizes import preset_defaults

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
    # where ckptstore lays the experiment out: an absolute folder
    assert cfg.exp_dir == Path.cwd() / "checkpoints/default-exp"
    assert cfg.metrics_path == Path.cwd() / "checkpoints/default-exp/metrics.jsonl"
    for key, value in preset_defaults("tiny").items():
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
    """ckptstore's rule is the one rule (issue 15): GROUP/NAME is a folder in a folder."""
    for name in ("default-exp", "run_1.v2", "A" * 128, "team/run-1", "x..y"):
        assert config_from_args(["--experiment_name", name]).experiment_name == name
    cfg = config_from_args(["--experiment_name", "team/run-1", "--checkpoint-dir", "/ck"])
    assert cfg.exp_dir == Path("/ck/team/run-1") and cfg.experiment_url == "/ck/team/run-1"


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
        ("90", 5400),  # a bare number is minutes, as in sbatch --time
        ("2:30", 180),  # minutes:seconds, rounded up to whole minutes as SLURM does
        ("1:00:00", 3600),
        ("1-00:00:00", 86400),
        ("1-2", 93600),
        ("2-3:04", 2 * 86400 + 3 * 3600 + 4 * 60),  # SLURM's D-HH:MM, not D-MM:SS
        ("30s", 30),  # or a duration with a unit
        ("15m", 900),
        ("2h", 7200),
    ],
)
def test_time_limit_reads_slurm_time(text: str, seconds: float) -> None:
    """--time-limit reads what sbatch --time reads (slurmclock's parse_time_limit)."""
    assert config_from_args(["--time-limit", text]).time_limit == seconds


def test_durations_are_seconds_or_units() -> None:
    """The other duration flags read human durations: a bare number is seconds."""
    assert config_from_args(["--stop-margin", "90"]).stop_margin == 90
    assert config_from_args(["--stop-margin", "1m30s"]).stop_margin == 90


BAD = [
    (["--model-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--training-steps", "0"], "--training-steps must be a positive integer"),
    (["--training_steps", "-5"], "--training-steps must be a positive integer"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--sequence-length", "-1"], "--sequence-length must be a positive integer"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer"),
    (["--learning-rate", "0"], "--learning-rate must be positive"),
    (["--experiment_name", "a//b"], "--experiment_name: experiment 'a//b' is not a valid name"),
    (["--experiment_name", ".."], "it must stay inside the root"),
    (["--experiment_name", "../up"], "it must stay inside the root"),
    (["--experiment_name", "/abs"], "(and '/' between parts)"),
    (["--experiment-name", ""], "--experiment_name: experiment '' is not a valid name"),
    (["--experiment_name", "my run"], "use letters, digits, '.', '_', '-'"),
    (["--experiment_name", "_x"], "starting with a letter or digit"),
    (["--experiment_name", "x" * 129], "at most 128 characters"),
    (["--checkpoint-url", "nosuch://x"], "--checkpoint-url nosuch://x: "),
    (["--checkpoint-mirror", "nosuch://x"], "--checkpoint-mirror nosuch://x: "),
    (["--resume-from-checkpoint", "1" * 20], "step must be an integer in [0, 1e15)"),
    (["--resume-from-checkpoint", ""], "--resume-from-checkpoint '': empty (give 'latest'"),
    (["--tokenizer", "bpe:lots"], "--tokenizer bpe:lots: bad tokenizer spec"),
    (["--tokenizer", "gpt2-xl"], "unknown tokenizer 'gpt2-xl'"),
    (["--checkpoint-frequency", "-2"], "--checkpoint-frequency must be >= 0 (0 or -1 turns it"),
    (["--time-limit", "soon"], "is not a time limit"),
    (["--time-limit", "-2"], "'-2' is negative"),
    (["--time-limit", "0"], "'0' means no time limit; leave --time-limit out"),
    (["--stop-margin", "1:30"], "is a SLURM time string (2 min to sbatch --time)"),
    (["--checkpoint-interval-seconds", "often"], "neither seconds nor 'auto'"),
    (["--checkpoint-interval-seconds", "-3"], "must be positive"),
    (["--keep-best", "2", "--eval-every", "0"], "--keep-best ranks checkpoints by validation loss"),
    (["--eval-every", "5", "--val-fraction", "0"], "--eval-every needs a held-out split"),
    (["--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
    (["--model-size", "huge"], "invalid choice: 'huge'"),
    (["--storage-options", "{nope"], "not JSON"),
    (["--storage-options", "[1]"], "must be a JSON object"),
    (["--no-such-flag"], "unrecognized arguments"),
    # Two flags that leave no sane run (issue 24): an error naming both.
    (["--checkpoint-mirror", "CKPT"], "is the checkpoint location itself: give a second"),
    # issue 30: a mirror inside the experiment (one failure domain), or where nothing can be
    # written, was accepted and the run ended exit 0 with nothing ever mirrored
    (["--checkpoint-mirror", "CKPT/default-exp/m"], "is inside the experiment's own folder"),
    (["--checkpoint-mirror", "/proc/1/m"], "/proc/1 cannot be written by this user"),
    (["--param-dtype", "bf16", "--model-dtype", "fp32"], "--param-dtype bf16 computes in bf16"),
    (["--min-lr", "1", "--learning-rate", "0.1"], "--min-lr must be between 0 and --learning-rate"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    argv = [a.replace("CKPT", str(ckpt)) for a in argv]
    assert main([*argv, "--checkpoint-dir", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert not ckpt.exists()  # a refused start writes nothing


def test_usage_error_messages_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="pick one of fp16, bf16, fp32, fp64"):
        TrainConfig(model_dtype="fp8")
    with pytest.raises(ValueError, match="it must stay inside the root"):
        TrainConfig(experiment_name="../up")
    with pytest.raises(UsageError, match="--warmup-steps must be >= 0"):
        config_from_args(["--warmup-steps", "-1"])


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--experiment_name" in out and "Exit status" in out


# -- issue 14: every float refuses NaN/inf, ints fit int64, seeds fit numpy ----------------------

FLOAT_FLAGS = sorted("--" + f.name.replace("_", "-") for f in FLAGS if f.type is _finite)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_every_float_flag_refuses_nan_and_inf(
    flag: str, value: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--grad-clip nan` used to turn clipping off silently (NaN is neither < 0 nor > 0)."""
    assert main([f"{flag}={value}", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert f"{value!r} is not a finite number" in err and flag in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_the_float_flags_are_the_ones_users_hit() -> None:
    assert {"--grad-clip", "--weight-decay", "--peak-tflops", "--learning-rate"} <= set(FLOAT_FLAGS)
    assert {"--stop-margin", "--default-ckpt-time", "--mtbf"} <= set(DURATION_FLAGS)


DURATION_FLAGS = sorted("--" + f.name.replace("_", "-") for f in FLAGS if f.type is _duration)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("nan", "give seconds (5400, 1.5) or a unit"),
        ("inf", "give seconds (5400, 1.5) or a unit"),
        ("-5", "must be a finite number of seconds >= 0"),
        ("1:75", "is a SLURM time string (3 min to sbatch --time)"),
        ("30m1h", "give each unit once, largest first (1h30m)"),
    ],
)
@pytest.mark.parametrize("flag", DURATION_FLAGS)
def test_every_duration_flag_refuses_what_is_not_a_duration(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([f"{flag}={value}", "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert says in err and flag in err, err  # what was wrong and what to write instead
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_the_python_api_refuses_nan_too() -> None:
    with pytest.raises(ValueError, match="--grad-clip must be a finite number, got nan"):
        TrainConfig(grad_clip=float("nan"))
    with pytest.raises(ValueError, match="--checkpoint-interval-seconds must be a finite"):
        TrainConfig(checkpoint_interval_seconds=float("inf"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
        (["--seed", str(2**32)], "--seed must be between 0 and 4294967295"),
        (["--seed", "99999999999999999999"], "is too large (at most 9223372036854775807)"),
        (["--training-steps", "1e23", "--dry-run"], "'1e23' is too large"),
        (["--training-steps", str(10**23), "--dry-run"], "is too large"),
        (["--training-steps", "2.5"], "'2.5' is not a whole number"),
        (["--batch-size", "many"], "'many' is not a whole number"),
        (["--keep-every", "-1"], "--keep-every must be >= 0 (0 turns it off)"),
        (["--profile-step-start", "5", "--profile-step-end", "4"], "is before --profile-step"),
        (["--default-ckpt-time", "0"], "--default-ckpt-time must be positive seconds"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_out_of_range_numbers_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*argv, "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_whole_numbers_may_be_written_as_powers_of_ten() -> None:
    assert config_from_args(["--training-steps", "1e3"]).training_steps == 1000
    assert config_from_args(["--seed", "4294967295"]).seed == 2**32 - 1


def test_home_in_a_flag_value_is_expanded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--checkpoint-dir=~/ckpt`: the shell leaves `~` in place after `=`; metrics and train.log
    must go where the checkpoints go ($HOME/ckpt), not to a folder literally named `~`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config_from_args(["--checkpoint-dir=~/ckpt", "--cache-dir=~/cache"])
    assert cfg.checkpoint_dir == str(tmp_path / "ckpt")
    assert cfg.exp_dir == tmp_path / "ckpt" / "default-exp"
    assert cfg.metrics_path == tmp_path / "ckpt" / "default-exp" / "metrics.jsonl"
    assert cfg.cache_dir == str(tmp_path / "cache")
    assert config_from_args(["--metrics", "~/m.jsonl"]).metrics_path == tmp_path / "m.jsonl"


# -- the original PyRecover's flags, with their meaning ------------------------------------------

ORIGINAL_HELP_FLAGS = {
    # The original's --help: flag -> (field here, a value, what it must become).
    "--tokenizer-name-or-path": ("tokenizer", "tok/tokenizer.json", "tok/tokenizer.json"),
    "--lr-warmup-steps": ("warmup_steps", "7", 7),
    "--logging-frequency": ("log_every", "3", 3),
    "--grad-max-norm": ("grad_clip", "0.5", 0.5),
    "--max-kept-checkpoints": ("keep_last", "5", 5),
    "--default-iter-time": ("default_iter_time", "2", 2.0),
    "--default-ckpt-time": ("default_ckpt_time", "30", 30.0),
    "--profile-step-start": ("profile_step_start", "3", 3),
    "--profile-step-end": ("profile_step_end", "20", 20),
}
ORIGINAL_SWITCHES = {
    "--timeaware-checkpointing": "timeaware_checkpointing",
    "--verify-checkpoints": "verify_checkpoints",
    "--use_flash_attention": "use_flash_attention",
    "--log-loss-to-csv": "log_loss_to_csv",
    "--profile": "profile",
}


@pytest.mark.parametrize("flag", sorted(ORIGINAL_HELP_FLAGS))
def test_the_originals_other_flags_keep_their_meaning(flag: str) -> None:
    name, value, want = ORIGINAL_HELP_FLAGS[flag]
    for spelling in (flag, flag.replace("-", "_").replace("__", "--")):
        assert getattr(config_from_args([spelling, value]), name) == want


@pytest.mark.parametrize("flag", sorted(ORIGINAL_SWITCHES))
def test_the_originals_switches_are_accepted(flag: str) -> None:
    cfg = config_from_args([flag])
    assert getattr(cfg, ORIGINAL_SWITCHES[flag]) is True
    assert ORIGINAL_SWITCHES[flag] in cfg.explicit


def test_the_originals_readme_command_parses() -> None:
    line = (
        "--sequence-length 4096 --batch-size 1 --learning-rate 5e-5 --lr-warmup-steps 100 "
        "--training-steps 1000 --logging-frequency 10 --checkpoint-frequency 100 "
        "--experiment_name my-exp --timeaware-checkpointing --default-iter-time 1.5 "
        "--default-ckpt-time 20 --use_flash_attention --max-kept-checkpoints 2 "
        "--verify-checkpoints --model-dtype bf16 --compile --fused-optimizer"
    )
    cfg = config_from_args(line.split(" "))
    assert (cfg.warmup_steps, cfg.log_every, cfg.keep_last) == (100, 10, 2)
    assert cfg.default_ckpt_time == 20.0 and cfg.timeaware_checkpointing


def test_keep_every() -> None:
    assert config_from_args(["--keep-every", "100"]).keep_every == 100
    assert config_from_args(["--keep-every", "0"]).keep_every is None  # 0 = off


def test_help_shows_one_spelling_and_says_what_preset_and_report_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert len(listed) > 40 and not [f for f in listed if "_" in f], listed
    assert "pyrecover-train report EXP_DIR" in out and "import-checkpoint" in out
    assert "'default: preset' = the default depends on --model-size" in out
    assert "(default: preset: tiny 128, small 256, 125m and up 2048)" in " ".join(out.split())
    assert "(default: preset: tiny/small fp32, 125m and up bf16)" in " ".join(out.split())


# -- issue 24: contradictions that leave a sane run are said, once ------------------------------

WARNED = [
    (
        ["--warmup-steps", "100", "--training-steps", "3"],
        "--warmup-steps 100 > --training-steps 3: the learning rate never reaches --learning-rate "
        "0.003 (at most 9e-05, 3/100 of it); give --warmup-steps below --training-steps",
    ),
    (["--training-steps", "3"], "--warmup-steps 40 (the default) > --training-steps 3"),
    (
        ["--checkpoint-frequency", "500", "--training-steps", "100"],
        "--checkpoint-frequency 500 > --training-steps 100: no periodic save falls in the run",
    ),
    (
        ["--profile", "--training-steps", "8", "--warmup-steps", "0"],
        "--profile-step-start 10 > --training-steps 8: no step is profiled; give steps within 1-8",
    ),
    (["--profile-step-start", "3"], "--profile-step-start without --profile: nothing is profiled"),
    (["--mtbf", "2h"], "--mtbf is read by --checkpoint-interval-seconds auto only"),
    (
        ["--time-limit", "60s", "--stop-margin", "1m"],
        "--stop-margin 60 s keeps all of --time-limit 60 s free: the run stops at its first",
    ),
    (["--eval-every", "0", "--val-fraction", "0.1"], "--val-fraction 0.1 holds out data that no"),
    (["--eval-every", "0", "--eval-batches", "4"], "--eval-batches changes nothing with"),
]


@pytest.mark.parametrize(("argv", "said"), WARNED, ids=[" ".join(a) for a, _ in WARNED])
def test_a_contradiction_with_a_sane_run_is_one_warning(argv: list[str], said: str) -> None:
    (line,) = config_from_args(argv).warnings()
    assert said in line and "\n" not in line


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model-size", "small"],
        ["--model-size", "8b"],
        ["--warmup-steps", "3", "--training-steps", "3"],  # peaks at the last step
        ["--training-steps", "3", "--warmup-steps", "0"],
        ["--checkpoint-frequency", "50", "--training-steps", "50"],
        ["--training-steps", "3", "--warmup-steps", "1"],  # the default frequency is not blamed
        ["--profile", "--profile-step-start", "2", "--profile-step-end", "3"],
        ["--mtbf", "2h", "--checkpoint-interval-seconds", "auto"],
        ["--eval-every", "5", "--val-fraction", "0.1", "--eval-batches", "2"],
        ["--eval-every", "0"],
        ["--time-limit", "60s", "--stop-margin", "59"],
    ],
    ids=lambda a: " ".join(a) or "no arguments",
)
def test_consistent_flags_and_the_presets_say_nothing(argv: list[str]) -> None:
    assert config_from_args(argv).warnings() == []


def test_help_states_the_stop_margin_slurmclock_uses(capsys: pytest.CaptureFixture[str]) -> None:
    """The shown default is read from slurmclock's defaults (it said 10 s after they were 5)."""
    from slurmclock import BudgetConfig
    from slurmclock.budget import EXIT_GUESS, EXIT_GUESS_BASE, EXIT_PER_LAUNCH

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    b = BudgetConfig()
    assert (
        f"(until one is measured: {EXIT_GUESS_BASE:g} s + {EXIT_PER_LAUNCH:g} x the measured "
        f"launch on one node, else {EXIT_GUESS:g} s) + {b.slack:g} s slack"
    ) in text

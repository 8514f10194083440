"""pyrecover-train end to end, as users run it (subprocesses where signals and kills matter,
in-process where only the outcome does): a run to completion, bitwise resume after graceful stops
and SIGKILLs, async checkpoints, refusals that touch nothing, --dry-run, and the report."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from train_helpers import (
    OwnSpeed,
    assert_bitwise_equal,
    child_env,
    events,
    final_state,
    line_count,
    run_cli,
    run_torchrun,
    start_cli,
    tiny_flags,
    wait_for_step,
)

import ckptstore
from pyrecover_train.cli import main
from pyrecover_train.state import tensors_equal

STEPS = 24
EVERY = 4


def flags(corpus: Path, cache: Path, ckpt: Path, *extra: str) -> list[str]:
    return tiny_flags(
        corpus,
        cache,
        ckpt,
        "--training-steps",
        str(STEPS),
        "--checkpoint-frequency",
        str(EVERY),
        "--keep-last",
        "2",
        *extra,
    )


@pytest.fixture(scope="module")
def straight(corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that never stops: the reference for the bitwise comparisons."""
    ckpt = tmp_path_factory.mktemp("straight")
    r = run_cli(flags(corpus, cache_dir, ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    return ckpt


def test_run_to_completion(straight: Path) -> None:
    evs = events(straight)
    kinds = [e["event"] for e in evs]
    assert kinds[0] == "start" and kinds[-1] == "stop"
    assert evs[-1]["cause"] == "done" and evs[-1]["exit_code"] == 0 and evs[-1]["step"] == STEPS
    steps = [e for e in evs if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"]  # it learns
    assert all(e["tokens_per_s"] > 0 and e["mfu"] is None for e in steps)  # no MFU on CPU
    saved = [e for e in evs if e["event"] == "saved"]
    assert [e["step"] for e in saved] == list(range(EVERY, STEPS + 1, EVERY))
    for e in saved:
        assert e["bytes"] > 0 and e["total_s"] >= 0 and e["durable_at"] > 0 and e["url"]
    # --keep-last 2: older checkpoints were pruned, the newest kept.
    manifest, _ = final_state(straight)
    assert manifest.step == STEPS
    assert manifest.metadata["model"]["dim"] == 128 and manifest.metadata["world_size"] == 1
    store = ckptstore.CheckpointStore(str(straight), experiment="default-exp")
    assert [i.step for i in store.list()] == [STEPS - EVERY, STEPS]
    store.close()
    assert (straight / "default-exp" / "train.log").read_text().count("finished: step 24/24") == 1


def test_report_on_a_real_run(straight: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(straight / "default-exp")]) == 0
    out = capsys.readouterr().out
    assert f"step {STEPS}/{STEPS} over 1 run(s)" in out and "lost steps 0" in out
    assert "goodput" in out and "checkpoint overhead" in out
    assert (straight / "default-exp" / "report.png").stat().st_size > 10_000


def interrupt(args: list[str], metrics: Path, how: str, rnd: random.Random) -> int:
    """Start a resumed run and stop it with ``how`` once it made some progress; returns the
    exit status."""
    start = line_count(metrics)
    proc = start_cli(args)
    try:
        first = wait_for_step(proc, metrics, start, 1)
        wait_for_step(proc, metrics, start, first + rnd.randint(0, 3))
        time.sleep(rnd.uniform(0, 0.05))  # mid-step, or mid-save
        proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGUSR2)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.stdout.close()
    if how == "kill":
        assert proc.returncode == -signal.SIGKILL, out
    else:
        assert proc.returncode == 75, out
        assert "stopping early (stop: received SIGUSR2" in out
    return proc.returncode


@pytest.mark.parametrize("mode", ["blocking", "async", "deterministic"])
def test_bitwise_resume_after_stops_and_kills(
    mode: str, straight: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Stopped for time, SIGKILLed (mid-step or mid-save), stopped by SIGUSR2, resumed each
    time: bitwise the straight run. async: overlapped saves (the snapshot beside the next
    step's forward and backward). deterministic: --deterministic with async saves, bitwise the
    default's straight run too (the same kernels on CPU)."""
    ckpt = tmp_path / "ckpt"
    extra = {
        "blocking": [],
        "async": ["--async-checkpoint"],
        "deterministic": ["--deterministic", "--async-checkpoint"],
    }[mode]
    base = flags(corpus, cache_dir, ckpt, *extra)
    resume = [*base, "--resume-from-checkpoint", "latest"]
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    rnd = random.Random({"blocking": 1234, "async": 4321, "deterministic": 2718}[mode])
    # Graceful stop for time: a 1 s limit is spent by start-up, so the run stops after one step.
    r = run_cli([*base, "--time-limit", "1s", "--stop-margin", "0"])
    assert r.returncode == 75, r.stdout + r.stderr
    assert "stopping early (stop:" in r.stdout
    interrupt(resume, metrics, "kill", rnd)
    if mode == "blocking":
        interrupt(resume, metrics, "usr2", rnd)
        r = run_cli([*resume, "--time-limit", "1s", "--stop-margin", "0"])
        assert r.returncode == 75, r.stdout + r.stderr
    interrupt(resume, metrics, "kill", rnd)
    r = run_cli(resume)
    assert r.returncode == 0, r.stdout + r.stderr

    _, want = final_state(straight)
    manifest, got = final_state(ckpt)
    assert manifest.step == STEPS
    assert_bitwise_equal(want, got)

    evs = events(ckpt)
    resumes = [e for e in evs if e["event"] == "resume"]
    assert len(resumes) == (5 if mode == "blocking" else 3)
    if mode == "deterministic":
        assert "deterministic on (warn only) on cpu" in r.stdout  # the last run's set-up
    assert all(e["reason"].startswith("resumed from step") for e in resumes)
    causes = [e["cause"] for e in evs if e["event"] == "stop"]
    want_causes = ["time", "signal", "time", "done"] if mode == "blocking" else ["time", "done"]
    assert causes == want_causes


def test_a_resume_materialises_the_model_from_the_checkpoint(
    corpus: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh start initialises the weights (once); a resume builds the model on the meta
    device and its weights come from the checkpoint alone: nothing is initialised only to be
    overwritten. Either way the result is the straight run's (the bitwise tests above)."""
    from pyrecover_train.model import GPT

    seeds: list[int] = []
    init = GPT.init_weights
    monkeypatch.setattr(GPT, "init_weights", lambda m, seed: (seeds.append(seed), init(m, seed)))
    argv = tiny_flags(corpus, cache_dir, tmp_path, "--seed", "7")
    assert main([*argv, "--training-steps", "2"]) == 0
    assert seeds == [7]
    assert main([*argv, "--training-steps", "3", "--resume-from-checkpoint", "latest"]) == 0
    assert seeds == [7]  # the resume initialised nothing
    assert final_state(tmp_path)[0].step == 3


def test_refuses_to_start_over_existing_checkpoints(
    straight: Path, corpus: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(straight)
    assert main(flags(corpus, cache_dir, straight)) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints (latest step 24)" in err
    assert "--resume-from-checkpoint latest" in err
    assert snapshot(straight) == before


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_checkpoint_of_another_shape_is_refused(
    straight: Path, corpus: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(straight)
    argv = flags(
        corpus, cache_dir, straight, "--model-size", "small", "--resume-from-checkpoint", "latest"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "another model shape" in err and "dim: 128 in the checkpoint != 384 here" in err
    assert "n_layers: 4 in the checkpoint != 6 here" in err
    assert len(err.splitlines()) == 1
    assert snapshot(straight) == before


def test_resume_when_already_finished_is_a_no_op(
    straight: Path, corpus: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {k: v for k, v in snapshot(straight).items() if "step-" in k}
    assert main([*flags(corpus, cache_dir, straight), "--resume-from-checkpoint", "latest"]) == 0
    assert "already at step 24 of 24: nothing to do" in capsys.readouterr().out
    assert {k: v for k, v in snapshot(straight).items() if "step-" in k} == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--resume-from-checkpoint", "/no/such/step-00000004"], "no such checkpoint"),
        (["--dataset", "/no/such/data.parquet"], "--dataset/--tokenizer:"),
        (["--distributed"], "--distributed needs a launcher"),
        (["--tokenizer", "/no/such/tokenizer.json"], "no such file"),
        (["--param-dtype", "bf16", "--model-dtype", "fp32"], "--param-dtype bf16 computes in bf16"),
        (["--parallelism", "fsdp", "--model-dtype", "fp16"], "does not support --model-dtype fp16"),
        (["--parallelism", "zero3"], "invalid choice: 'zero3'"),
    ],
)
def test_bad_start_is_one_line_exit_2_and_writes_nothing(
    extra: list[str],
    message: str,
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    ckpt = tmp_path / "ckpt"
    assert main([*flags(corpus, cache_dir, ckpt), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1, err
    assert not ckpt.exists()


def test_dry_run(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    assert main([*flags(corpus, cache_dir, ckpt), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run OK: 1 step" in out and "verified, read back equal" in out
    # Nothing stays: no checkpoint, no scratch experiment, no metrics or log (the console has
    # its lines).
    assert not (ckpt / "default-exp").exists() and not list(ckpt.glob("*dry-run*"))
    store = ckptstore.CheckpointStore(str(ckpt), experiment="default-exp")
    assert store.latest_step() is None
    store.close()
    # ... so the real run starts afterwards without --resume-from-checkpoint.
    assert main([*flags(corpus, cache_dir, ckpt), "--training-steps", "2"]) == 0


def test_distributed_run_then_resume_on_one_process(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """2 processes (torchrun, gloo, DCP format) for 6 steps, then 1 process resumes: the data
    continues at the global position the two ranks reached together."""
    ckpt = tmp_path / "ckpt"
    base = tiny_flags(
        corpus, cache_dir, ckpt, "--use-torch-distributed-ckpt", "--checkpoint-frequency", "3"
    )
    evaluated = ["--eval-every", "3", "--val-fraction", "0.1"]
    r = run_torchrun(["--distributed", *base, "--training-steps", "6", *evaluated])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    manifest, state = final_state(ckpt)
    assert manifest.world_size == 2 and manifest.format == "dcp" and manifest.step == 6
    assert set(state["rng"]) == {"rank0", "rank1"}
    assert tensors_equal(state["rng"]["rank0"], state["rng"]["rank1"]) != []  # per-rank seeds
    batch = 4
    assert state["data"]["position"] == 6 * 2 * batch
    two = events(ckpt)
    assert [e["step"] for e in two if e["event"] == "eval"] == [3, 6]  # rank 0 logs only
    assert next(e for e in two if e["event"] == "start")["world_size"] == 2

    again = ["--training-steps", "10", "--resume-from-checkpoint", "latest"]
    r = run_cli([*base, *again, "--val-fraction", "0.1"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world size changed (2 in the checkpoint, 1 now)" in r.stdout
    evs = events(ckpt)
    resume = next(e for e in evs if e["event"] == "resume")
    assert resume["step"] == 6 and resume["data_state"]["position"] == 6 * 2 * batch
    last = [e for e in evs if e["event"] == "step"][-1]
    assert last["step"] == 10 and last["data_position"] == 6 * 2 * batch + 4 * batch
    manifest, _ = final_state(ckpt)
    assert manifest.world_size == 1 and manifest.step == 10


def test_keep_best_evaluation_and_wandb_off(
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--keep-best saves at every evaluation and keeps the lowest validation losses besides the
    newest; --wandb without wandb (or credentials) only warns."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(
        corpus, cache_dir, ckpt, "--training-steps", "12", "--checkpoint-frequency", "0"
    )
    argv += ["--eval-every", "3", "--val-fraction", "0.1", "--keep-best", "2", "--keep-last", "1"]
    assert main([*argv, "--wandb"]) == 0
    out = capsys.readouterr().out
    assert "--wandb: not logging to Weights & Biases" in out
    if importlib.util.find_spec("wandb") is None:  # not credentials: the package (issue 30)
        assert "not logging to Weights & Biases: wandb is not installed: pip install wandb" in out
    evs = events(ckpt)
    evals = {e["step"]: e["val_loss"] for e in evs if e["event"] == "eval"}
    assert sorted(evals) == [3, 6, 9, 12]
    assert [e["step"] for e in evs if e["event"] == "save"] == [3, 6, 9, 12]
    store = ckptstore.CheckpointStore(str(ckpt), experiment="default-exp")
    kept = {i.step: i.metadata.get("val_loss") for i in store.list()}
    store.close()
    best_two = sorted(evals, key=evals.__getitem__)[:2]
    assert set(kept) == {12, *best_two}
    assert all(kept[s] == evals[s] for s in kept)


def test_time_interval_saves(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "5", "--keep-last", "0")
    assert main([*argv, "--checkpoint-interval-seconds", "0.000001"]) == 0
    saves = [(e["step"], e["kind"]) for e in events(ckpt) if e["event"] == "save"]
    assert saves == [
        (1, "periodic"),
        (2, "periodic"),
        (3, "periodic"),
        (4, "periodic"),
        (5, "final"),
    ]


def test_fp16_checkpoints_its_grad_scaler(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    from pyrecover_train.precision import _cpu_autocast_works

    if not _cpu_autocast_works(__import__("torch").float16):
        pytest.skip("this CPU/torch build cannot run fp16 autocast (refusal tested in test_parts)")
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "3", "--model-dtype", "fp16")
    assert main(argv) == 0
    _, state = final_state(ckpt)
    assert state["scaler"]["scale"] > 0 and "_growth_tracker" in state["scaler"]
    weights = state["model"]["tok_embeddings.weight"]
    assert str(weights.dtype) == "torch.float32"  # fp32 master weights under fp16 autocast


def test_divergence_stops_without_saving_over_good_checkpoints(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resumed run with a far too high --learning-rate (this run's flag wins over the
    checkpoint's) diverges: it stops with exit 1 and the good checkpoint stays the latest."""
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--checkpoint-frequency", "2", "--grad-clip", "0")
    assert main([*argv, "--training-steps", "4"]) == 0
    _, good = final_state(ckpt)
    capsys.readouterr()
    bad = ["--training-steps", "30", "--learning-rate", "1e30", "--warmup-steps", "0"]
    assert main([*argv, *bad, "--resume-from-checkpoint", "latest"]) == 1
    captured = capsys.readouterr()
    assert "--learning-rate 1e+30 replaces the checkpoint's 0.003" in captured.out
    err = captured.err.strip()
    assert "NaN/inf at step" in err or "the loss is nan at step" in err
    assert len(err.splitlines()) == 1
    stop = events(ckpt)[-1]
    assert stop["event"] == "stop" and stop["cause"] == "error" and stop["exit_code"] == 1
    manifest, state = final_state(ckpt)
    assert manifest.step == 4
    assert tensors_equal(state["model"], good["model"]) == []


def test_cuda_requested_without_cuda_is_a_usage_error(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    ckpt = tmp_path / "ckpt"
    assert main([*flags(corpus, cache_dir, ckpt), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "CUDA is not available" in err and len(err.splitlines()) == 1
    assert not ckpt.exists()


def test_auto_interval_is_young_daly_from_the_measured_save_cost(
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--checkpoint-interval-seconds auto: sqrt(2 x save cost x MTBF), with the assumed cost
    until a save was measured, then the measured (median) blocking cost."""
    import math
    import statistics

    from pyrecover_train import save_schedule

    # A (tiny) assumed cost makes the first interval a few ms: the first step saves at once.
    monkeypatch.setattr(save_schedule, "AUTO_ASSUMED_SAVE_COST", 1e-9)
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "6", "--keep-last", "0")
    argv += ["--checkpoint-interval-seconds", "auto", "--mtbf", "1h"]
    assert main(argv) == 0
    assert "auto: Young/Daly with MTBF 1:00:00" in capsys.readouterr().out
    saves = [e for e in events(ckpt) if e["event"] == "save"]
    # After the first save the measured cost (>= 1 ms) gives an interval of seconds: no
    # further time-based save in a run of a few steps, only the final one.
    assert [(e["step"], e["kind"]) for e in saves] == [(1, "periodic"), (6, "final")]
    costs = []
    for e in saves:
        costs.append(e["blocking_s"])
        want = max(statistics.median(costs), math.sqrt(2 * statistics.median(costs) * 3600))
        assert e["interval_s"] == pytest.approx(want)
    assert saves[0]["interval_s"] > 1.0


def test_auto_interval_defaults_save_rarely(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the default assumed 10 s save and 6 h MTBF the first auto interval is ~11 min."""
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "3")
    assert main([*argv, "--checkpoint-interval-seconds", "auto"]) == 0
    assert "every ~0:10:57 (auto: Young/Daly with MTBF 6:00:00" in capsys.readouterr().out
    assert [e["kind"] for e in events(ckpt) if e["event"] == "save"] == ["final"]


def test_grad_accum_equals_the_larger_batch_and_custom_metrics_path(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """2 x 2 with --grad-accum 2 sees the same windows and (up to float rounding) the same
    gradients as a batch of 4; --metrics puts the JSONL where asked; --checkpoint-frequency -1
    (the original's "off") leaves only the final save."""
    runs = {}
    for name, extra in (
        ("accum", ["--batch-size", "2", "--grad-accum", "2"]),
        ("batch", ["--batch-size", "4"]),
    ):
        ckpt = tmp_path / name
        metrics = tmp_path / f"{name}.jsonl"
        argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "3", "--grad-clip", "0")
        argv += ["--checkpoint-frequency", "-1", "--metrics", str(metrics), *extra]
        assert main(argv) == 0
        assert not (ckpt / "default-exp" / "metrics.jsonl").exists()
        from pyrecover_train.metrics import read_events

        evs = list(read_events(metrics))
        assert [(e["step"], e["kind"]) for e in evs if e["event"] == "save"] == [(3, "final")]
        runs[name] = [e for e in evs if e["event"] == "step"]
    accum, batch = runs["accum"], runs["batch"]
    assert [e["data_position"] for e in accum] == [e["data_position"] for e in batch] == [4, 8, 12]
    assert accum[0]["loss"] == pytest.approx(batch[0]["loss"], rel=1e-6)
    for a, b in zip(accum[1:], batch[1:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_compile_and_fused_optimizer_say_when_unsupported(
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    from pyrecover_train import build

    real_adamw = torch.optim.AdamW

    def no_fused(*args: object, fused: bool | None = None, **kw: object) -> object:
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point CUDA")
        return real_adamw(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(build.torch.optim, "AdamW", no_fused)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)  # no C++ compiler
    argv = tiny_flags(corpus, cache_dir, tmp_path / "a", "--training-steps", "2")
    assert main([*argv, "--compile", "--fused-optimizer"]) == 0
    out = capsys.readouterr().out
    assert "--compile: no C++ compiler found for the CPU backend; running eagerly" in out
    assert "--fused-optimizer: fused AdamW unsupported here (`fused=True` requires" in out
    assert "using foreach" in out

    def broken_compile(*args: object, **kw: object) -> object:
        raise RuntimeError("Dynamo is not supported on Python 3.99+")

    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(build.torch, "compile", broken_compile)
    argv = tiny_flags(corpus, cache_dir, tmp_path / "b", "--training-steps", "2")
    assert main([*argv, "--compile"]) == 0
    out = capsys.readouterr().out
    assert "--compile: torch.compile is not available here (Dynamo is not supported" in out
    assert "running eagerly" in out


@pytest.mark.slow
def test_compile_cache_beside_the_experiment_makes_the_next_allocation_compile_nothing(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """--compile keeps torch.compile's caches in the experiment's folder (on the file system
    every allocation sees; torch's default is node-local /tmp): the resumed run, as a requeued
    allocation on another node, finds every compiled graph there and writes nothing new."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.fail("no C++ compiler: torch.compile cannot run on CPU (apt-get install g++)")
    ckpt = tmp_path / "ckpt"
    cache = ckpt / "default-exp" / "compile-cache"

    def new_node(n: int) -> dict[str, str]:
        # An empty TMPDIR, as on a node the job has not run on (torch's default cache place and
        # inductor's precompiled header live there); no TORCHINDUCTOR_CACHE_DIR (conftest).
        (tmp_path / f"node{n}").mkdir()
        return child_env(TMPDIR=str(tmp_path / f"node{n}"))

    flags = [*tiny_flags(corpus, cache_dir, ckpt), "--compile", "--warmup-steps", "1"]
    first = run_cli([*flags, "--training-steps", "2"], env=new_node(0))
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"--compile: compile cache {cache} (a requeued allocation compiles warm)" in first.stdout
    compiled = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file())
    assert any(p.parts[0] == "fxgraph" for p in compiled), compiled
    resume = [*flags, "--training-steps", "4", "--resume-from-checkpoint", "latest"]
    again = run_cli(resume, env=new_node(1))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from step 2" in again.stdout
    assert sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file()) == compiled
    # Start-up reports compiling as its own part (dynamo's timers), cold and warm.
    startups = [e["parts"] for e in events(ckpt) if e["event"] == "startup"]
    assert len(startups) == 2 and all(p["compile"] > 0 for p in startups), startups


def test_a_refused_start_with_compile_leaves_no_cache_folder(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch.compile makes its cache folder during set-up; a start refused after that (here by
    the resume) still leaves nothing behind."""
    ckpt = tmp_path / "ckpt"
    argv = [*tiny_flags(corpus, cache_dir, ckpt), "--compile", "--resume-from-checkpoint", "7"]
    assert main(argv) == 2
    assert "no checkpoint for step 7" in capsys.readouterr().err
    assert not ckpt.exists()


def test_fused_optimizer_is_used_where_supported(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    try:
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, ValueError):
        pytest.skip("this torch has no fused AdamW on CPU (the fallback is tested above)")
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "2", "--fused-optimizer")
    assert main(argv) == 0
    assert "--fused-optimizer" not in capsys.readouterr().out  # no warning
    _, state = final_state(ckpt)
    assert all(g["fused"] for g in state["optim"]["param_groups"])


def test_fp16_on_a_cpu_that_cannot_is_one_line_exit_2(
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pyrecover_train import precision

    monkeypatch.setattr(precision, "_cpu_autocast_works", lambda dtype: False)
    ckpt = tmp_path / "ckpt"
    assert main([*flags(corpus, cache_dir, ckpt), "--model-dtype", "fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--model-dtype fp16 is not supported by this CPU" in err
    assert "use --model-dtype fp32 on CPU" in err and len(err.splitlines()) == 1
    assert not ckpt.exists()


def test_dry_run_never_touches_a_folder_named_like_its_scratch(
    straight: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """An experiment may be called "default-exp.dry-run": the dry run's scratch folder is a
    fresh one of its own, removed afterwards; everything else stays as it was."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight / "default-exp", ckpt / "default-exp")
    shutil.copytree(straight / "default-exp", ckpt / "default-exp.dry-run")
    (ckpt / "default-exp.dry-run-notes").mkdir()
    (ckpt / "default-exp.dry-run-notes" / "keep.txt").write_text("mine")
    before = {k: v for k, v in snapshot(ckpt).items() if not k.endswith(("metrics.jsonl", ".log"))}
    argv = [*flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", "latest", "--dry-run"]
    assert main(argv) == 0
    after = {k: v for k, v in snapshot(ckpt).items() if not k.endswith(("metrics.jsonl", ".log"))}
    assert after == before
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "default-exp",
        "default-exp.dry-run",
        "default-exp.dry-run-notes",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["--use-torch-distributed-ckpt", "--parallelism=fsdp"])
def test_distributed_dry_run(sharding: str, corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    """--dry-run under torchrun (2 processes, DCP; DDP or FSDP): the ranks agree on one scratch
    folder, all write their shards and read them back (FSDP: each its own DTensor shards),
    then it is removed."""
    ckpt = tmp_path / "ckpt"
    r = run_torchrun(["--distributed", sharding, "--dry-run", *tiny_flags(corpus, cache_dir, ckpt)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dry run OK: 1 step" in r.stdout
    assert "could not remove" not in r.stdout + r.stderr
    assert not ckpt.exists() or list(ckpt.iterdir()) == []  # nothing stays, no metrics either


def test_a_file_where_a_folder_goes_is_one_line_exit_2(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    in_the_way = tmp_path / "ckpt"
    in_the_way.write_text("not a folder")
    assert main(flags(corpus, cache_dir, in_the_way)) == 2
    err = capsys.readouterr().err.strip()
    assert f"--checkpoint-dir: {in_the_way} is a file, not a directory" in err
    assert len(err.splitlines()) == 1
    ckpt = tmp_path / "ok"
    assert main([*flags(corpus, cache_dir, ckpt), "--metrics", str(in_the_way / "m.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--metrics: {in_the_way} is a file, not a directory" in err
    assert len(err.splitlines()) == 1
    assert in_the_way.read_text() == "not a folder" and not ckpt.exists()


@pytest.mark.parametrize("form", ["path", "step"])
def test_resume_from_a_given_checkpoint(
    form: str, straight: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """--resume-from-checkpoint PATH (any checkpoint folder, as in the original: it need not be
    under --checkpoint-dir) or a step number: training continues from there, bitwise exactly."""
    import shutil

    source = straight / "default-exp" / f"step-{STEPS - EVERY:08d}"
    if form == "path":
        ckpt = tmp_path / "elsewhere"
        target = str(source)
    else:  # a step of this experiment: a copy of the straight run without its last checkpoint
        ckpt = tmp_path / "copy"
        shutil.copytree(straight / "default-exp", ckpt / "default-exp")
        shutil.rmtree(ckpt / "default-exp" / f"step-{STEPS:08d}")
        (ckpt / "default-exp" / "latest").unlink()
        target = str(STEPS - EVERY)
    assert main([*flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", target]) == 0
    resume = [e for e in events(ckpt) if e["event"] == "resume"][-1]  # the copy has older ones
    assert resume["step"] == STEPS - EVERY
    _, want = final_state(straight)
    manifest, got = final_state(ckpt)
    assert manifest.step == STEPS
    assert_bitwise_equal(want, got)
    assert source.is_dir()  # the source checkpoint is left as it was


def test_a_late_stop_signal_does_not_turn_a_clean_stop_into_a_kill(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """SLURM's warning signal comes on its own schedule: also after the run stopped for time and
    saved. Signals that arrive from the stop until the process is gone must leave exit 75."""
    ckpt = tmp_path / "ckpt"
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    proc = start_cli([*flags(corpus, cache_dir, ckpt), "--time-limit", "1s", "--stop-margin", "0"])
    sent = 0
    try:
        while not (metrics.exists() and any(e["event"] == "stop" for e in events(ckpt))):
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.002)
        while proc.poll() is None:  # a storm of them, until the very end
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR2 if sent % 2 else signal.SIGTERM)
                sent += 1
            time.sleep(0.001)
        out = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent > 0
    assert proc.returncode == 75, (proc.returncode, out)


def _as_from_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it (a test run started with nohup ... & passes it down
    ignored, which the trainer respects)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_process_is_gone_right_after_its_stop_line(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """After a Ctrl-C stop the process ends at once: no Python teardown of torch and every
    module after the work is done (1 s on an idle machine, 15 s measured on a loaded one, part of
    a SLURM job's exit). The allowance comes from the process's own speed: a fifth of what
    importing those modules took it; the teardown took ~0.5x that (1.2 s against 2.1 s)."""
    ckpt = tmp_path / "ckpt"
    args = [*flags(corpus, cache_dir, ckpt), "--training-steps", "100000"]
    stop, gone = _stopped_by(
        signal.SIGINT,
        ckpt,
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_as_from_a_terminal,
    )
    own = OwnSpeed.of(ckpt)
    assert gone - stop["time"] < own.exit_allowance, (gone - stop["time"], own)


def test_a_closed_terminal_saves_and_stops(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    """SIGHUP (the terminal or the ssh session went away) stops with a final save, as Ctrl-C
    does, although every write to the terminal now fails: the run goes on into train.log."""
    ckpt = tmp_path / "ckpt"
    args = [*flags(corpus, cache_dir, ckpt), "--training-steps", "100000", "--log-every", "1"]
    master, slave = os.openpty()

    def hang_up() -> None:  # the terminal is gone: writes to it fail with EIO from now on
        os.close(slave)
        os.close(master)

    stop, _ = _stopped_by(
        signal.SIGHUP,
        ckpt,
        args,
        before=hang_up,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
    )
    saved = [e for e in events(ckpt) if e["event"] == "saved"]
    assert saved and saved[-1]["step"] == stop["step"], (saved[-1:], stop)
    assert "SIGHUP" in (ckpt / "default-exp" / "train.log").read_text()


def test_a_sigterm_stop_ends_with_a_line_true_whatever_the_job_script_does(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """A SIGTERM to the step comes from `slurmclock stop`, scancel (no requeue follows) or a
    preemption with GraceTime (a requeue follows); the trainer cannot tell them apart. Its last
    line said "exit 75 = requeue and resume" and the job script then "not requeueing" (issue
    30): it says what is true in every case."""
    ckpt = tmp_path / "ckpt"
    args = [*flags(corpus, cache_dir, ckpt), "--training-steps", "100000"]
    stop, _ = _stopped_by(
        signal.SIGTERM, ckpt, args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    log = (ckpt / "default-exp" / "train.log").read_text()
    (last,) = [line for line in log.splitlines() if "stopped at step" in line]
    assert "requeue and resume" not in last, last
    left = 100000 - stop["step"]
    assert f"exit 75 = saved, {left} steps left: the next run with --resume-from" in last, last


def _stopped_by(
    sig: signal.Signals,
    ckpt: Path,
    args: list[str],
    *,
    before: Callable[[], None] = lambda: None,
    **popen: Any,
) -> tuple[dict[str, Any], float]:
    """Start pyrecover-train, send ``sig`` once step 3 is done (``before`` just before it): it
    must save and exit 75 for that signal. Its last stop event, and when the process was gone."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyrecover_train", *args], env=child_env(), **popen
    )
    try:
        wait_for_step(proc, ckpt / "default-exp" / "metrics.jsonl", 0, 3)
        before()
        proc.send_signal(sig)
        proc.wait(timeout=120)
        gone = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75
    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    assert stop["cause"] == "signal" and sig.name in stop["reason"], stop
    return stop, gone

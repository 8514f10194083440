"""pyrecover-train end to end, as users run it (subprocesses where signals and kills matter,
in-process where only the outcome does): a run to completion, bitwise resume after graceful stops
and SIGKILLs, async checkpoints, refusals that touch nothing, --dry-run, and the report."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from train_helpers import (
    assert_bitwise_equal,
    child_env,
    events,
    final_state,
    line_count,
    run_cli,
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


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_bitwise_resume_after_stops_and_kills(
    mode: str, straight: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    extra = ["--async-checkpoint"] if mode == "async" else []
    base = flags(corpus, cache_dir, ckpt, *extra)
    resume = [*base, "--resume-from-checkpoint", "latest"]
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    rnd = random.Random(1234 if mode == "blocking" else 4321)
    # Graceful stop for time: a 1 s limit is spent by start-up, so the run stops after one step.
    r = run_cli([*base, "--time-limit", "1", "--stop-margin", "0"])
    assert r.returncode == 75, r.stdout + r.stderr
    assert "stopping early (stop:" in r.stdout
    interrupt(resume, metrics, "kill", rnd)
    if mode == "blocking":
        interrupt(resume, metrics, "usr2", rnd)
        r = run_cli([*resume, "--time-limit", "1", "--stop-margin", "0"])
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
    assert all(e["reason"].startswith("resumed from step") for e in resumes)
    causes = [e["cause"] for e in evs if e["event"] == "stop"]
    want_causes = ["time", "signal", "time", "done"] if mode == "blocking" else ["time", "done"]
    assert causes == want_causes


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
    # Nothing but the metrics/log folder stays: no checkpoint, no scratch experiment.
    assert sorted(p.name for p in ckpt.iterdir()) == ["default-exp"]
    assert sorted(p.name for p in (ckpt / "default-exp").iterdir()) == [
        "metrics.jsonl",
        "train.log",
    ]
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
    cmd = [
        os.environ.get("PYTHON", "python"),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pyrecover_train",
        "--distributed",
        *base,
        "--training-steps",
        "6",
        "--eval-every",
        "3",
        "--val-fraction",
        "0.1",
    ]
    import sys

    cmd[0] = sys.executable
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env())
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

    r = run_cli(
        [
            *base,
            "--training-steps",
            "10",
            "--resume-from-checkpoint",
            "latest",
            "--val-fraction",
            "0.1",
        ]
    )
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
    assert "--wandb: not logging to Weights & Biases" in capsys.readouterr().out
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

"""--parallelism fsdp, --param-dtype bf16, --activation-checkpointing and the rendezvous stop, as
users run them: 2-rank FSDP2 runs under torchrun (gloo on CPU) that are SIGKILLed or stopped and
resume bitwise, a reshard 2 -> 1 -> 2 that continues at the exact data position, FSDP in one
process, bf16 weights, and the one-line refusals."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from train_helpers import (
    assert_bitwise_equal,
    child_env,
    events,
    final_state,
    line_count,
    run_cli,
    run_torchrun,
    tiny_flags,
)

from pyrecover_train.cli import main

STEPS, EVERY, BATCH = 12, 3, 4


def fsdp_flags(corpus: Path, cache: Path, ckpt: Path, *extra: str) -> list[str]:
    """Sharded, with gradient accumulation, evaluation, clipping (on by default), async saves;
    a constant learning rate after the warmup (--min-lr = --learning-rate), so that a run of
    fewer --training-steps takes the same steps."""
    return tiny_flags(
        corpus,
        cache,
        ckpt,
        "--min-lr",
        "3e-3",
        "--parallelism",
        "fsdp",
        "--training-steps",
        str(STEPS),
        "--checkpoint-frequency",
        str(EVERY),
        "--keep-last",
        "0",
        "--grad-accum",
        "2",
        "--eval-every",
        "6",
        "--val-fraction",
        "0.1",
        "--async-checkpoint",
        *extra,
    )


def torchrun(args: list[str]) -> subprocess.CompletedProcess[str]:
    r = run_torchrun(["--distributed", *args])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def straight(corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank FSDP run that never stops: the reference."""
    ckpt = tmp_path_factory.mktemp("fsdp-straight")
    torchrun(fsdp_flags(corpus, cache_dir, ckpt))
    return ckpt


@pytest.mark.slow
def test_fsdp_checkpoints_are_sharded(straight: Path) -> None:
    manifest, state = final_state(straight)
    assert manifest.format == "dcp" and manifest.world_size == 2 and manifest.step == STEPS
    chunks = manifest.format_data["tensors"]["model.layers.0.ffn.w1.weight"]["chunks"]
    assert [c["sizes"] for c in chunks] == [[192, 128], [192, 128]]  # each rank its half
    assert {c["file"].split(".")[0] for c in chunks} == {"shard-r00000", "shard-r00001"}
    # The optimizer state is keyed by parameter name: it follows its parameter on a reshard.
    assert set(state["optim"]["state"]["layers.0.ffn.w1.weight"]) == {
        "step",
        "exp_avg",
        "exp_avg_sq",
    }
    assert set(state["rng"]) == {"rank0", "rank1"}
    evs = events(straight)
    assert [e["step"] for e in evs if e["event"] == "eval"] == [6, 12]
    assert [e["step"] for e in evs if e["event"] == "saved"] == [3, 6, 9, 12]
    steps = [e for e in evs if e["event"] == "step"]
    assert all(e["grad_norm"] > 0 for e in steps)  # clipping measured the sharded norm
    assert steps[-1]["loss"] < steps[0]["loss"]


# -- stopped and killed runs resume bitwise ---------------------------------------------------


def _workers(agent: int) -> list[int]:
    """The pids of torchrun's worker processes (its children)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == agent:
                out.append(int(d.name))
    return out


def interrupted_torchrun(args: list[str], metrics: Path, log: Path, how: signal.Signals) -> int:
    """Start a 2-rank run, wait until it made progress, then send ``how`` to both workers
    (SIGKILL: and to torchrun too, as a node failure would). Returns torchrun's exit status."""
    start, rnd = line_count(metrics), random.Random(f"{how}{line_count(metrics)}")
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp, log.open("a") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            + ["--nproc-per-node", "2", "-m", "pyrecover_train", "--distributed", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(TMPDIR=tmp),
        )
        try:
            first = _wait_for_step(agent, metrics, start, 1)
            _wait_for_step(agent, metrics, start, first + rnd.randint(1, 3))
            time.sleep(rnd.uniform(0, 0.1))  # mid-step, or mid-save
            for pid in _workers(agent.pid):
                with contextlib.suppress(ProcessLookupError):  # gone by itself meanwhile
                    os.kill(pid, how)
            if how == signal.SIGKILL:
                agent.kill()
            return agent.wait(timeout=120)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def _wait_for_step(proc: subprocess.Popen[Any], metrics: Path, start: int, at_least: int) -> int:
    """The first step >= ``at_least`` this run logged (after line ``start`` of the metrics)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early ({proc.returncode})"
        lines = metrics.read_bytes().splitlines()[start:] if metrics.exists() else []
        for line in lines:
            try:
                e = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line being written
            if e.get("event") == "step" and e["step"] >= at_least:
                return int(e["step"])
        time.sleep(0.02)
    raise AssertionError(f"no step >= {at_least} within 180 s")


@pytest.mark.slow
def test_fsdp_resume_after_a_stop_and_a_kill_is_bitwise_equal(
    straight: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    resume = [*fsdp_flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", "latest"]
    metrics, log = ckpt / "default-exp" / "metrics.jsonl", tmp_path / "torchrun.log"
    interrupted_torchrun(resume, metrics, log, signal.SIGTERM)  # save and stop: exit 75 each
    stopped = [e for e in events(ckpt) if e["event"] == "stop"]
    assert [(e["cause"], e["exit_code"]) for e in stopped] == [("signal", 75)], log.read_text()
    killed = interrupted_torchrun(resume, metrics, log, signal.SIGKILL)
    assert killed == -signal.SIGKILL
    torchrun(resume)

    _, want = final_state(straight)
    manifest, got = final_state(ckpt)
    assert manifest.step == STEPS and manifest.world_size == 2
    assert_bitwise_equal(want, got)
    resumes = [e for e in events(ckpt) if e["event"] == "resume"]
    assert len(resumes) == 2 and all(e["world_size"] == 2 for e in resumes)


# -- reshard: 2 ranks -> 1 process -> 2 ranks --------------------------------------------------


def _steps(ckpt: Path) -> dict[int, dict[str, Any]]:
    """The last run's step events by step (a resumed run logs its own)."""
    return {e["step"]: e for e in events(ckpt) if e["event"] == "step"}


@pytest.mark.slow
def test_reshard_two_one_two_continues_at_the_exact_data_position(
    straight: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Steps 7-9 on one process (batch 8: the same global batch as 2 x 4), 10-12 on two ranks
    again: the data goes on from the global position, no window repeated or skipped, and the
    weights and optimizer come through (the result is the straight run's up to float sums)."""
    ckpt = tmp_path / "ckpt"
    step6 = straight / "default-exp" / "step-00000006"
    one = fsdp_flags(corpus, cache_dir, ckpt, "--batch-size", "8", "--training-steps", "9")
    r = run_cli([*one, "--resume-from-checkpoint", str(step6)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world size changed (2 in the checkpoint, 1 now)" in r.stdout
    torchrun([*fsdp_flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", "latest"])

    ref, got = _steps(straight), _steps(ckpt)
    assert sorted(got) == list(range(7, STEPS + 1))
    per_step = 2 * BATCH * 2  # ranks x batch x accumulation, both ways
    for step in got:  # each step starts where the one before ended: nothing repeated or skipped
        assert got[step]["data_position"] == step * per_step == ref[step]["data_position"]
    resumes = [e for e in events(ckpt) if e["event"] == "resume"]
    assert [e["data_state"]["position"] for e in resumes] == [6 * per_step, 9 * per_step]
    manifest, state = final_state(ckpt)
    assert manifest.world_size == 2 and state["data"]["position"] == STEPS * per_step
    _, want = final_state(straight)
    for name, w in want["model"].items():  # close, not bitwise: other reduction orders
        torch.testing.assert_close(state["model"][name], w, rtol=0, atol=2e-5, msg=name)
    for name, w in want["optim"]["state"].items():
        torch.testing.assert_close(state["optim"]["state"][name]["exp_avg"], w["exp_avg"])


# -- one process, bf16 weights, activation checkpointing ---------------------------------------


def test_fsdp_in_one_process_with_bf16_weights_resumes_bitwise(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """World size 1 (no launcher: a private one-rank group for the mesh), bf16 weights (and with
    them gradients and AdamW moments), activation checkpointing; stopped after a step (the
    1 s limit is spent by start-up), resumed."""
    extra = ["--param-dtype", "bf16", "--activation-checkpointing", "--training-steps", "6"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(fsdp_flags(corpus, cache_dir, a, *extra)) == 0
    r = run_cli([*fsdp_flags(corpus, cache_dir, b, *extra), "--time-limit", "1s"])
    assert r.returncode == 75, r.stdout + r.stderr
    resume = ["--resume-from-checkpoint", "latest"]
    assert main(fsdp_flags(corpus, cache_dir, b, *extra, *resume)) == 0
    (_, want), (manifest, got) = final_state(a), final_state(b)
    assert manifest.step == 6 and manifest.format == "dcp"
    assert_bitwise_equal(want, got)
    assert got["model"]["layers.0.attn.wq.weight"].dtype == torch.bfloat16
    assert got["optim"]["state"]["layers.0.attn.wq.weight"]["exp_avg"].dtype == torch.bfloat16
    assert events(a)[0]["args"]["model_dtype"] == "bf16"  # implied by --param-dtype bf16


def test_fsdp_shards_the_model_before_it_has_any_memory(
    corpus: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No rank ever holds the whole model: it is built on the meta device and sharded there;
    memory comes after, for each rank's shards only (then a seeded init, or the checkpoint)."""
    import ddpkit
    from pyrecover_train import build

    seen: list[tuple[bool, set[str], int | None]] = []
    materialise = build.materialise

    def spy(model: Any, device: Any, *, seed: int | None) -> None:
        devices = {p.device.type for p in model.parameters()}
        seen.append((ddpkit.is_sharded(model), devices, seed))
        materialise(model, device, seed=seed)

    monkeypatch.setattr(build, "materialise", spy)
    argv = fsdp_flags(corpus, cache_dir, tmp_path, "--eval-every", "0", "--training-steps", "2")
    assert main(argv) == 0
    assert main([*argv, "--training-steps", "3", "--resume-from-checkpoint", "latest"]) == 0
    assert seen == [(True, {"meta"}, 42), (True, {"meta"}, None)]  # fresh (--seed 42), resume


def test_fsdp_resume_with_bf16_weights_casts_the_checkpoint(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An fp32 FSDP checkpoint resumed with --param-dtype bf16: each rank reads its shards in
    fp32 and they are cast as they load; the resume says so."""
    base = fsdp_flags(corpus, cache_dir, tmp_path, "--eval-every", "0", "--log-every", "2")
    assert main([*base, "--training-steps", "2"]) == 0
    resume = ["--training-steps", "4", "--resume-from-checkpoint", "latest"]
    assert main([*base, *resume, "--param-dtype", "bf16"]) == 0
    assert "resume with --param-dtype fp32 -> bf16" in capsys.readouterr().out
    manifest, state = final_state(tmp_path)
    assert manifest.step == 4
    assert state["model"]["layers.3.ffn.w2.weight"].dtype == torch.bfloat16


def test_fsdp_nan_weights_stop_without_saving(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The finite-weights check before a save, on shards: a far too high learning rate makes
    the weights NaN/inf; the run stops with exit 1 before the save, the good one stays."""
    argv = fsdp_flags(corpus, cache_dir, tmp_path, "--checkpoint-frequency", "2")
    argv += ["--grad-clip", "0", "--eval-every", "0", "--val-fraction", "0"]  # no eval, no split
    argv += ["--log-every", "100"]  # no loss check
    assert main([*argv, "--training-steps", "2"]) == 0
    bad = ["--training-steps", "30", "--learning-rate", "1e30", "--warmup-steps", "0"]
    capsys.readouterr()
    assert main([*argv, *bad, "--resume-from-checkpoint", "latest"]) == 1
    err = capsys.readouterr().err.strip()
    assert "the weights are NaN/inf at step" in err and len(err.splitlines()) == 1, err
    assert final_state(tmp_path)[0].step == 2


def test_bf16_weights_without_fsdp(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    """--param-dtype bf16 on one process (the DDP path): half the bytes of fp32 weights."""
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "3", "--param-dtype", "bf16")
    assert main([*argv, "--activation-checkpointing", "--deterministic"]) == 0
    manifest, state = final_state(ckpt)
    assert manifest.format == "torch"
    assert {t.dtype for t in state["model"].values()} == {torch.bfloat16}
    moments = [s["exp_avg_sq"] for s in state["optim"]["state"].values()]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}
    steps = [e for e in events(ckpt) if e["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]


# -- refusals: one line, exit 2, nothing written ------------------------------------------------


# -- another --parallelism than the checkpoint's ---------------------------------------------


def _switched(args: list[str], out: Path) -> dict[str, Any]:
    """The trainer's set-up and resume with ARGS, stopped right after the load
    (switch_worker.py): its live state against the checkpoint's."""
    worker = str(Path(__file__).with_name("switch_worker.py"))
    r = run_torchrun([str(out), "--", "--distributed", *args], entry=(worker,))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return dict(orjson.loads(out.read_bytes()))


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_as_fsdp_and_back(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """2 ranks: DDP to step 6, resumed as FSDP to step 9, resumed as DDP to step 12. Right
    after each load every weight and AdamW moment is bitwise the saved one (gathered whole,
    by parameter name) and the data position is the checkpoint's; the runs go on from there
    (other reduction orders: the result is not bitwise a straight run's, so that is not
    asserted)."""
    ckpt = tmp_path / "ckpt"
    flags = fsdp_flags(corpus, cache_dir, ckpt, "--eval-every", "0")
    ddp = [*flags, "--parallelism", "ddp"]  # the last --parallelism wins
    resume = ["--resume-from-checkpoint", "latest"]
    torchrun([*ddp, "--training-steps", "6"])
    as_fsdp = _switched([*flags, *resume, "--training-steps", "9"], tmp_path / "fsdp.json")
    assert as_fsdp["sharded"] and as_fsdp["step"] == 6 and as_fsdp["differ"] == []
    assert as_fsdp["position"] == as_fsdp["checkpoint_position"] == 6 * 2 * BATCH * 2
    r = torchrun([*flags, *resume, "--training-steps", "9"])
    assert "resume with --parallelism ddp -> fsdp" in r.stdout + r.stderr
    assert final_state(ckpt)[0].format == "dcp"  # written as FSDP writes: sharded

    as_ddp = _switched([*ddp, *resume, "--training-steps", "12"], tmp_path / "ddp.json")
    assert not as_ddp["sharded"] and as_ddp["step"] == 9 and as_ddp["differ"] == []
    assert as_ddp["position"] == as_ddp["checkpoint_position"] == 9 * 2 * BATCH * 2
    torchrun([*ddp, *resume, "--training-steps", "12"])
    manifest, state = final_state(ckpt)
    assert manifest.step == STEPS and manifest.format == "torch" and manifest.world_size == 2
    assert state["data"]["position"] == STEPS * 2 * BATCH * 2
    positions = {e["step"]: e["data_position"] for e in events(ckpt) if e["event"] == "step"}
    assert positions == {s: s * 2 * BATCH * 2 for s in range(1, STEPS + 1)}


# -- a stop signal while waiting for the other ranks -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _as_from_a_terminal() -> None:
    """Ctrl-C as a terminal delivers it: a test run started in the background of a
    non-interactive shell (nohup ... &) passes SIGINT down ignored, which the trainer respects."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_wait_for_a_rank_that_never_comes(
    sig: signal.Signals, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 of 2 waits at the rendezvous for rank 1, which never starts: SIGTERM (SLURM's
    stop) or Ctrl-C ends the wait at once with one line and exit 128 + signal."""
    port = _free_port()
    env = child_env(
        RANK="0",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    ckpt = tmp_path / "ckpt"
    argv = [*tiny_flags(corpus, cache_dir, ckpt), "--distributed"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyrecover_train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_as_from_a_terminal,
    )
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):  # rank 0's store is up: it waits for rank 1 now
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, out + err
    assert took < 10, took
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "stopped waiting at the rendezvous" in lines[0] and f"{sig.name} received" in lines[0]
    assert "rank 1 never did" in lines[0]
    assert not ckpt.exists()


def test_a_dead_peer_without_the_watchdog_is_one_line(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """DDPKIT_WATCHDOG=0: rank 1 of 2 is SIGKILLed mid-run; rank 0's next collective (the
    gradient all-reduce inside backward, or ddpkit's agreement on the stop) fails. It says so in
    one line naming the silent rank (ddpkit's heartbeats), exit 69 like the watchdog's; the
    backend's traceback goes to train.log only."""
    port = _free_port()
    ckpt = tmp_path / "ckpt"
    argv = [*tiny_flags(corpus, cache_dir, ckpt), "--training-steps", "100000", "--distributed"]
    argv += ["--log-every", "1"]
    procs = []
    for rank in (0, 1):
        env = child_env(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DDPKIT_WATCHDOG="0",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "pyrecover_train", *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    try:
        metrics = ckpt / "default-exp" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and b'"step"' in metrics.read_bytes()):
            assert all(p.poll() is None for p in procs), procs[0].communicate()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        procs[1].kill()
        procs[1].communicate()
        out, err = procs[0].communicate(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode == 69, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err
    assert lines[0].startswith("pyrecover-train: error: [rank 0/2 on "), lines[0]
    # Wherever the dead peer is met first (DDP's all-reduce in backward, or ddpkit's own agree
    # of the step's stop decision), the line names the rank that stopped answering.
    assert " failed" in lines[0] and "rank 1 stopped answering" in lines[0], lines[0]
    assert "--resume-from-checkpoint latest" in lines[0]
    assert "Traceback" in (ckpt / "default-exp" / "train.log").read_text()

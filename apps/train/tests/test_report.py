"""``pyrecover-train report``: the numbers (goodput, lost steps, overhead) and the PNG."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from train_helpers import ROOT, running_cli, tiny_flags, wait_for_step

from pyrecover_train.cli import main
from pyrecover_train.report import Liveness, summarize
from slurmclock import CommandError


def _steps(
    run: str, steps: range, time: Any, loss: Any, saves: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Step events one per step, with a save (and its durable "saved") at ``saves``."""
    ev: list[dict[str, Any]] = []
    for s in steps:
        t = time(s)
        ev.append(
            {"event": "step", "run": run, "time": t, "step": s, "loss": loss(s)}
            | {"steps": 1, "step_time_s": 1.0}
        )
        if s in saves:
            ev.append({"event": "save", "run": run, "time": t + 0.1, "step": s, "blocking_s": 0.5})
            ev.append(
                {"event": "saved", "run": run, "time": t + 0.5, "step": s}
                | {"total_s": 0.8, "bytes": 1000}
            )
    return ev


def _start(run: str, time: float, step: int) -> dict[str, Any]:
    return {
        "event": "start",
        "run": run,
        "time": time + 1.0,
        "process_start": time,
        "step": step,
        "args": {"training_steps": 50},
    }


def two_runs() -> list[dict[str, Any]]:
    """Run 1 trains steps 0..30 (saves at 10, 20) and is killed; run 2 resumes at 20 and
    finishes at 50."""
    ev = [_start("a", 0.0, 0), *_steps("a", range(1, 31), float, lambda s: 5.0 - s / 20, (10, 20))]
    ev[-1]["time"] = 40.0  # the last line written before SIGKILL
    ev.append(_start("b", 50.0, 20))
    ev.append(
        {"event": "resume", "run": "b", "time": 51.0, "step": 20, "reason": "resumed from step 20"}
    )
    ev += _steps(
        "b", range(21, 51), lambda s: 50.0 + (s - 20), lambda s: 4.0 - s / 50, (30, 40, 50)
    )
    ev.append({"event": "eval", "run": "b", "time": 85.0, "step": 50, "val_loss": 3.5})
    ev.append(
        {"event": "stop", "run": "b", "time": 90.0, "step": 50}
        | {"cause": "done", "reason": "done: reached"}
    )
    return ev


def test_summary_numbers() -> None:
    s = summarize(two_runs())
    assert [r.outcome for r in s.runs] == ["killed", "done"]
    assert [(r.start_step, r.end_step, r.persisted_steps, r.lost_steps) for r in s.runs] == [
        (0, 30, 20, 10),
        (20, 50, 30, 0),
    ]
    assert s.wall_s == pytest.approx(80.0)
    assert s.persisted_step_s == pytest.approx(50.0)
    assert s.goodput == pytest.approx(50 / 80)
    assert s.lost_steps == 10
    assert s.saves == 5 and s.checkpoint_overhead == pytest.approx(2.5 / 80)
    assert s.final_step == 50 and s.target_steps == 50 and s.last_val_loss == 3.5


def write(path: Path, events: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))


def test_report_cli_writes_png_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path / "exp" / "metrics.jsonl", two_runs())
    assert main(["report", str(tmp_path / "exp")]) == 0
    out = capsys.readouterr().out
    assert "goodput 62.5%" in out and "lost steps 10" in out and "checkpoint overhead 3.1%" in out
    png = tmp_path / "exp" / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "m.jsonl", two_runs())
    assert (
        main(
            ["report", str(tmp_path), "--metrics", str(tmp_path / "m.jsonl"), "--json", "--no-plot"]
        )
        == 0
    )
    data = orjson.loads(capsys.readouterr().out)
    assert data["lost_steps"] == 10 and data["runs"][0]["lost_steps"] == 10


def test_report_of_a_missing_experiment_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl not found" in err and len(err.strip().splitlines()) == 1


def test_report_without_matplotlib_still_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    write(tmp_path / "exp" / "metrics.jsonl", two_runs())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["report", str(tmp_path / "exp")]) == 1
    captured = capsys.readouterr()
    assert "goodput 62.5%" in captured.out
    assert "pip install 'pyrecover-train[plot]'" in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    assert not (tmp_path / "exp" / "report.png").exists()


def test_report_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["report"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "the following arguments are required: exp_dir" in err and len(err.splitlines()) == 1


def test_a_run_with_nothing_to_do_has_its_own_outcome_and_legend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A requeued job that finds the training finished: a run of its own, "nothing to do"
    (not "done"), with its own marker in the timeline's legend."""
    from pyrecover_train import report

    ev = two_runs()
    ev.append(_start("c", 100.0, 50))
    ev.append({"event": "resume", "run": "c", "time": 101.0, "step": 50, "reason": "resumed"})
    ev.append(
        {"event": "stop", "run": "c", "time": 102.0, "step": 50}
        | {"cause": "done", "reason": "already finished"}
    )
    s = summarize(ev)
    assert [r.outcome for r in s.runs] == ["killed", "done", "nothing to do"]
    write(tmp_path / "exp" / "metrics.jsonl", ev)
    assert main(["report", str(tmp_path / "exp")]) == 0
    assert "run 3: steps 50->50" in capsys.readouterr().out
    assert "nothing to do: already finished" in report.format_summary(s)
    assert f"{report.MARKERS['nothing to do']} nothing to do" in report.LEGEND


def test_report_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """`pyrecover-train report EXP | head -1`: exit 141 (SIGPIPE's), no "Broken pipe" message."""
    write(tmp_path / "exp" / "metrics.jsonl", two_runs())
    report = ["-m", "pyrecover_train", "report", str(tmp_path / "exp"), "--no-plot"]
    tool = str(ROOT / "tools" / "closedpipe.py")
    done = subprocess.run([sys.executable, tool, sys.executable, *report], capture_output=True)
    assert done.returncode == 141 and done.stderr == b""


def test_a_foreign_metrics_file_or_an_unwritable_plot_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Probes: a start event without its flags (another program's, or hand-edited) and --out
    under a file were tracebacks."""
    write(tmp_path / "a" / "metrics.jsonl", [{"event": "start", "time": 1.0, "run": "r"}])
    assert main(["report", str(tmp_path / "a"), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert "is not a metrics file of pyrecover-train (an event lacks or mangles 'args')" in err
    assert len(err.splitlines()) == 1
    write(tmp_path / "b" / "metrics.jsonl", two_runs())
    (tmp_path / "file").write_text("x")
    assert main(["report", str(tmp_path / "b"), "--out", str(tmp_path / "file" / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pyrecover-train report: error: cannot write the plot: ")
    assert len(err.splitlines()) == 1


def test_a_running_run_is_told_from_a_killed_one(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report` on a run still going called it "killed ... lost N" (issue 30). Its process,
    on this host, holds the metrics file open: running, its steps "not saved yet"; once it is
    killed, killed."""
    ckpt = tmp_path / "ckpt"
    exp = ckpt / "default-exp"
    args = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "100000")
    with running_cli([*args, "--checkpoint-frequency", "1000"]) as proc:
        wait_for_step(proc, exp / "metrics.jsonl", 0, 5)
        assert main(["report", str(exp), "--no-plot"]) == 0
        out = capsys.readouterr().out
        assert f"; running: its process {proc.pid} on this host writes the metrics" in out, out
        assert "not saved yet" in out and "lost steps 0" in out, out
        proc.kill()
        proc.wait()
    assert main(["report", str(exp), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "; killed: no stop event (killed or crashed)" in out and "not saved yet" not in out


def test_a_run_elsewhere_is_running_while_slurm_keeps_its_allocation() -> None:
    """From a login node: SLURM's answer (the job's current allocation began before the run's
    process: running; after it: requeued since, so over), else the run's own pace."""
    now = time.time()
    ev = [_start("a", now - 100, 0) | {"pid": 4242, "host": "gpu7", "job_id": "36"}]
    ev += _steps("a", range(1, 11), lambda s: now - 60 + s, lambda s: 5.0, (5,))

    def squeue(start: str | Exception) -> Any:
        def runner(argv: Any, timeout: float) -> str:
            assert list(argv) == ["squeue", "-h", "-o", "%S", "-j", "36"]
            if isinstance(start, Exception):
                raise start
            return start + "\n"

        return runner

    def outcome(runner: Any, at: float = now) -> tuple[str, str]:
        run = summarize(ev, Liveness(Path("m.jsonl"), at, host="login1", runner=runner)).runs[0]
        return run.outcome, run.reason

    def iso(t: float) -> str:  # as squeue prints %S: local time
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))

    assert outcome(squeue(iso(now - 110))) == (
        "running",
        "SLURM job 36 is still in the allocation it started in",
    )
    assert outcome(squeue(iso(now - 20)))[0] == "killed"  # requeued: a new allocation
    gone = CommandError(["squeue"], "failed", "Invalid job id specified")
    assert outcome(squeue(gone)) == (
        "running",
        "its last event was 50 s ago (or it was killed just now)",
    )
    assert outcome(squeue(gone), at=now + 3600)[0] == "killed"

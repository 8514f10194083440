from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit import RankZeroFilter, current_rank, rank_zero_only, setup_logging


def records(rank: int | None, caplog: pytest.LogCaptureFixture) -> list[str]:
    log = logging.getLogger(f"ddpkit-test-{rank}")
    log.propagate = True
    flt = RankZeroFilter(rank)
    log.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            log.info("only rank zero")
            log.info("everyone", extra={"all_ranks": True})
    finally:
        log.removeFilter(flt)
    return [f"{r.rank}:{r.getMessage()}" for r in caplog.records]  # type: ignore[attr-defined]


def test_filter_on_rank_zero(caplog: pytest.LogCaptureFixture) -> None:
    assert records(0, caplog) == ["0:only rank zero", "0:everyone"]


def test_filter_on_other_ranks(caplog: pytest.LogCaptureFixture) -> None:
    assert records(2, caplog) == ["2:everyone"]


def test_filter_reads_the_rank_from_the_environment(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert current_rank() == 3
    assert records(None, caplog) == ["3:everyone"]


def test_current_rank_with_broken_variables_is_zero() -> None:
    assert current_rank({"RANK": "x", "WORLD_SIZE": "2"}) == 0
    assert (
        current_rank(
            {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"}
        )
        == 1
    )


def test_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    @rank_zero_only
    def save(x: int) -> int:
        calls.append(x)
        return x * 2

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    assert save(2) == 4
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    assert save(3) is None
    assert calls == [2]
    assert save.__name__ == "save"


def test_others_level_lets_warnings_through_on_every_rank(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("ddpkit-test-others")
    log.propagate = True
    flt = RankZeroFilter(1, others_level=logging.WARNING)
    log.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            log.info("rank zero's business")
            log.warning("everyone should see this")
    finally:
        log.removeFilter(flt)
    assert [r.getMessage() for r in caplog.records] == ["everyone should see this"]


def emit(name: str) -> None:
    log = logging.getLogger(name)
    log.info("step 1")
    log.warning("disk almost full")
    log.info("rank 3 lost its GPU", extra={"all_ranks": True})


def test_setup_logging_rank_zero(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with setup_logging("ddpkit-test-app", rank=0) as handle:
        handle.add_file(tmp_path / "logs" / "train.log")
        emit("ddpkit-test-app")
        emit("ddpkit-test-app.child")  # children go through the parent's handlers
    out = capsys.readouterr()
    lines = ["step 1", "disk almost full", "rank 3 lost its GPU"]
    assert out.out.splitlines() == lines * 2 and out.err == ""
    logged = (tmp_path / "logs" / "train.log").read_text().splitlines()
    assert [line.split(": ", 1)[1] for line in logged] == lines * 2
    assert " INFO ddpkit-test-app: step 1" in logged[0]
    emit("ddpkit-test-app")  # closed: the handlers are gone
    assert capsys.readouterr().out == ""


def test_setup_logging_other_ranks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with setup_logging("ddpkit-test-app", rank=2) as handle:
        handle.add_file(tmp_path / "train.log")  # rank 0 writes the file; not this one
        emit("ddpkit-test-app")
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == ["[rank 2] disk almost full", "[rank 2] rank 3 lost its GPU"]
    assert not (tmp_path / "train.log").exists()


def test_setup_logging_twice_replaces(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("ddpkit-test-twice", rank=0)
    handle = setup_logging("ddpkit-test-twice", rank=0, fmt="> %(message)s")
    logging.getLogger("ddpkit-test-twice").info("once")
    handle.close()
    assert capsys.readouterr().out == "> once\n"


def test_a_console_whose_reader_left_says_so_once_and_the_file_goes_on(tmp_path: Path) -> None:
    """`python train.py | head -1`: one line on stderr, not a "--- Logging error ---" traceback
    per record; the log file still gets every record and the program ends normally."""
    script = (
        "import logging, ddpkit\n"
        "logs = ddpkit.setup_logging('train', rank=0)\n"
        f"logs.add_file({str(tmp_path / 'x.log')!r})\n"
        "for i in range(3): logging.getLogger('train').info('step %d', i)\n"
    )
    tool = Path(__file__).resolve().parents[3] / "tools" / "closedpipe.py"
    done = subprocess.run(
        [sys.executable, str(tool), sys.executable, "-c", script], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "ddpkit: stdout was closed by its reader; console logging stops\n"
    assert (tmp_path / "x.log").read_text().count(" INFO train: step ") == 3


def test_a_log_file_or_stdout_on_a_full_disk_says_so_once_and_the_program_goes_on(
    tmp_path: Path,
) -> None:
    """The log file, and stdout redirected to a file, on a real full tmpfs (tools/tmpfs.py):
    one line on stderr for each, not a "--- Logging error ---" traceback per record (issue
    30); the other one and the program go on."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tmpfs", Path(__file__).resolve().parents[3] / "tools" / "tmpfs.py"
    )
    assert spec is not None and spec.loader is not None
    tmpfs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tmpfs)
    script = (
        "import logging, sys, ddpkit\n"
        "logs = ddpkit.setup_logging('train', rank=0)\n"
        "logs.add_file(sys.argv[1])\n"
        "for i in range(300): logging.getLogger('train').info('step %d' + ' pad' * 20, i)\n"
        "print('done', file=sys.stderr)\n"
    )
    try:
        with tmpfs.mounted(tmp_path / "tiny", "16k") as tiny:
            log = tiny / "x.log"
            done = subprocess.run(
                [sys.executable, "-c", script, str(log)], capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr
            assert done.stderr.splitlines() == [
                f"ddpkit: cannot write the log file {log}: No space left on device; logging to "
                "it stops (the console goes on)",
                "done",
            ], done.stderr
            assert done.stdout.count("step ") == 300
            (tiny / "x.log").unlink()
            with open(tiny / "out", "w") as out:  # stdout to the full disk, the file elsewhere
                done = subprocess.run(
                    [sys.executable, "-c", script, str(tmp_path / "x.log")],
                    stdout=out,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            assert done.returncode == 0, done.stderr
            assert done.stderr.splitlines() == [
                "ddpkit: stdout cannot be written: No space left on device; console logging stops",
                "done",
            ], done.stderr
            assert (tmp_path / "x.log").read_text().count(" INFO train: step ") == 300
    except tmpfs.Unavailable as e:
        pytest.skip(str(e))

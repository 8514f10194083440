"""Odd inputs to every slurmclock command and variable, as a hostile user tries them (issue 24):
each gets one clear line on stderr (what, where it came from, what happens instead), a value that
cannot be used never reaches a path or a command, a contradiction is an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from slurmclock import (
    DeadlineWatcher,
    JobTimeline,
    array_task,
    check_job_id,
    job_id,
    requeue,
    restart_count,
    signal_lead_from_env,
)
from slurmclock.cli import main

ID_FORMS = "give digits (1234), 1234_7 for an array task or 1234+1 for a het job component"


class NoSlurm:
    """A runner that fails the test if any SLURM command is run."""

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        raise AssertionError(f"no SLURM command should run, got {list(argv)}")


def cli(
    capsys: pytest.CaptureFixture[str], *argv: str, env: dict[str, str], runner: Any = None
) -> tuple[int, str, str]:
    base = {"SLURMCLOCK_DIR": os.environ["SLURMCLOCK_DIR"], "PATH": os.environ["PATH"]}
    code = main(list(argv), env={**base, **env}, runner=runner or NoSlurm())
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- job ids: one validator, everywhere -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        ("1234", "1234"),
        (" 1234 ", "1234"),
        ("0042", "42"),
        ("12_3", "12_3"),
        ("12+1", "12+1"),
        (77, "77"),
        ("4294967294", "4294967294"),
    ],
)
def test_job_ids_slurm_gives(value: Any, canonical: str) -> None:
    assert check_job_id(value) == canonical


@pytest.mark.parametrize(
    "bad",
    [
        "",
        " ",
        "abc",
        "../../escape",
        "-5",
        "1e3",
        "12_",
        "_1_",
        "12_3_4",
        "12+",
        "12_3+1",
        "--all",
        "12;rm",
        "12\n13",
        "\u0661\u0662",
        "99999999999",
        None,
        True,
        -1,
        1.5,
    ],
)
def test_anything_else_is_not_a_job_id(bad: Any) -> None:
    with pytest.raises(ValueError) as e:
        check_job_id(bad, "--job-id")
    assert str(e.value).startswith("--job-id ") and ID_FORMS in str(e.value)
    assert "\n" not in str(e.value)


def test_mark_with_a_path_as_job_id_writes_nothing_anywhere(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The issue's WRONG: SLURM_JOB_ID=../../escape slurmclock mark start wrote escape.jsonl
    outside the timeline folder and exited 0."""
    inner = tmp_path / "a" / "b" / "timelines"
    code, out, err = cli(
        capsys, "mark", "start", env={"SLURM_JOB_ID": "../../escape", "SLURMCLOCK_DIR": str(inner)}
    )
    assert code == 2 and out == ""
    line = one_line(err)
    assert "SLURM_JOB_ID '../../escape' is not a SLURM job id" in line and "unset it" in line
    assert list(tmp_path.rglob("*")) == []  # no folder made, no file written


@pytest.mark.parametrize("command", [["status"], ["seconds-left"], ["requeue"], ["timeline"]])
def test_every_command_refuses_a_garbage_slurm_job_id(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    code, out, err = cli(capsys, *command, env={"SLURM_JOB_ID": "abc"})
    assert code == 2 and out == ""
    assert "SLURM_JOB_ID 'abc' is not a SLURM job id" in one_line(err)  # never squeue'd


@pytest.mark.parametrize("value", ["", "abc", "--all", "12\n13", "1234_"])
def test_a_bad_job_id_option_is_an_error_not_no_job(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code, out, err = cli(capsys, "status", f"--job-id={value}", env={})
    assert code == 2 and out == ""
    assert f"--job-id {value!r} is not a SLURM job id" in one_line(err)


def test_a_good_job_id_option_beats_a_garbage_environment(
    capsys: pytest.CaptureFixture[str], fakes: Any
) -> None:
    runner = fakes.Runner(squeue="NONE UNLIMITED", scontrol="JobId=77 JobState=RUNNING Restarts=0")
    code, out, err = cli(
        capsys, "status", "--json", "--job-id", "0077", env={"SLURM_JOB_ID": "x"}, runner=runner
    )
    assert code == 0 and json.loads(out)["job_id"] == "77" and err == ""
    assert runner.calls == [
        ("scontrol", "show", "job", "-o", "77"),  # another job's facts: from SLURM
        ("squeue", "-h", "-o", "%e %l", "-j", "77"),
    ]


@pytest.mark.parametrize("bad", ["", "_1_", "12;rm", "\u0661\u0662\u0663", "99999999999", "-1"])
def test_stop_refuses_what_is_not_a_job_id(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    code, _, err = cli(capsys, "stop", bad, env={})
    assert code == 2 and f"JOBID {bad!r} is not a SLURM job id" in one_line(err)


def test_stop_passes_the_canonical_id(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    runner = fakes.Runner(scancel="")
    for given, sent in (("0001234", "1234"), ("1234+1", "1234+1"), ("5_07", "5_7")):
        assert cli(capsys, "stop", given, env={}, runner=runner)[0] == 0
        assert runner.calls[-1] == ("scancel", "--batch", "--signal=TERM", sent)


def test_the_library_treats_a_garbage_job_id_as_no_job_with_one_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    env = {"SLURM_JOB_ID": "../../escape", "SLURMCLOCK_DIR": str(tmp_path / "t")}
    assert job_id(env) is None and job_id(env) is None
    watcher = DeadlineWatcher(env=env, runner=NoSlurm(), clock=lambda: 1e9)
    assert watcher.get().source == "none"
    timeline = JobTimeline(env=env)
    assert timeline.path is None and not timeline.mark("start")
    assert list(tmp_path.rglob("*")) == []
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        f"SLURM_JOB_ID '../../escape' is not a SLURM job id: {ID_FORMS}; treating this process "
        "as outside a SLURM job"
    ]


def test_an_explicit_bad_job_id_in_the_api_raises_or_says_no(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="job_id '../x' is not a SLURM job id"):
        JobTimeline("../x", directory=tmp_path)
    result = requeue("../x", runner=NoSlurm())
    assert not result.ok and result.message.startswith("not requeued: job_id '../x' is not a")
    assert JobTimeline(1234, directory=tmp_path).path == tmp_path / "job-1234.jsonl"


def test_a_cluster_name_that_is_a_path_is_not_used_in_the_file_name(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    for bad in ("../../x", ".hidden", "a/b", "x" * 65):
        timeline = JobTimeline(
            env={"SLURM_JOB_ID": "5", "SLURM_CLUSTER_NAME": bad}, directory=tmp_path
        )
        assert timeline.path == tmp_path / "job-5.jsonl"
        assert timeline.mark("start")
    assert [p.name for p in tmp_path.iterdir()] == ["job-5.jsonl"]
    assert "SLURM_CLUSTER_NAME='../../x' cannot be part of a file name" in caplog.text
    good = JobTimeline(
        env={"SLURM_JOB_ID": "5", "SLURM_CLUSTER_NAME": "hpc-1.a_b"}, directory=tmp_path
    )
    assert good.path == tmp_path / "hpc-1.a_b-5.jsonl"


# -- other SLURM variables -------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["banana", "-1", "1.0", "99999999999", "\u0663", "1e3"])
def test_a_garbage_restart_count_is_named_once(raw: str, caplog: pytest.LogCaptureFixture) -> None:
    env = {"SLURM_RESTART_COUNT": raw}
    assert restart_count(env) == 0 and restart_count(env) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"SLURM_RESTART_COUNT={raw!r} is not a whole number >= 0; counting this run as restart 0"
    ]


def test_restart_count_reads_whole_numbers() -> None:
    assert [restart_count({"SLURM_RESTART_COUNT": v}) for v in ("", " 3 ", "007")] == [0, 3, 7]


@pytest.mark.parametrize(
    ("array", "task"), [("x", "../y"), ("5", ""), ("", "3"), ("5", "-1"), ("5", "1_2")]
)
def test_garbage_array_ids_are_not_reported_as_is(
    array: str, task: str, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"SLURM_ARRAY_JOB_ID": array, "SLURM_ARRAY_TASK_ID": task}
    assert array_task(env) is None
    assert "are not both whole numbers; reporting no array task" in caplog.text
    assert array_task({"SLURM_ARRAY_JOB_ID": "0012", "SLURM_ARRAY_TASK_ID": "7"}) == "12_7"


def test_status_json_stays_json_while_warnings_go_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"SLURM_RESTART_COUNT": "banana", "SLURM_ARRAY_JOB_ID": "x", "SLURM_ARRAY_TASK_ID": "y"}
    code, out, err = cli(capsys, "status", "--json", env=env)
    assert code == 0
    info = json.loads(out)
    assert (info["restart_count"], info["array_task"], info["job_id"]) == (0, None, None)
    assert len(err.strip().splitlines()) == 2 and "SLURM_RESTART_COUNT='banana'" in err


# -- the deadline options and variables --------------------------------------------------------


def test_end_time_and_time_limit_together_are_a_contradiction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in (["status"], ["status", "--json"], ["seconds-left"], ["end-time"]):
        code, out, err = cli(
            capsys, *command, "--end-time", "2026-01-01T00:00:00", "--time-limit", "1h", env={}
        )
        assert code == 2 and out == ""
        assert "both set the deadline; give one of them" in one_line(err)
    with pytest.raises(ValueError, match="both set the deadline"):
        DeadlineWatcher(end_time=2e9, time_limit=60)


def test_a_deadline_in_the_past_is_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "seconds-left", "--end-time", "2020-01-01T00:00:00Z", env={})
    assert code == 0 and int(out) < -100_000_000
    line = one_line(err)
    assert "the deadline 20" in line and "(from override) passed" in line and "s ago" in line
    code, out, err = cli(capsys, "status", "--end-time", str(time.time() + 3600), env={})
    assert code == 0 and err == ""


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("nan", "'nan' is neither epoch seconds nor ISO-8601"),
        ("1e400", "'1e400' is neither epoch seconds nor ISO-8601"),
        ("-5", "'-5' is not a valid time: epoch seconds must be > 0"),
        ("0", "'0' is not a valid time"),
        ("\u0661\u0667\u0669\u0669", "is neither epoch seconds nor ISO-8601"),  # not ASCII digits
        ("2026-13-01T00:00:00", "is neither epoch seconds nor ISO-8601"),
        ("10000-01-01T00:00:00", "is neither epoch seconds nor ISO-8601"),
        ("tomorrow", "is neither epoch seconds nor ISO-8601"),
    ],
)
def test_a_garbage_end_time_variable_is_a_usage_error_of_one_line(
    capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    code, out, err = cli(capsys, "status", "--json", env={"PYRECOVER_END_TIME": value})
    assert code == 2 and out == ""  # --json: nothing half-written on stdout
    line = one_line(err)
    assert line.startswith("slurmclock: error: PYRECOVER_END_TIME: ") and says in line


def test_a_blank_or_padded_end_time_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        json.loads(cli(capsys, "status", "--json", env={"PYRECOVER_END_TIME": "  "})[1])["source"]
        == "none"
    )
    end = int(time.time()) + 600
    code, out, _ = cli(capsys, "end-time", "--epoch", env={"PYRECOVER_END_TIME": f" {end}\n"})
    assert (code, out) == (0, f"{end}\n")


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--end-time", "", "--end-time: '' is neither epoch seconds nor ISO-8601"),
        ("--end-time", "\uff12\uff10\uff12\uff16-01-01", "is neither epoch seconds nor ISO-8601"),
        ("--time-limit", " ", "--time-limit: ' ' is not a time limit"),
        ("--time-limit", "1h30", "--time-limit: '1h30' is not a time limit"),
        ("--time-limit", "-5", "--time-limit: '-5' is negative"),
        ("--time-limit", "nan", "--time-limit: 'nan' is not a time limit"),
        ("--timeout", "0", "--timeout must be a finite number of seconds > 0"),
        ("--timeout", "nan", "--timeout must be a finite number of seconds > 0"),
        ("--timeout", "1e308", "--timeout 1e+308 is more than 3600 s"),
    ],
)
def test_odd_option_values_are_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    code, out, err = cli(capsys, "seconds-left", f"{flag}={value}", env={})
    assert code == 2 and out == ""
    assert says in one_line(err)


@pytest.mark.parametrize(("limit", "left"), [("1:75", 180), ("1 h", 3600), ("0:01", 60)])
def test_time_limit_odd_but_valid(
    capsys: pytest.CaptureFixture[str], limit: str, left: int
) -> None:
    code, out, _ = cli(capsys, "seconds-left", "--time-limit", limit, env={})
    assert code == 0 and left - 2 <= int(out) <= left


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("banana", "'banana' is not a duration"),
        ("5:00", "'5:00' is a SLURM time string (5 min to sbatch --time)"),
        ("-5", "'-5' must be a finite number of seconds >= 0"),
        ("nan", "'nan' is not a duration"),
        ("1e400", "'1e400' is not a duration"),
    ],
)
def test_a_garbage_signal_lead_is_named_and_ignored(
    raw: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert signal_lead_from_env({"PYRECOVER_SIGNAL_LEAD": raw}) is None
    assert says in caplog.text and "PYRECOVER_SIGNAL_LEAD" in caplog.text


# -- the timeline: damaged files, odd folders -------------------------------------------------


def test_garbage_and_nul_lines_are_counted_and_located(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "job-77.jsonl"
    path.write_bytes(
        b'{"event":"start","time":1,"restart":0}\ngarbage\n\x00\x00\x00\n'
        b'{"event":"saved","time":NaN,"restart":0}\n[1,2]\n'
        b'{"event":"start","time":5,"restart":true}\n{"event":5,"time":1,"restart":0}\n'
        b'{"event":"start","time":Infinity,"restart":0}\n{"event":"x","time":5,"restart":-1}\n'
        b'\n{"event":"exited","time":7,"restart":0}\r\n'
    )
    env = {"SLURMCLOCK_DIR": str(tmp_path)}
    code, out, err = cli(capsys, "timeline", "--job-id", "77", env=env)
    assert code == 0
    assert "(8 unreadable lines skipped: line 2, 3, 4, 5, 6, 7, 8, 9)" in out
    assert "start" in out and "exited" in out and "(no events yet)" not in out
    assert f"skipped 8 lines (2, 3, 4, 5, 6, ...) of the job timeline {path}" in one_line(err)
    code, out, _ = cli(capsys, "timeline", "--json", "--job-id", "77", env=env)
    data = json.loads(out)  # strict JSON: no NaN smuggled through
    assert data["unreadable_lines"] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert [e["event"] for e in data["events"]] == ["start", "exited"]


def test_a_timeline_of_only_garbage_does_not_say_no_events_yet(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "job-78.jsonl").write_bytes(b"\x01\xff\xfe garbage" * 200 + b"\n\x00\n")
    code, out, _ = cli(capsys, "timeline", "--job-id", "78", env={"SLURMCLOCK_DIR": str(tmp_path)})
    assert code == 0 and "(2 unreadable lines skipped: line 1, 2)" in out
    assert "(no events yet)" not in out


@pytest.mark.parametrize("kind", ["folder is a file", "file is a folder"])
def test_an_unreadable_timeline_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    if kind == "folder is a file":
        (tmp_path / "f").touch()
        directory, expected = tmp_path / "f", "Not a directory"
    else:
        (tmp_path / "job-6.jsonl").mkdir()
        directory, expected = tmp_path, "Is a directory"
    env = {"SLURMCLOCK_DIR": str(directory)}
    code, out, err = cli(capsys, "timeline", "--job-id", "6", env=env)
    assert code == 0 and f"(cannot read it: {expected})" in out and "(no events yet)" not in out
    assert f"cannot read the job timeline {directory / 'job-6.jsonl'}: {expected}" in one_line(err)


@pytest.mark.parametrize(
    ("directory", "says"),
    [("file", "Not a directory"), ("long", "File name too long"), ("/proc/nope", "No such file")],
)
def test_mark_into_an_unusable_folder_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, directory: str, says: str
) -> None:
    (tmp_path / "file").touch()
    where = {
        "file": str(tmp_path / "file"),
        "long": str(tmp_path / ("x" * 300) / ("y" * 300)),
        "/proc/nope": "/proc/nope",
    }[directory]
    code, out, err = cli(
        capsys, "mark", "start", env={"SLURM_JOB_ID": "5", "SLURMCLOCK_DIR": where}
    )
    assert code == 1 and out == ""
    line = one_line(err)
    assert f"cannot write the job timeline {where}/job-5.jsonl: {says}" in line
    assert "set SLURMCLOCK_DIR to a writable folder" in line


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("rc", "'rc' is not KEY=VALUE"),
        ("=1", "'=1' is not KEY=VALUE"),
        ("a b=1", "'a b=1' is not KEY=VALUE"),
        ("time=5", "'time' is reserved: every timeline line has event, time, restart"),
        ("host=x", "'host' is reserved"),
        ("why=a\nb", "why=... holds a line break or another control character"),
        ("why=\x1b[2J", "why=... holds a line break"),
        ("x=" + "a" * 2000, "x=... is 2002 characters; a timeline detail takes at most 1000"),
    ],
)
def test_mark_refuses_odd_details(
    capsys: pytest.CaptureFixture[str], item: str, says: str, tmp_path: Path
) -> None:
    env = {"SLURM_JOB_ID": "5", "SLURMCLOCK_DIR": str(tmp_path)}
    code, _, err = cli(capsys, "mark", "exited", item, env=env)
    assert code == 2 and says in one_line(err)
    assert not (tmp_path / "job-5.jsonl").exists()


def test_mark_numbers_are_ascii_integers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = {"SLURM_JOB_ID": "5", "SLURMCLOCK_DIR": str(tmp_path)}
    assert cli(capsys, "mark", "exited", "rc=-9", "a=\u0663", "b=1.5", "c=", env=env)[0] == 0
    line = json.loads((tmp_path / "job-5.jsonl").read_text())
    assert (line["rc"], line["a"], line["b"], line["c"]) == (-9, "\u0663", "1.5", "")


# -- as a real process: closed pipes, Ctrl-C -------------------------------------------------------

CLOCK = [sys.executable, "-m", "slurmclock"]


def test_a_closed_stdout_pipe_ends_quietly(tmp_path: Path) -> None:
    """`slurmclock timeline | head -1` on a long timeline: no traceback, no Broken pipe."""
    lines = [json.dumps({"event": "start", "time": 1e9 + i, "restart": 0}) for i in range(20000)]
    (tmp_path / "job-9.jsonl").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "SLURMCLOCK_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [*CLOCK, "timeline", "--job-id", "9"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader is done, like `head -1`
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert first.startswith(b"timeline of job 9") and err == b"", err


def test_ctrl_c_while_squeue_hangs_is_one_line_and_130(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("squeue", "scontrol"):
        (fake / name).write_text("#!/bin/sh\nexec sleep 60\n")
        (fake / name).chmod(0o755)
    ready = tmp_path / "ready"
    (fake / "squeue").write_text(f"#!/bin/sh\ntouch {ready}\nexec sleep 60\n")
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "5"}
    proc = subprocess.Popen(
        [*CLOCK, "status"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    end = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < end and proc.poll() is None, "squeue never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.decode().strip() == "slurmclock: interrupted" and out == b""


# -- what SLURM's commands print, when it is odd ------------------------------------------------


@pytest.mark.parametrize(
    ("line", "end", "says"),
    [
        ("x" * 5000, None, "cannot read squeue's end time for job 5: 'xxxx"),
        ("nan 1:00", None, "'nan' is neither epoch seconds nor ISO-8601"),
        ("2030-03-17T20:00:00+99:00 1:00", None, "is neither epoch seconds nor ISO-8601"),
        ("Unknown 1:00", None, "squeue gives job 5 no end time ('Unknown'); is it still pending?"),
        ("\n\n", None, "squeue printed nothing for job 5 (job over?)"),
        # A limit SLURM never prints (a bare 0, -5) is "unknown", never "no limit": the end
        # time stands.
        ("@END 0", "@END", ""),
        ("@END -5", "@END", ""),
        ("@END Partition_Limit", "@END", ""),
        ("@END 7:00", "@END", ""),
        ("@END UNLIMITED", None, ""),
    ],
)
def test_odd_squeue_output_is_one_short_line(
    fakes: Any, clock: Any, caplog: pytest.LogCaptureFixture, line: str, end: Any, says: str
) -> None:
    iso = fakes.iso(clock.now + 600)
    runner = fakes.Runner(squeue=line.replace("@END", iso), scontrol="JobId=5 JobName=x")
    d = DeadlineWatcher(env={"SLURM_JOB_ID": "5"}, runner=runner, clock=clock).get()
    assert d.end == (None if end is None else clock.now + 600), d
    if says:
        assert says in caplog.text
    assert all(len(r.getMessage()) < 300 for r in caplog.records), caplog.text

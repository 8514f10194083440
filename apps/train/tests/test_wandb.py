"""WandbLogger (pyrecover_train.wandb_log, the app's --wandb): the decision logic on a fake module;
the real wandb (offline) when installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pyrecover_train.wandb_log import WandbLogger, has_credentials


class FakeRun:
    def __init__(self, fail_log: bool = False) -> None:
        self.logged: list[tuple[dict[str, Any], int | None]] = []
        self.summary: dict[str, Any] = {}
        self.finished: list[int | None] = []
        self.fail_log = fail_log

    def log(self, data: dict[str, Any], step: int | None = None) -> None:
        if self.fail_log:
            raise ConnectionError("wandb backend went away")
        self.logged.append((data, step))

    def finish(self, exit_code: int | None = None) -> None:
        self.finished.append(exit_code)


class FakeWandb:
    def __init__(self, fail_init: bool = False, fail_log: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.runs: list[FakeRun] = []
        self.fail_init, self.fail_log = fail_init, fail_log

    def init(self, **kwargs: Any) -> FakeRun:
        self.calls.append(kwargs)
        if self.fail_init:
            raise TimeoutError("could not reach api.wandb.ai")
        self.runs.append(FakeRun(self.fail_log))
        return self.runs[-1]


class Untouchable:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"wandb.{name} must not be used here")


NO_CREDS = {"HOME": "/nonexistent-home"}


def test_offline_logs_from_rank_zero() -> None:
    fake = FakeWandb()
    with WandbLogger(
        project="p",
        rank=0,
        config={"lr": 0.1},
        run_id="job-7",
        mode="offline",
        env=NO_CREDS,
        module=fake,
        tags=["a"],
    ) as wb:
        assert wb.active and wb.reason is None
        wb.log({"loss": 1.5}, step=3)
        wb.summary({"best": 1.5})
    assert fake.calls == [
        {
            "project": "p",
            "name": None,
            "mode": "offline",
            "tags": ["a"],
            "config": {"lr": 0.1},
            "id": "job-7",
            "resume": "allow",
        }
    ]
    run = fake.runs[0]
    assert run.logged == [({"loss": 1.5}, 3)]
    assert run.summary == {"best": 1.5}
    assert run.finished == [0]
    assert not wb.active
    wb.log({"loss": 0.0})  # after finish: a no-op, no error
    assert len(run.logged) == 1


def test_exception_in_block_finishes_with_exit_code_one() -> None:
    fake = FakeWandb()
    with (
        pytest.raises(KeyError),
        WandbLogger(project="p", mode="offline", env=NO_CREDS, module=fake),
    ):
        raise KeyError("x")
    assert fake.runs[0].finished == [1]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"rank": 3}, "rank 3 does not log"),
        ({"mode": "disabled"}, "WANDB_MODE=disabled"),
        ({"env": {**NO_CREDS, "WANDB_MODE": "disabled"}}, "WANDB_MODE=disabled"),
        ({"mode": "sometimes"}, "unknown W&B mode 'sometimes'"),
        ({"mode": "online"}, "no W&B credentials"),
        ({}, "no W&B credentials"),  # online is wandb's default
    ],
)
def test_inactive_without_touching_wandb(kwargs: dict[str, Any], reason: str) -> None:
    kwargs.setdefault("env", NO_CREDS)
    wb = WandbLogger(project="p", module=Untouchable(), **kwargs)
    assert not wb.active and reason in (wb.reason or "")
    wb.log({"loss": 1.0})
    wb.summary({"x": 1})
    wb.finish()


def test_online_with_an_api_key_or_netrc(tmp_path: Path) -> None:
    fake = FakeWandb()
    assert WandbLogger(project="p", env={"WANDB_API_KEY": "k" * 40}, module=fake).active
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    netrc.chmod(0o600)
    assert has_credentials({"NETRC": str(netrc)})
    assert not has_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.org"})
    assert not has_credentials({"NETRC": str(tmp_path / "missing")})
    assert WandbLogger(project="p", env={"NETRC": str(netrc)}, module=fake).active
    assert [c["mode"] for c in fake.calls] == ["online", "online"]


def warned(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The app logger's lines: a failure is one of them, never a Python warning (the
    tests run with warnings as errors, so a warnings.warn would fail them)."""
    return [r.getMessage() for r in caplog.records if r.name == "pyrecover_train"]


@pytest.mark.filterwarnings("error")
def test_init_failure_disables_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    wb = WandbLogger(project="p", mode="offline", env=NO_CREDS, module=FakeWandb(fail_init=True))
    assert warned(caplog) == [
        "WandbLogger disabled: wandb.init failed: TimeoutError: could not reach api.wandb.ai"
    ]
    assert not wb.active and "wandb.init failed: TimeoutError" in (wb.reason or "")
    assert wb.reported  # a caller need not say it again
    wb.log({"loss": 1.0})
    assert len(warned(caplog)) == 1
    quiet = WandbLogger(project="p", env=NO_CREDS, module=FakeWandb())
    assert not quiet.active and not quiet.reported and len(warned(caplog)) == 1  # caller says it


@pytest.mark.filterwarnings("error")
def test_log_failure_disables_instead_of_crashing_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeWandb(fail_log=True)
    wb = WandbLogger(project="p", mode="offline", env=NO_CREDS, module=fake)
    wb.log({"loss": 1.0})
    wb.log({"loss": 0.5})  # disabled: no second line
    assert warned(caplog) == [
        "WandbLogger disabled: run.log failed: ConnectionError: wandb backend went away"
    ]
    assert not wb.active and fake.runs[0].finished == [1]


@pytest.mark.filterwarnings("error")
def test_finish_failure_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeWandb()
    wb = WandbLogger(project="p", mode="offline", env=NO_CREDS, module=fake)

    def fail(exit_code: int | None = None) -> None:
        raise OSError("disk full")

    fake.runs[0].finish = fail  # type: ignore[method-assign]
    wb.finish()
    assert warned(caplog) == ["WandbLogger: wandb finish failed: OSError: disk full"]
    assert not wb.active and wb.reason == "finished"


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_missing_wandb_package(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Not installed is the reason, also online without credentials (issue 30: it blamed the
    credentials, and a `wandb login` would not have helped)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    wb = WandbLogger(project="p", mode=mode, env=NO_CREDS)
    assert not wb.active
    assert (
        wb.reason
        == "wandb is not installed: pip install wandb (or the extra 'pyrecover-train[wandb]')"
    )


def test_importing_the_logger_does_not_import_wandb() -> None:
    """wandb is optional: it comes in when a logger starts, not with the app's console."""
    code = (
        "import sys; from pyrecover_train import console, wandb_log\n"
        "print('wandb' in sys.modules, wandb_log.WandbLogger.__name__)"
    )
    # torch comes with the console: a busy machine may take a while to import it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "WandbLogger"]


def test_no_shared_state_between_loggers() -> None:
    fake = FakeWandb()
    a = WandbLogger(project="a", mode="offline", env=NO_CREDS, module=fake)
    b = WandbLogger(project="b", mode="offline", env=NO_CREDS, module=fake)
    a.log({"x": 1})
    a.finish()
    b.log({"x": 2})
    assert fake.runs[0].logged == [({"x": 1}, None)] and fake.runs[1].logged == [({"x": 2}, None)]
    assert b.active and not a.active


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None,
    reason="wandb is not installed (pip install './apps/train[wandb]' for the real offline test)",
)
def test_real_wandb_offline(tmp_path: Path) -> None:
    code = (
        "from pyrecover_train.wandb_log import WandbLogger\n"
        "with WandbLogger(project='pyrecover-test', config={'lr': 0.25},"
        " run_id='job-42', dir='.') as wb:\n"
        "    assert wb.active, wb.reason\n"
        "    for i in range(3):\n"
        "        wb.log({'loss_metric': 1.0 / (i + 1)}, step=i)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", HOME=str(tmp_path), WANDB_SILENT="true")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*-job-42/run-job-42.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    assert b"loss_metric" in data and b"lr" in data

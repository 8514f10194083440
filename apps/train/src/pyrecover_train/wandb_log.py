"""Optional rank-0 experiment logging to Weights & Biases (``--wandb``; the extra
``pyrecover-train[wandb]``).

Every failure mode turns it into a no-op with a reason instead of an exception or a hang: not
rank 0, wandb not installed, ``WANDB_MODE=disabled``, no credentials for online mode (which would
otherwise prompt on a batch node), or ``wandb.init`` failing. Training never dies for its logger.
A failure of wandb is one line on the ``pyrecover_train`` logger, never a raw Python warning.
No module-level state: the run object is held by the logger instance. Standard library only:
``wandb`` is imported when a logger starts, not with this module (nor with the app). Nothing here
reads the job: the caller passes the rank and a run id that survives a requeue.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlparse

log = logging.getLogger("pyrecover_train")


class MetricsLogger(Protocol):
    """What a trainer needs from an experiment logger; WandbLogger is one."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...

    def finish(self) -> None: ...


OFFLINE_MODES = ("offline", "dryrun")
NOT_INSTALLED = "wandb is not installed: pip install wandb (or the extra 'pyrecover-train[wandb]')"


class WandbLogger:
    """Log metrics from rank 0 to W&B; a no-op everywhere else (see :attr:`reason`).

        with WandbLogger(project="gpt", rank=rank, config=vars(args),
                         run_id=f"job-{slurmclock.job_id()}") as wb:
            wb.log({"loss": loss}, step=step)

    ``run_id`` + ``resume="allow"`` (the default here) makes a requeued SLURM job continue the same
    W&B run. ``mode`` defaults to ``WANDB_MODE``; ``offline`` needs no account. ``init_kwargs``
    go to ``wandb.init`` (entity, group, tags, dir, settings, ...). ``module`` replaces the
    imported ``wandb`` (tests). ``env`` replaces ``os.environ`` for the credential check.
    """

    def __init__(
        self,
        *,
        project: str | None = None,
        rank: int = 0,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        mode: str | None = None,
        env: Mapping[str, str] | None = None,
        module: Any = None,
        **init_kwargs: Any,
    ) -> None:
        self.run: Any = None
        self.reason: str | None = None
        self.reported = False  # the reason was logged here (a failure); else the caller says it
        environ = os.environ if env is None else env
        mode = mode or environ.get("WANDB_MODE") or "online"
        self.reason = self._why_inactive(rank, mode, environ, installed=module is not None)
        if self.reason is not None:
            return
        wandb = module if module is not None else _import_wandb()
        if wandb is None:
            self.reason = NOT_INSTALLED
            return
        kwargs: dict[str, Any] = {"project": project, "name": name, "mode": mode, **init_kwargs}
        if config is not None:
            kwargs["config"] = dict(config)
        if run_id is not None:
            kwargs["id"] = run_id
            kwargs.setdefault("resume", "allow")
        try:
            self.run = wandb.init(**kwargs)
        except Exception as e:  # network, bad project name, ...: log nothing rather than crash
            self.reason = f"wandb.init failed: {type(e).__name__}: {e}"
            log.warning("WandbLogger disabled: %s", self.reason)
            self.reported = True
            self.run = None

    @staticmethod
    def _why_inactive(
        rank: int, mode: str, env: Mapping[str, str], *, installed: bool
    ) -> str | None:
        if rank != 0:
            return f"rank {rank} does not log (only rank 0 does)"
        if mode == "disabled":
            return "WANDB_MODE=disabled"
        if mode not in ("online", "run", *OFFLINE_MODES):
            return f"unknown W&B mode {mode!r} (use online, offline or disabled)"
        # Before the credentials: without the package, a login would not help.
        if not installed and importlib.util.find_spec("wandb") is None:
            return NOT_INSTALLED
        if mode in OFFLINE_MODES or has_credentials(env):
            return None
        return (
            "no W&B credentials for online mode (set WANDB_API_KEY, run `wandb login`, or "
            "export WANDB_MODE=offline and `wandb sync` later)"
        )

    @property
    def active(self) -> bool:
        return self.run is not None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self.run is None:
            return
        try:
            self.run.log(dict(metrics), step=step)
        except Exception as e:
            self._disable(f"run.log failed: {type(e).__name__}: {e}")

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set final values shown in the W&B run table (best loss, tokens seen, ...)."""
        if self.run is None:
            return
        try:
            self.run.summary.update(dict(values))
        except Exception as e:
            self._disable(f"summary update failed: {type(e).__name__}: {e}")

    def finish(self, exit_code: int | None = None) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        if self.reason is None:
            self.reason = "finished"
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            log.warning("WandbLogger: wandb finish failed: %s: %s", type(e).__name__, e)

    def _disable(self, reason: str) -> None:
        log.warning("WandbLogger disabled: %s", reason)
        self.reason, self.reported = reason, True
        run, self.run = self.run, None
        try:
            run.finish(exit_code=1)
        except Exception:
            pass

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


def _import_wandb() -> Any:
    try:
        return importlib.import_module("wandb")
    except ImportError:
        return None


def has_credentials(env: Mapping[str, str]) -> bool:
    """Would ``wandb.init`` in online mode find an API key without prompting?"""
    if env.get("WANDB_API_KEY", "").strip() or env.get("WANDB_IDENTITY_TOKEN_FILE", "").strip():
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = Path(env.get("NETRC") or Path(env.get("HOME") or Path.home()) / ".netrc")
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False

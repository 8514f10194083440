"""``--profile``: the original's profiling of steps ``--profile-step-start`` to
``--profile-step-end``, as a torch.profiler trace any machine can read (``EXP_DIR/profile-...json``,
for chrome://tracing or Perfetto); on CUDA also ``cudaProfilerStart/Stop`` around the same steps,
so ``nsys profile --capture-range=cudaProfilerApi`` records just them, as with the original."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig

log = logging.getLogger("pyrecover_train")


class StepProfiler:
    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int) -> None:
        self.enabled = cfg.profile
        self.first, self.last = cfg.profile_step_start, cfg.profile_step_end
        self.device, self.rank = device, rank
        self.out = cfg.exp_dir / f"profile-steps{self.first}-{self.last}-rank{rank}.json"
        self._prof: Any = None
        self._done = False

    def around(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Wrap the work of ``step`` (a no-op context when profiling is off)."""
        return self._profiled(step) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        if self._prof is None and not self._done and self.first <= step <= self.last:
            self._begin()
        yield
        if step >= self.last:
            self.close()

    def _begin(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.cudart().cudaProfilerStart()
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self._prof.__enter__()

    def close(self) -> Path | None:
        """End profiling (also when the run stops before the last step) and write the trace."""
        if self._prof is None:
            return None
        prof, self._prof, self._done = self._prof, None, True
        prof.__exit__(None, None, None)
        if self.device.type == "cuda":
            torch.cuda.cudart().cudaProfilerStop()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out))
        log.info("--profile: steps %d-%d traced to %s", self.first, self.last, self.out)
        return self.out

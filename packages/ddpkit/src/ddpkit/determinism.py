"""Deterministic mode: the same inputs give the same bits, so a resumed run equals a straight one.

``set_determinism(device, deterministic)`` sets every switch torch has for it in one place:

- on: ``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS
  reads it when its first handle is made: call this before the first CUDA matmul, i.e. right
  after ``init()``), cuDNN deterministic with benchmark off, TF32 off, and the math
  scaled-dot-product-attention backend only (the flash, memory-efficient and cuDNN backends are
  not bitwise reproducible in their backward pass);
- off on CUDA: TF32 on for matmuls and cuDNN, every attention backend allowed (the fast default);
- the CPU default is on with ``warn_only=True``: CPU kernels are deterministic already, the call
  only makes torch pick the deterministic variant where there are two, and it is what
  pyrecover-train's bitwise CPU resume has always relied on.

What it cannot promise: equal bits across different GPUs models, drivers, CUDA/cuDNN/NCCL or
torch versions, world sizes, or batch shapes; NCCL's all-reduce/reduce-scatter order is fixed in
practice for one topology and NCCL version but not documented as such.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
INDUCTOR_ENV = "TORCHINDUCTOR_DETERMINISTIC"  # inductor's switch, read when it is imported
CUBLAS_DETERMINISTIC = ":4096:8"
_CUBLAS_OK = (":4096:8", ":16:8")  # the two values torch accepts as deterministic


@dataclass(frozen=True, slots=True)
class Determinism:
    """What :func:`set_determinism` set, for logs and checkpoint metadata."""

    device_type: str
    deterministic: bool
    warn_only: bool
    tf32: bool | None  # None on CPU: there is no TF32 there
    attention: str  # "math" (deterministic) or "any" (torch picks the fastest)
    cublas_workspace_config: str | None
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """One line, e.g. for the start-up log."""
        mode = {(True, True): "on (warn only)", (True, False): "on"}.get(
            (self.deterministic, self.warn_only), "off"
        )
        parts = [f"deterministic {mode} on {self.device_type}"]
        if self.tf32 is not None:
            parts.append(f"TF32 {'on' if self.tf32 else 'off'}")
            parts.append(f"attention {self.attention}")
        if self.cublas_workspace_config:
            parts.append(f"{CUBLAS_ENV}={self.cublas_workspace_config}")
        return ", ".join(parts + list(self.notes))


def set_determinism(
    device: torch.device | str,
    deterministic: bool | None = None,
    *,
    warn_only: bool | None = None,
) -> Determinism:
    """Turn deterministic mode on or off for ``device``'s kind (process-wide torch switches).

    ``deterministic`` None means the device's default: on for CPU, off for CUDA. ``warn_only``
    None means True on CPU and False on CUDA: an operation without a deterministic kernel then
    raises at once instead of silently breaking the guarantee you asked for.
    """
    dev = torch.device(device)
    on = dev.type == "cpu" if deterministic is None else bool(deterministic)
    lenient = dev.type == "cpu" if warn_only is None else bool(warn_only)
    notes: list[str] = []
    cublas = None
    if dev.type == "cuda":
        if on:
            cublas = _cublas_config(notes)
        _cuda_switches(on)
    _deterministic_algorithms(on, warn_only=lenient if on else False)
    return Determinism(
        device_type=dev.type,
        deterministic=on,
        warn_only=lenient if on else False,
        tf32=(not on) if dev.type == "cuda" else None,
        attention="math" if on and dev.type == "cuda" else "any",
        cublas_workspace_config=cublas,
        notes=tuple(notes),
    )


def _deterministic_algorithms(on: bool, *, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms`` without its start-up cost.

    torch's function imports ``torch._inductor`` (dynamo, sympy: 1.5-5 s of every allocation's
    start-up) only to set inductor's own switch. An eager run never reads that switch; inductor
    reads it from the environment when it is first imported, so a later ``torch.compile`` gets
    the same setting. Once inductor is loaded, torch's own function is as cheap and is used.
    """
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if "torch._inductor.config" in sys.modules or setter is None:
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
        return
    os.environ[INDUCTOR_ENV] = "1" if on else "0"
    setter(on, warn_only=warn_only)


def _cublas_config(notes: list[str]) -> str:
    before = os.environ.get(CUBLAS_ENV)
    if before in _CUBLAS_OK:
        return before
    os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
    if before:
        notes.append(f"{CUBLAS_ENV}={before!r} replaced (not deterministic)")
    return CUBLAS_DETERMINISTIC


def _cuda_switches(deterministic: bool) -> None:
    torch.backends.cudnn.deterministic = deterministic
    if deterministic:
        torch.backends.cudnn.benchmark = False  # autotuning may pick another kernel per run
    # The legacy switches: torch 2.9+'s fp32_precision API makes later legacy reads raise.
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    cuda = torch.backends.cuda
    cuda.enable_math_sdp(True)
    for enable in (cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp, cuda.enable_cudnn_sdp):
        enable(not deterministic)

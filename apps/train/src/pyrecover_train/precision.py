"""Mixed precision done right: autocast with fp32 master weights, GradScaler for fp16.

The original PyRecover cast the whole model to bf16 (no master weights): small updates vanish in
bf16 weights. Here the weights and optimizer state stay fp32 and only the matmuls run in bf16/fp16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


class PrecisionError(ValueError):
    """The requested dtype cannot run on this device."""


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    use_scaler: bool

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.autocast_dtype):
            yield

    def scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        # fp16 has 5 exponent bits: small gradients underflow without loss scaling.
        return torch.amp.GradScaler(device.type) if self.use_scaler else None


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The precision for ``--model-dtype name`` on ``device``; PrecisionError when unsupported."""
    if name == "fp32":
        return Precision(name, torch.float32, None, False)
    if name == "fp64":
        return Precision(name, torch.float64, None, False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    if dtype is None:
        raise PrecisionError(f"unknown --model-dtype {name!r}: pick fp16, bf16, fp32 or fp64")
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise PrecisionError(
            f"--model-dtype bf16 needs a GPU with bf16 support (Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none: use --model-dtype fp16"
        )
    if device.type == "cpu" and not _cpu_autocast_works(dtype):
        raise PrecisionError(
            f"--model-dtype {name} is not supported by this CPU/torch build (autocast failed): "
            "use --model-dtype fp32 on CPU"
        )
    return Precision(name, torch.float32, dtype, dtype is torch.float16)


def _cpu_autocast_works(dtype: torch.dtype) -> bool:
    """Probe a tiny forward+backward: support depends on the torch build and the CPU."""
    try:
        w = torch.randn(8, 8, requires_grad=True)
        with torch.autocast(device_type="cpu", dtype=dtype):
            y = torch.nn.functional.linear(torch.randn(4, 8), w)
        if y.dtype is not dtype:
            return False
        y.float().sum().backward()
        return w.grad is not None and bool(torch.isfinite(w.grad).all())
    except (RuntimeError, TypeError):
        return False

"""Deterministic mode: the same inputs give the same bits, so a resumed run equals a straight one.

``set_determinism(device, deterministic)`` sets every switch torch has for it in one place:

- on: ``torch.use_deterministic_algorithms(True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS
  reads it when its first handle is made: call this before the first CUDA matmul, i.e. right
  after ``init()``), cuDNN deterministic with benchmark off, TF32 off, and fast attention with
  a deterministic backward: with ``use_deterministic_algorithms(True)`` (not ``warn_only``)
  torch runs flash attention's backward in its deterministic mode and memory-efficient
  attention's with one split of the keys (no atomics); cuDNN attention has no deterministic
  backward in torch and is switched off; math attention (which materialises the attention
  matrix: slow and memory-hungry on long sequences) stays the fallback for shapes the fast
  kernels do not take. ``attention="math"`` (or ``DDPKIT_DETERMINISTIC_ATTENTION=math``)
  forces the math backend alone, as before;
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
ATTENTION_ENV = "DDPKIT_DETERMINISTIC_ATTENTION"  # "fast" (default) or "math"
ATTENTION_CHOICES = ("fast", "math")
# What deterministic mode lets attention run on CUDA, for the log (torch picks per shape).
_ATTENTION = {
    "fast": "flash or memory-efficient (deterministic backward), cuDNN off",
    "math": "math only",
}
CUBLAS_DETERMINISTIC = ":4096:8"
_CUBLAS_OK = (":4096:8", ":16:8")  # the two values torch accepts as deterministic


@dataclass(frozen=True, slots=True)
class Determinism:
    """What :func:`set_determinism` set, for logs and checkpoint metadata."""

    device_type: str
    deterministic: bool
    warn_only: bool
    tf32: bool | None  # None on CPU: there is no TF32 there
    attention: str  # what attention may run (see _ATTENTION), or "any" (torch picks)
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
    attention: str | None = None,
) -> Determinism:
    """Turn deterministic mode on or off for ``device``'s kind (process-wide torch switches).

    ``deterministic`` None means the device's default: on for CPU, off for CUDA. ``warn_only``
    None means True on CPU and False on CUDA: an operation without a deterministic kernel then
    raises at once instead of silently breaking the guarantee you asked for (and the fast
    attention kernels run their deterministic backward only without it). ``attention``, for
    deterministic mode on CUDA: "fast" (flash / memory-efficient with deterministic backward)
    or "math" (the math backend alone); None: ``$DDPKIT_DETERMINISTIC_ATTENTION``, else "fast".
    """
    dev = torch.device(device)
    on = dev.type == "cpu" if deterministic is None else bool(deterministic)
    lenient = dev.type == "cpu" if warn_only is None else bool(warn_only)
    kind = _attention_choice(attention)
    notes: list[str] = []
    cublas = None
    if dev.type == "cuda":
        if on:
            cublas = _cublas_config(notes)
        _cuda_switches(on, math_only=kind == "math")
    _deterministic_algorithms(on, warn_only=lenient if on else False)
    attention = _ATTENTION[kind] if on and dev.type == "cuda" else "any"
    if on and lenient and kind == "fast":  # torch runs the fast backward then, and warns
        attention = attention.replace("(deterministic backward)", "(backward NOT deterministic)")
    return Determinism(
        device_type=dev.type,
        deterministic=on,
        warn_only=lenient if on else False,
        tf32=(not on) if dev.type == "cuda" else None,
        attention=attention,
        cublas_workspace_config=cublas,
        notes=tuple(notes),
    )


def _attention_choice(attention: str | None) -> str:
    kind = attention or os.environ.get(ATTENTION_ENV) or "fast"
    if kind not in ATTENTION_CHOICES:
        where = "attention" if attention else ATTENTION_ENV
        raise ValueError(f"{where}={kind!r}: pick one of {', '.join(ATTENTION_CHOICES)}")
    return kind


def attention_kernel(q: torch.Tensor, *, causal: bool = True) -> str:
    """Which scaled-dot-product-attention kernel torch runs for queries, keys and values like
    ``q`` (batch, heads, sequence, head dim; its dtype and device) under the switches now set,
    e.g. "flash (deterministic backward)" -- torch's own choice (``_fused_sdp_choice``), for the
    log. Deterministic mode on CUDA adds how the backward runs."""
    from torch.nn.attention import SDPBackend

    try:
        choice = SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=causal)).name
    except RuntimeError as e:  # no kernel takes these inputs: SDPA itself would raise
        return f"none ({str(e).splitlines()[0]})"
    name = {
        "FLASH_ATTENTION": "flash",
        "EFFICIENT_ATTENTION": "memory-efficient",
        "CUDNN_ATTENTION": "cuDNN",
        "MATH": "math",
    }.get(choice, choice.lower())
    if q.device.type != "cuda":
        return f"{name} ({q.device.type})"
    if not torch.are_deterministic_algorithms_enabled():
        return name
    strict = not torch.is_deterministic_algorithms_warn_only_enabled()
    exact = name == "math" or (strict and name in ("flash", "memory-efficient"))
    return f"{name} ({'deterministic' if exact else 'NOT deterministic'} backward)"


def attention_nondeterminism(q: torch.Tensor) -> str | None:
    """Does attention's backward on inputs like ``q`` give the same bits twice under the
    switches now set? None when it does; else why not: the kernel refused deterministic mode
    (an error), or two backward passes of the same inputs differed. A check worth its few
    milliseconds on a GPU before a run that promises bitwise resumes: the fast kernels'
    deterministic backward depends on the torch build."""
    import torch.nn.functional as F

    gen = torch.Generator(device=q.device).manual_seed(0)
    x = torch.randn(q.shape, dtype=q.dtype, device=q.device, generator=gen)
    grads: list[torch.Tensor] = []
    try:
        for _ in range(2):
            leaf = x.clone().requires_grad_()
            F.scaled_dot_product_attention(leaf, leaf, leaf, is_causal=True).sum().backward()
            assert leaf.grad is not None  # the backward just ran
            grads.append(leaf.grad)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    if not torch.equal(grads[0], grads[1]):
        return "two backward passes of the same inputs differed"
    return None


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


def _cuda_switches(deterministic: bool, *, math_only: bool) -> None:
    torch.backends.cudnn.deterministic = deterministic
    if deterministic:
        torch.backends.cudnn.benchmark = False  # autotuning may pick another kernel per run
    # The legacy switches: torch 2.9+'s fp32_precision API makes later legacy reads raise.
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    cuda = torch.backends.cuda
    cuda.enable_math_sdp(True)
    fast = not (deterministic and math_only)
    cuda.enable_flash_sdp(fast)
    cuda.enable_mem_efficient_sdp(fast)
    cuda.enable_cudnn_sdp(not deterministic)  # no deterministic backward in torch

"""set_determinism: the switches for CPU and CUDA (the CUDA ones are process-wide flags, so they
are checked here on any machine; the GPU bitwise resume itself runs in bench/gpu.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from ddpkit import (
    CUBLAS_DETERMINISTIC,
    attention_kernel,
    attention_nondeterminism,
    set_determinism,
)

CUDA = torch.backends.cuda


def switches() -> dict[str, object]:
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": CUDA.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "sdp": (
            CUDA.flash_sdp_enabled(),
            CUDA.mem_efficient_sdp_enabled(),
            CUDA.cudnn_sdp_enabled(),
            CUDA.math_sdp_enabled(),
        ),
    }


@pytest.fixture(autouse=True)
def _restore(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = switches()
    yield
    torch.use_deterministic_algorithms(
        bool(before["algorithms"]), warn_only=bool(before["warn_only"])
    )
    torch.backends.cudnn.deterministic = bool(before["cudnn_deterministic"])
    torch.backends.cudnn.benchmark = bool(before["cudnn_benchmark"])
    CUDA.matmul.allow_tf32 = bool(before["tf32_matmul"])
    torch.backends.cudnn.allow_tf32 = bool(before["tf32_cudnn"])
    flash, mem, cudnn, math = before["sdp"]  # type: ignore[misc]
    CUDA.enable_flash_sdp(flash)
    CUDA.enable_mem_efficient_sdp(mem)
    CUDA.enable_cudnn_sdp(cudnn)
    CUDA.enable_math_sdp(math)


def test_cpu_default_is_on_with_warn_only_and_touches_nothing_else() -> None:
    before = switches()
    got = set_determinism("cpu")
    after = switches()
    assert (after["algorithms"], after["warn_only"]) == (True, True)
    assert {k: v for k, v in after.items() if k not in ("algorithms", "warn_only")} == {
        k: v for k, v in before.items() if k not in ("algorithms", "warn_only")
    }
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert got.describe() == "deterministic on (warn only) on cpu"
    off = set_determinism(torch.device("cpu"), False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert off.describe() == "deterministic off on cpu"


def test_cuda_on_sets_every_switch() -> None:
    got = set_determinism("cuda:0", True)
    assert switches() == {
        "algorithms": True,
        "warn_only": False,  # a missing deterministic kernel raises instead of breaking it
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "tf32_matmul": False,
        "tf32_cudnn": False,
        # flash and memory-efficient (their deterministic backward), math; no cuDNN attention
        "sdp": (True, True, False, True),
    }
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC == ":4096:8"
    assert got.describe() == (
        "deterministic on on cuda, TF32 off, attention flash or memory-efficient (deterministic "
        "backward), cuDNN off, CUBLAS_WORKSPACE_CONFIG=:4096:8"
    )


def test_math_attention_alone_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """attention="math" (or $DDPKIT_DETERMINISTIC_ATTENTION=math): the math backend alone, as
    before the fast kernels' deterministic backward was used; a bad value is one line."""
    got = set_determinism("cuda", True, attention="math")
    assert switches()["sdp"] == (False, False, False, True)
    assert "attention math only" in got.describe()
    set_determinism("cuda", True)
    monkeypatch.setenv("DDPKIT_DETERMINISTIC_ATTENTION", "math")
    assert set_determinism("cuda", True).attention == "math only"
    assert switches()["sdp"] == (False, False, False, True)
    assert set_determinism("cuda").attention == "any"  # off: every kernel
    assert switches()["sdp"] == (True, True, True, True)
    monkeypatch.setenv("DDPKIT_DETERMINISTIC_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DDPKIT_DETERMINISTIC_ATTENTION='flash': pick one of"):
        set_determinism("cuda", True)


def test_warn_only_says_that_fast_attention_is_not_deterministic_then() -> None:
    """torch runs flash / memory-efficient backward deterministically only when deterministic
    algorithms are on without warn_only: the line says so."""
    got = set_determinism("cuda", True, warn_only=True)
    assert "attention flash or memory-efficient (backward NOT deterministic)" in got.describe()


def test_the_attention_check_runs_backward_twice_and_compares_the_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """None where two backward passes agree bitwise (CPU); else why not: the kernel's own
    refusal, or the difference (a kernel whose sums come out in another order each time)."""
    q = torch.empty(1, 4, 64, 16)
    assert attention_nondeterminism(q) is None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = [0]

    def wobbly(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return sdpa(*args, **kwargs) * (1 + calls[0] * 1e-3)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", wobbly)
    assert attention_nondeterminism(q) == "two backward passes of the same inputs differed"

    def refusing(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("flash_bwd does not have a deterministic implementation\ndetails")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refusing)
    assert attention_nondeterminism(q) == "flash_bwd does not have a deterministic implementation"


def test_attention_kernel_names_what_torch_runs() -> None:
    """torch's own choice for these inputs (on CPU, its flash kernel for these shapes)."""
    assert attention_kernel(torch.empty(1, 4, 32, 16)) == "flash (cpu)"


def test_cuda_default_is_off_with_tf32_and_fast_attention() -> None:
    set_determinism("cuda", True)
    got = set_determinism("cuda")
    s = switches()
    assert not s["algorithms"] and not s["cudnn_deterministic"]
    assert s["tf32_matmul"] and s["tf32_cudnn"]
    assert s["sdp"] == (True, True, True, True)
    assert got.describe() == "deterministic off on cuda, TF32 on, attention any"


def test_cublas_setting_kept_when_deterministic_replaced_when_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert set_determinism("cuda", True).cublas_workspace_config == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    got = set_determinism("cuda", True, warn_only=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert got.warn_only and torch.is_deterministic_algorithms_warn_only_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG=':4096:2' replaced (not deterministic)" in got.describe()


CHILD = """
import sys, time
import torch
from ddpkit import set_determinism
t = time.perf_counter()
set_determinism("cpu")
took = time.perf_counter() - t
assert torch.are_deterministic_algorithms_enabled(), "not on"
assert torch.is_deterministic_algorithms_warn_only_enabled(), "not warn only"
assert "torch._inductor" not in sys.modules, "inductor imported"
import torch._inductor.config as inductor
assert inductor.deterministic is True, "a later compile would not be deterministic"
set_determinism("cpu", False)
assert inductor.deterministic is False and not torch.are_deterministic_algorithms_enabled()
set_determinism("cpu", True)
assert inductor.deterministic is True and torch.are_deterministic_algorithms_enabled()
print(f"ok {took:.3f}")
"""


def test_turning_it_on_does_not_import_inductor_and_a_later_compile_still_sees_it() -> None:
    """torch.use_deterministic_algorithms imports torch._inductor (dynamo, sympy: seconds of
    every allocation's start-up); set_determinism must not, and inductor, once imported for a
    torch.compile, must still be deterministic."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_DETERMINISTIC"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok "), out.stdout

"""Throughput arithmetic: the peak FLOP/s of a GPU and the MFU of one. (The learning-rate
schedule is in ``lr_schedule.py``, the save schedule in ``save_schedule.py``.)"""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16/fp16 tensor-core peaks, TFLOP/s per GPU, from the vendors' datasheets.
# Matched by substring of torch.cuda.get_device_name(), most specific first.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("H200", 989.4),
    ("GH200", 989.4),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM
    ("H800", 989.4),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("V100", 125.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Per-GPU peak FLOP/s, or None on CPU / an unknown GPU (then no MFU is reported)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of ONE GPU: its own tokens/s times FLOPs per token over its peak.

    (The original PyRecover divided the global tokens/s by one GPU's peak, which overstates MFU
    by the number of GPUs.)
    """
    if peak is None or peak <= 0:
        return None
    return tokens_per_s_per_gpu * flops_per_token / peak

"""Throughput and model-FLOPs utilisation of a training step.

Training FLOPs of a step = ``6 * N * tokens + 12 * layers * hidden * sum(seqlen^2)`` (forward + backward of
the dense weights, plus attention scores and values over each packed sequence's own length). MFU divides the
achieved FLOP/s by the peak dense bf16 FLOP/s of all devices: ``trainer.peak_tflops`` when set, else a table
of known GPUs; on a CPU or an unknown GPU no MFU is reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "B200": 2250.0,
    "GB200": 2500.0,
}
"""Dense bf16 TFLOP/s per device by name fragment (vendor datasheets)."""


def step_flops(num_params: int, num_layers: int, hidden: int, seqlens: Sequence[int]) -> float:
    """Training FLOPs of the sequences ``seqlens`` (one forward and backward)."""
    tokens = sum(seqlens)
    return 6.0 * num_params * tokens + 12.0 * num_layers * hidden * sum(s * s for s in seqlens)


def peak_flops_per_device(configured_tflops: float | None) -> float | None:
    """Peak FLOP/s of one device, or None when unknown."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None

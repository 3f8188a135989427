"""``engine.full_determinism``: deterministic kernels and seeded RNGs for the whole process.

:func:`enable_full_determinism` sets what PyTorch, cuBLAS, cuDNN and Transformer Engine need to give the same
bits on every run of the same step on the same hardware and layout: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
(cuBLAS reads it when it creates a handle, so engines call this before their first matmul),
``torch.use_deterministic_algorithms(True)`` (an op with no deterministic implementation then raises instead
of running nondeterministically), cuDNN's deterministic mode without autotuning,
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` for Transformer Engine, and the Python, NumPy and torch (all devices)
seeds. It is process-wide and stays on. :func:`enable_deterministic_kernels` is the same without the seeds
(what a rollout built with ``deterministic=True`` turns on: it samples from its own seeded generator). The
vLLM rollout adds vLLM's batch-invariant mode on a GPU
(:func:`posttrain.rollout_vllm.engines.enable_batch_invariance`).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def enable_deterministic_kernels() -> None:
    """Deterministic algorithms everywhere in this process (cuBLAS, cuDNN, Transformer Engine, torch)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def enable_full_determinism(seed: int) -> None:
    """Deterministic algorithms everywhere in this process, and every RNG seeded with ``seed``."""
    enable_deterministic_kernels()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator too

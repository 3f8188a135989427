"""Fixtures for the megatron engine tests: the CPU / no-Transformer-Engine environment and a tiny model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def megatron_env():
    """Redirect Megatron-Core's CUDA calls, register the TE stand-in, and start a one-rank process group."""
    from megatron_cpu import init_single_process, prepare_environment

    prepare_environment()
    init_single_process()
    yield
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from megatron_cpu import make_tiny_qwen2

    return make_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture
def packed_batch():
    from megatron_cpu import sample_batch

    return sample_batch()

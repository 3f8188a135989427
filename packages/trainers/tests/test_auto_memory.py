"""Activation recomputation chosen before the engines are built when something else holds the trained role's
GPU through its update: a vLLM rollout's share (the README's 0.5B GRPO work in one_step_off on an 80 GB card ran
out of memory with recomputation chosen off from the whole free memory) or, under PPO, the other role's state;
against the cases the engine decides alone."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from posttrain.core.memory_policy import ModelShape, choose_gradient_checkpointing
from posttrain.core.testing import QWEN25_05B
from posttrain.trainers.config import load_config
from posttrain.trainers.rl.auto_memory import checkpointing_choices

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
    choice = checkpointing_choices(cfg, 1, CUDA0, H100_FREE)["model"]
    assert choice.value is True
    # vLLM took 48.1 GiB beside the trainer on that run (the estimate: 45.6 GiB, its graphs left to the
    # headroom), the bf16 reference 0.9 GiB
    assert "less 46.5 GiB held beside the update" in choice.reason, choice.reason
    named = readme_config(
        tmp_path,
        "trainer.mode=one_step_off",
        "trainer.rollout_placement=process",
        "trainer.rollout_devices=[cuda:0]",
    )
    assert checkpointing_choices(named, 1, CUDA0, H100_FREE)["model"].value is True


def test_a_small_rollout_budget_leaves_the_actor_room(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=async", rollout=VLLMMemory(gpu_memory_gib=16))
    choice = checkpointing_choices(cfg, 1, CUDA0, H100_FREE)["model"]
    assert choice.value is False and "less 16.9 GiB held beside" in choice.reason, choice.reason


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.mode=sync"],  # vLLM sleeps through the update: the engine chooses from the free memory
        ["trainer.mode=one_step_off", "trainer.rollout_devices=[cuda:1]"],  # the rollout on another GPU
        ["trainer.mode=one_step_off", "actor.engine.use_dynamic_bsz=false"],  # no token budget to estimate
        ["trainer.mode=one_step_off", "model.enable_gradient_checkpointing=false"],  # the user's own value
    ],
)
def test_the_engine_chooses_alone_otherwise(tmp_path, overrides) -> None:
    assert checkpointing_choices(readme_config(tmp_path, *overrides), 1, CUDA0, H100_FREE) == {}


def test_a_rollout_without_a_memory_share_leaves_it_to_the_engine(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=one_step_off", "rollout.name=hf", rollout=None)
    assert checkpointing_choices(cfg, 1, CUDA0, H100_FREE) == {}


def test_ppo_counts_the_other_roles_state(tmp_path) -> None:
    """With a critic, each trained role's recomputation counts the other's training state and the reference,
    which the engine alone would not see (the actor is built first; Adam's state comes at the first step)."""
    cfg = readme_config(
        tmp_path,
        "algorithm.adv_estimator=gae",
        "critic.model.enable_gradient_checkpointing=null",
        "critic.engine.max_token_len_per_gpu=16384",
    )
    shape = ModelShape.from_hf_config(QWEN25_05B)
    free = 52 * GiB
    alone = choose_gradient_checkpointing(shape, 16384, free)
    got = checkpointing_choices(cfg, 1, CUDA0, free, critic=True)
    assert alone.value is False and got["model"].value is True, (alone.reason, got["model"].reason)
    held = shape.train_state_bytes(1) + 2 * shape.params  # the critic's state, the bf16 reference
    assert f"less {held / GiB:.1f} GiB held beside the update" in got["model"].reason
    # the value head writes one number per token, not a row of the vocabulary: the critic fits without
    assert got["critic.model"].value is False, got["critic.model"].reason
    assert checkpointing_choices(cfg, 1, CUDA0, free, critic=False) == {}  # GRPO in sync: the engine's
    lora = readme_config(
        tmp_path,
        "algorithm.adv_estimator=gae",
        "critic.model.enable_gradient_checkpointing=null",
        "critic.engine.max_token_len_per_gpu=16384",
        "model.lora_rank=8",
    )
    # LoRA's reference is the actor with its adapter off: no bf16 copy held beside the update
    without_ref = checkpointing_choices(lora, 1, CUDA0, free, critic=True)["model"].reason
    assert f"less {shape.train_state_bytes(1) / GiB:.1f} GiB held beside" in without_ref, without_ref

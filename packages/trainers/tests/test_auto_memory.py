"""The trained roles' micro-batch token budgets and activation recomputation, chosen before the engines are built
from the free memory less what else holds the device through the update: a vLLM rollout's share (the README's
0.5B GRPO work in one_step_off on an 80 GB card ran out of memory with recomputation chosen off from the whole
free memory), the reference, under PPO the other role's state. Sizes are the real models' (their config.json
fields), free bytes what the runs logged."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from posttrain.core.memory_policy import ModelShape, choose_gradient_checkpointing
from posttrain.core.testing import QWEN25_05B, QWEN25_15B
from posttrain.trainers.config import load_config
from posttrain.trainers.rl.auto_memory import training_choices

GiB = 2**30
H100_FREE = int(78.7 * GiB)  # what the runs logged free on the H100 before their engines were built
CUDA0 = torch.device("cuda", 0)
BUDGET, CKPT = "actor.engine.max_token_len_per_gpu", "model.enable_gradient_checkpointing"


@dataclass(frozen=True)
class VLLMMemory:
    """The vLLM rollout config's keys that the choices read, at the ``grpo_gsm8k`` + ``vllm_gpu`` presets' values
    (this venv has no posttrain-rollout-vllm: it pulls vLLM in, so its config class is not registered here)."""

    gpu_memory_utilization: float = 0.6
    gpu_memory_gib: float = 0.0
    prompt_length: int = 512
    response_length: int = 1024


def readme_config(tmp_path, *overrides: str, rollout=VLLMMemory(), shape=QWEN25_05B):
    """The README's GRPO config (``grpo_gsm8k``) on the ``shape`` model with ``rollout`` as its rollout config."""
    (tmp_path / "config.json").write_text(json.dumps(shape))
    cfg = load_config(
        [f"model.path={tmp_path}", "ref.engine.param_offload=false", *overrides], ["grpo_gsm8k"]
    )
    if rollout is not None:
        cfg.rollout = rollout
    return cfg


def test_one_step_off_on_the_trainers_h100_halves_the_budget(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=one_step_off", "trainer.rollout_placement=process")
    got = training_choices(cfg, 1, CUDA0, H100_FREE)
    # vLLM took 48.1 GiB beside the trainer on that run (the estimate: 45.6 GiB, its graphs left to the
    # headroom), the bf16 reference 0.9 GiB: 16,384 tokens need recomputation (the run chose it on), 8,192 not
    assert got[BUDGET].value == 8192 and got[CKPT].value is False, (got[BUDGET].reason, got[CKPT].reason)
    assert "less 46.5 GiB held beside the update" in got[CKPT].reason, got[CKPT].reason
    assert got["actor.engine.infer_max_token_len_per_gpu"].value == 16384  # forward-only keeps the default
    named = readme_config(
        tmp_path,
        "trainer.mode=one_step_off",
        "trainer.rollout_placement=process",
        "trainer.rollout_devices=[cuda:0]",
        f"{BUDGET}=16384",
    )
    assert training_choices(named, 1, CUDA0, H100_FREE)[CKPT].value is True  # the user's budget is kept


def test_sync_at_15b_on_an_h100_halves_the_budget(tmp_path) -> None:
    """The README's command chose recomputation on for the 1.5B shape on an H100 (76.0 GiB over 62.9)."""
    got = training_choices(readme_config(tmp_path, shape=QWEN25_15B), 1, CUDA0, H100_FREE)
    assert got[BUDGET].value == 8192 and got[CKPT].value is False, got[BUDGET].reason
    on_h200 = training_choices(readme_config(tmp_path, shape=QWEN25_15B), 1, CUDA0, 139 * GiB)
    assert on_h200[BUDGET].value == 16384 and on_h200[CKPT].value is False
    assert "actor.engine.infer_max_token_len_per_gpu" not in on_h200


def test_a_small_rollout_budget_leaves_the_actor_room(tmp_path) -> None:
    cfg = readme_config(tmp_path, "trainer.mode=async", rollout=VLLMMemory(gpu_memory_gib=16))
    got = training_choices(cfg, 1, CUDA0, H100_FREE)
    assert got[BUDGET].value == 16384 and got[CKPT].value is False
    assert "less 16.9 GiB held beside" in got[CKPT].reason, got[CKPT].reason


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.mode=sync"],  # vLLM sleeps through the update: only the reference is held beside
        ["trainer.mode=one_step_off", "trainer.rollout_devices=[cuda:1]"],  # the rollout on another GPU
    ],
)
def test_a_rollout_asleep_or_elsewhere_holds_nothing_beside(tmp_path, overrides) -> None:
    got = training_choices(readme_config(tmp_path, *overrides), 1, CUDA0, H100_FREE)
    assert got[BUDGET].value == 16384 and got[CKPT].value is False
    assert "less 0.9 GiB held beside" in got[CKPT].reason, got[CKPT].reason


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.engine.use_dynamic_bsz=false"],  # no token budget to estimate from: the engine recomputes
        [f"{CKPT}=false"],  # the user's own value
    ],
)
def test_nothing_is_chosen_without_a_budget_or_against_the_user(tmp_path, overrides) -> None:
    assert training_choices(readme_config(tmp_path, *overrides), 1, CUDA0, H100_FREE) == {}


def test_ppo_counts_the_other_roles_state(tmp_path) -> None:
    """With a critic, each trained role's choice counts the other's training state and the reference, which the
    engine alone would not see (the actor is built first; Adam's state comes at the first step)."""
    cfg = readme_config(
        tmp_path,
        "algorithm.adv_estimator=gae",
        f"{BUDGET}=16384",
        "critic.model.enable_gradient_checkpointing=null",
        "critic.engine.max_token_len_per_gpu=16384",
    )
    shape = ModelShape.from_hf_config(QWEN25_05B)
    free = 52 * GiB
    alone = choose_gradient_checkpointing(shape, 16384, free)
    got = training_choices(cfg, 1, CUDA0, free, critic=True)
    assert alone.value is False and got[CKPT].value is True, (alone.reason, got[CKPT].reason)
    held = shape.train_state_bytes(1) + 2 * shape.params  # the critic's state, the bf16 reference
    assert f"less {held / GiB:.1f} GiB held beside the update" in got[CKPT].reason
    # the value head writes one number per token, not a row of the vocabulary: the critic fits without
    critic = got["critic.model.enable_gradient_checkpointing"]
    assert critic.value is False, critic.reason
    lora = readme_config(
        tmp_path,
        "algorithm.adv_estimator=gae",
        f"{BUDGET}=16384",
        "critic.model.enable_gradient_checkpointing=null",
        "critic.engine.max_token_len_per_gpu=16384",
        "model.lora_rank=8",
    )
    # LoRA's reference is the actor with its adapter off: no bf16 copy held beside the update
    without_ref = training_choices(lora, 1, CUDA0, free, critic=True)[CKPT].reason
    assert f"less {shape.train_state_bytes(1) / GiB:.1f} GiB held beside" in without_ref, without_ref

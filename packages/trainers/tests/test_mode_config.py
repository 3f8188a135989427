"""trainer.stale_policy: unset means the mode's own policy (async waits, stream drops); a value the mode does
not do is refused with the fix; async still builds the lookahead it built before the field could be unset.
trainer.rollout_placement: unset is chosen from the mode, the trainer's device and trainer.rollout_devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.core.config.loader import ConfigError
from posttrain.trainers.config import load_config
from posttrain.trainers.rl.mode_config import STREAM_AHEAD, RolloutModeConfig


@pytest.mark.parametrize(
    ("mode", "policy", "match"),
    [
        ("sync", "wait", r"stale_policy=wait with trainer.mode=sync.*leave trainer.stale_policy unset"),
        ("sync", "drop", r"stale_policy=drop with trainer.mode=sync.*trainer.mode=async trainer.stale_pol"),
        (
            "one_step_off",
            "drop",
            r"one_step_off always waits.*trainer.mode=async trainer.max_staleness=1 "
            r"trainer.stale_policy=drop",
        ),
        ("stream", "wait", r"stream always drops.*trainer.mode=async trainer.stale_policy=wait"),
        ("async", "skip", r"trainer.stale_policy='skip': choose one of wait, drop"),
    ],
)
def test_a_policy_the_mode_does_not_do_is_refused(mode, policy, match):
    with pytest.raises(ValueError, match=match):
        RolloutModeConfig(mode=mode, stale_policy=policy).check_mode()
    with pytest.raises(ConfigError, match=match):
        load_config([f"trainer.mode={mode}", f"trainer.stale_policy={policy}"], ["grpo_tiny"])


@pytest.mark.parametrize(("mode", "policy"), [("one_step_off", "wait"), ("stream", "drop")])
def test_the_modes_own_policy_may_be_named(mode, policy):
    RolloutModeConfig(mode=mode, stale_policy=policy).check_mode()


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_async_lookahead_is_unchanged_and_unset_waits(staleness):
    def lookahead(policy):
        cfg = RolloutModeConfig(mode="async", max_staleness=staleness, stale_policy=policy)
        cfg.check_mode()
        return cfg.lookahead

    assert lookahead("wait") == lookahead(None) == staleness
    assert lookahead("drop") == staleness + 1


def test_the_other_modes_lookahead_ignores_an_unset_policy():
    lookaheads = [RolloutModeConfig(mode=m).lookahead for m in ("sync", "one_step_off", "stream")]
    assert lookaheads == [0, 1, STREAM_AHEAD]


def test_unset_is_the_default_and_loads_as_null():
    assert load_config([], ["grpo_tiny"]).trainer.stale_policy is None
    cfg = load_config(["trainer.mode=async", "trainer.stale_policy=null"], ["grpo_tiny"])
    assert cfg.trainer.stale_policy is None and cfg.trainer.lookahead == cfg.trainer.max_staleness


@pytest.mark.parametrize(
    ("mode", "devices", "device", "chosen"),
    [
        ("sync", [], "cuda:0", "colocated"),
        ("sync", [], "cpu", "colocated"),
        ("one_step_off", [], "cuda:0", "process"),
        ("async", [], "cuda:1", "process"),
        ("stream", [], "cuda:0", "process"),
        ("one_step_off", [], "cpu", "colocated"),
        ("stream", [], "cpu", "colocated"),
        ("one_step_off", ["cuda:1"], "cuda:0", "process"),
        ("stream", ["cpu"], "cpu", "process"),
    ],
)
def test_an_unset_placement_is_chosen_from_the_mode_and_the_trainers_device(mode, devices, device, chosen):
    cfg = RolloutModeConfig(mode=mode, rollout_devices=devices)
    cfg.check_mode()
    choice = cfg.choose_placement(device)
    assert cfg.rollout_placement == choice.value == chosen
    assert choice.line("trainer.rollout_placement").startswith(
        f"trainer.rollout_placement={chosen} (chosen: "
    )
    assert cfg.choose_placement("cpu") is None  # now set: kept


@pytest.mark.parametrize(
    "rollout",
    [
        SimpleNamespace(tensor_model_parallel_size=2, executor="auto"),
        SimpleNamespace(tensor_model_parallel_size=1, executor="external_launcher"),
    ],
)
def test_a_rollout_over_the_trainers_gpus_stays_colocated(rollout):
    """vLLM's fields (rollout-vllm is not installed in this package's tests): a rollout process holds one GPU
    and is not a member of the trainer's world."""
    choice = RolloutModeConfig(mode="one_step_off").choose_placement("cuda:0", rollout)
    assert choice.value == "colocated" and "spans the trainer's GPUs" in choice.reason
    one_gpu = SimpleNamespace(tensor_model_parallel_size=1, executor="auto")
    assert RolloutModeConfig(mode="one_step_off").choose_placement("cuda:0", one_gpu).value == "process"


@pytest.mark.parametrize("placement", ["colocated", "process"])
def test_a_set_placement_is_kept_on_any_device(placement):
    assert load_config(["trainer.mode=one_step_off"], ["grpo_tiny"]).trainer.rollout_placement is None
    cfg = load_config(["trainer.mode=one_step_off", f"trainer.rollout_placement={placement}"], ["grpo_tiny"])
    assert cfg.trainer.choose_placement("cuda:0") is None and cfg.trainer.rollout_placement == placement

"""Keys a user wrote elsewhere (verl, Hydra, last week's posttrain) exit 2 naming the posttrain key to write,
or saying there is none, and pointing at docs/migrating-from-verl.md."""

from __future__ import annotations

import re

import pytest

from posttrain.trainers import cli

DOC = "docs/migrating-from-verl.md"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["actor_rollout_ref.actor.optim.lr=1e-6"], "posttrain's is actor.optim.lr"),
        (
            ["actor_rollout_ref.actor.fsdp_config.param_offload=true"],
            "posttrain's is actor.engine.param_offload",
        ),
        (["data.max_response_length=512"], "posttrain's is rollout.response_length"),
        (["custom_reward_function.path=r.py"], "reward.custom_reward_function=path/to/file.py:name"),
        (["+trainer.foo=1"], r"Hydra's \+key syntax"),
        (["actor.engine.qat.enable=true"], r"no quantisation-aware training.*there is no posttrain key"),
        (["actor.engine.use_fused_kernels=false"], "entropy_from_logits_chunk_size"),
        (["ref.engine.router_replay.record_file=r.pt"], "there is no posttrain key"),
        (["critic.engine.ulysses_sequence_parallel_size=2"], "context_parallel_size"),
        (["rollout.mode=async"], "rollout.executor"),
        (
            ["checkpoint.portable=true"],
            r"actor\.engine\.portable_checkpoint.*critic\.engine\.portable_checkpoint",
        ),
        (["checkpoint.mbridge_config={}"], r"actor\.engine\.hf_save_kwargs"),
        (["checkpoint.mbridge_config.distributed_save=false"], r"actor\.engine\.hf_save_kwargs"),
        (
            ["actor_rollout_ref.actor.checkpoint.mbridge_config.x=1"],
            r"posttrain's is actor\.engine\.hf_save_kwargs",
        ),
    ],
)
def test_old_keys_exit_2_naming_the_new_form(argv, says, capsys):
    assert cli.main(["config", "show", *argv]) == 2
    err = capsys.readouterr().err
    assert DOC in err and "unknown config key" not in err
    assert re.search(says, err), err


def test_a_preset_with_a_verl_key_is_refused_too(tmp_path, capsys):
    preset = tmp_path / "old.yaml"
    preset.write_text("actor_rollout_ref:\n  rollout:\n    n: 4\n")
    assert cli.main(["config", "show", "--config", str(preset)]) == 2
    assert "posttrain's is rollout.n" in capsys.readouterr().err


def test_hydra_config_name_flag_names_the_posttrain_flag(capsys):
    assert cli.main(["grpo", "--config-name", "ppo_trainer"]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and DOC in err

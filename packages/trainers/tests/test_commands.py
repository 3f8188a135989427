"""What the commands promise about their own defaults and help: ``posttrain grpo`` starts from a layer under
your presets, ``posttrain demo --help`` lists every knob, and a bad config exits 2 with one line."""

from __future__ import annotations

import dataclasses

from posttrain.trainers import cli
from posttrain.trainers.demo import DemoConfig
from posttrain.trainers.main_ppo import resolve


def test_grpo_defaults_sit_under_the_presets(tmp_path):
    gae = tmp_path / "gae.yaml"
    gae.write_text("algorithm:\n  adv_estimator: gae\n")
    assert resolve([], "grpo").algorithm.adv_estimator == "grpo"
    assert resolve([], "ppo").algorithm.adv_estimator == "gae"
    assert resolve(["--config", str(gae)], "grpo").algorithm.adv_estimator == "gae"  # the preset wins
    override = ["--config", str(gae), "algorithm.adv_estimator=grpo"]
    assert resolve(override, "grpo").algorithm.adv_estimator == "grpo"  # the override wins over the preset
    assert resolve(["--config", "grpo"], "ppo") == resolve([], "grpo")


def test_demo_help_lists_every_knob_with_its_default_and_docstring(capsys):
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(DemoConfig):
        assert f"  {f.name}={f.default}\n" in out, f.name
    assert "Seed of the model init and the data." in out and "GRPO learning rate; None: the task's" in out


def test_bad_keys_exit_2_with_one_line(capsys):
    assert cli.main(["demo", "grpo_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain demo: unknown config key 'grpo_stepz'") and err.count("\n") == 1
    assert cli.main(["grpo", "--config", "grpo_tiny", "rollout.m=2"]) == 2
    assert capsys.readouterr().err.startswith("posttrain grpo: unknown config key 'rollout.m'")


def test_config_show_prints_the_tree_each_command_trains_with(capsys):
    """``config show grpo`` carries grpo's preset layer (adv_estimator grpo), as ``posttrain grpo`` does;
    ``ppo`` not."""
    for word, want in (("grpo", "grpo"), ("ppo", "gae")):
        assert cli.main(["config", "show", word]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("adv_estimator:"))
        assert line.split("#")[0].split(":")[1].strip() == want == resolve([], word).algorithm.adv_estimator

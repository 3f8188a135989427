"""The ``posttrain`` command: ``--help`` imports no torch, ``--timing`` reports the start-up time."""

from __future__ import annotations

import subprocess
import sys


def test_help_imports_no_torch():
    code = (
        "import sys\n"
        "from posttrain.trainers.cli import main\n"
        "assert main(['--help']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: posttrain [--timing] <command>" in out and out.strip().endswith("False"), out


def test_timing_reports_imports_and_run(capsys):
    from posttrain.trainers.cli import main

    assert main(["--timing", "config", "show", "model_engine=fsdp2"]) == 0
    captured = capsys.readouterr()
    assert "strategy: fsdp2" in captured.out
    assert "[posttrain] config: imports " in captured.err and " s, run " in captured.err


def test_config_show_prints_the_tree_of_the_command_with_owners(capsys, tmp_path):
    from posttrain.trainers.cli import main

    assert main(["config", "show", "sft", "model_engine=fsdp"]) == 0
    sft = capsys.readouterr().out
    top = {ln.split(":")[0] for ln in sft.splitlines() if ln[:1].isalpha()}
    assert "(SFTConfig)" in sft and top == {"model_engine", "model", "data", "actor", "trainer", "checkpoint"}
    assert "\n  mode:" not in sft and "ppo_mini_batch_size" not in sft
    assert "  engine:  # FSDP1EngineConfig (posttrain-engine-fsdp)" in sft
    assert (
        "    fsdp_size: -1  # posttrain-engine-fsdp" in sft and "    seed: 42  # posttrain-engine-core" in sft
    )
    leaves = [ln for ln in sft.splitlines()[1:] if not ln.rstrip().endswith(")")]
    assert all(" # posttrain-" in ln for ln in leaves), [ln for ln in leaves if " # posttrain-" not in ln]
    assert main(["config", "show"]) == 0  # the RL tree by default
    rl = capsys.readouterr().out
    assert "(PostTrainConfig)" in rl and "rollout:  # HFRolloutConfig (posttrain-rollout-hf)" in rl
    assert "  mode: sync  # posttrain-trainers" in rl
    saved = tmp_path / "rl.yaml"
    saved.write_text(rl)
    assert main(["config", "show", "--config", str(saved)]) == 0  # the output loads back as a preset
    assert capsys.readouterr().out == rl

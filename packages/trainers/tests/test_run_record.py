"""Every run writes the resolved config it trained with, with the installed versions, to
``<trainer.default_local_dir>/config.yaml``, and ``--config`` of that file reruns it with the same tree."""

from __future__ import annotations

import pytest
import yaml
from sft_fixtures import make_arithmetic, make_tiny_model

from posttrain.trainers import cli
from posttrain.trainers.logging import read_metrics


def _tree(path):
    tree = yaml.safe_load(path.read_text())
    tree["trainer"].pop("default_local_dir")
    return tree


@pytest.mark.slow
def test_sft_writes_its_config_and_reruns_from_it(tmp_path):
    model = make_tiny_model(tmp_path)
    train, _ = make_arithmetic(tmp_path, num_train=16, num_test=4)
    first, second = tmp_path / "first", tmp_path / "second"
    args = ["--config", "sft_tiny", f"model.path={model}", f"data.train_files=[{train}]"]
    args += ["trainer.logger=[file]", "trainer.total_training_steps=1", "data.train_batch_size=4"]
    assert cli.main(["sft", *args, f"trainer.default_local_dir={first}", "actor.optim.lr=3e-4"]) == 0
    written = first / "config.yaml"
    header = [line for line in written.read_text().splitlines() if line.startswith("#")]
    for name in ("python", "torch", "transformers", "posttrain-trainers", "posttrain-engine-fsdp"):
        assert any(line.startswith(f"#   {name}: ") for line in header), (name, header)
    assert f"# Rerun: posttrain sft --config {written}" in header
    tree = _tree(written)
    assert tree["actor"]["optim"]["lr"] == 3e-4 and tree["model"]["path"] == str(model)

    assert cli.main(["sft", "--config", str(written), f"trainer.default_local_dir={second}"]) == 0
    assert _tree(second / "config.yaml") == tree
    loss = [read_metrics(d / "metrics.jsonl")[0]["train/loss"] for d in (first, second)]
    assert loss[0] == loss[1]

"""Checks before the first step: each mistake exits 2 naming the key and the fix, before any engine is built;
a plain string file list is a one-element list; the console shows what a run is judged by; thread choice."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sft_fixtures import make_arithmetic, make_tiny_model

from posttrain.trainers import cli, preflight
from posttrain.trainers.config import load_config
from posttrain.trainers.logging.progress import ConsoleLogger
from posttrain.trainers.threads import cpu_threads


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    train, test = make_arithmetic(root, num_train=16, num_test=4)
    return {"root": root, "model": make_tiny_model(root), "train": train, "test": test}


def rl_args(assets, run_dir: Path, *extra: str) -> list[str]:
    return [
        "grpo",
        "--config",
        "grpo_tiny",
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console]",
        *extra,
    ]


def _exit_2(capsys, argv: list[str], *needles: str) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_unwritable_output_folder_exits_2_before_training(assets, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    out = blocker / "run"
    _exit_2(
        capsys,
        rl_args(assets, out),
        "trainer.default_local_dir=",
        "cannot be written",
        "a folder you can write",
    )
    sft = [
        "sft",
        "--config",
        "sft_tiny",
        f"model.path={assets['model']}",
        f"data.train_files=[{assets['train']}]",
    ]
    _exit_2(
        capsys, [*sft, f"trainer.default_local_dir={out}"], "trainer.default_local_dir=", "cannot be written"
    )


def test_output_folder_is_probed_without_a_trace(assets, tmp_path):
    cfg = load_config([f"model.path={assets['model']}", f"trainer.default_local_dir={tmp_path / 'a' / 'b'}"])
    preflight.check_output_dir(cfg, roles=1)
    assert not (tmp_path / "a").exists()


def test_checkpoint_estimate_counts_weights_and_adamw(assets):
    from posttrain.trainers.model_init import count_parameters

    params = count_parameters(assets["model"])
    cfg = load_config([f"model.path={assets['model']}"])
    assert preflight.checkpoint_bytes(cfg, roles=2) == params * 12 * 2
    cfg = load_config([f"model.path={assets['model']}", "checkpoint.save_contents=[model,hf_model]"])
    assert preflight.checkpoint_bytes(cfg, roles=1) == params * 6


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["rollout.response_length=4096"], "exceeds the model's max_position_embeddings=2048"),
        (["rollout.prompt_length=1024", "rollout.response_length=1100"], "2124 tokens exceeds the model's"),
        (["rollout.max_model_len=200", "rollout.response_length=300"], "raise rollout.max_model_len to"),
    ],
)
def test_lengths_beyond_the_model_exit_2(assets, tmp_path, capsys, extra, needle):
    _exit_2(capsys, rl_args(assets, tmp_path / "run", *extra), needle)
    assert not (tmp_path / "run").exists()


def test_data_source_without_scorer_exits_2(assets, tmp_path, capsys):
    rows = pq.read_table(assets["train"]).to_pylist()
    rows[3]["data_source"] = "my_puzzles"
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    args = rl_args(assets, tmp_path / "run", f"data.train_files=[{path}]")
    _exit_2(capsys, args, "no scorer for data_source 'my_puzzles'", "reward.custom_reward_function=")
    rewards = Path(__file__).parent / "rl_rewards.py"
    cfg = load_config([*args[3:], f"reward.custom_reward_function={rewards}:digit_share"], ["grpo_tiny"])
    preflight.check_rl(cfg, use_critic=False)  # a custom function scores every source


def test_missing_columns_exit_2_naming_the_key(assets, tmp_path, capsys):
    _exit_2(
        capsys,
        rl_args(assets, tmp_path / "run", "data.prompt_key=question"),
        "column 'question' is missing",
        "data.prompt_key",
    )
    _exit_2(
        capsys,
        rl_args(assets, tmp_path / "run", "data.reward_fn_key=src"),
        "set data.reward_fn_key to the column",
    )


def test_plain_string_file_list_is_one_element_list(assets):
    cfg = load_config([f"data.train_files={assets['train']}", f"data.val_files={assets['test']}"])
    assert cfg.data.train_files == [str(assets["train"])] and cfg.data.val_files == [str(assets["test"])]


def test_prompt_length_error_names_the_rollout_key(assets):
    from transformers import AutoTokenizer

    from posttrain.trainers.data.config import DataConfig
    from posttrain.trainers.rl.dataset import PromptDataset

    tok = AutoTokenizer.from_pretrained(assets["model"])
    with pytest.raises(ValueError, match=r"raise rollout\.prompt_length") as err:
        PromptDataset([str(assets["train"])], tok, DataConfig(max_prompt_length=2))
    assert "raise data.max_prompt_length" not in str(err.value)


def test_console_shows_reward_change_losses_and_last_validation():
    console = ConsoleLogger(total=3)
    step = {
        "reward/mean": 0.25,
        "actor/pg_loss": -0.01,
        "actor/kl_loss": 0.002,
        "actor/entropy": 1.5,
        "response_length/mean": 17.0,
        "actor/pg_clipfrac": 0.1,
        "perf/tokens_per_s": 900.0,
    }
    first = console.postfix({**step, "val/reward/mean": 0.5})
    assert first == {
        "reward": "0.25",
        "pg_loss": "-0.01",
        "kl": "0.002",
        "entropy": "1.5",
        "resp_len": "17",
        "clipfrac": "0.1",
        "tok/s": "900",
        "val": "0.5",
    }
    second = console.postfix({**step, "reward/mean": 0.375, "actor/skipped_step": 1.0})
    assert second["reward"] == "0.375(+0.125)" and second["val"] == "0.5" and second["skipped"] == "1"
    sft = ConsoleLogger(total=3).postfix({"train/loss": 2.0, "train/token_acc": 0.5, "val/loss": 1.5})
    assert sft["loss"] == "2" and sft["acc"] == "0.5" and sft["val"] == "1.5"
    console.close()


def test_thread_count_follows_free_cores():
    assert cpu_threads(2, 7.6) == 1 and cpu_threads(2, 0.1) == 2 and cpu_threads(16, 3.2) == 13
    assert cpu_threads(8, 0.0) == 8

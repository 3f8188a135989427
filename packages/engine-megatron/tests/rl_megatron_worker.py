"""torchrun worker: ``posttrain grpo`` with the Megatron engine on CPU (gloo), inside the test environment of
``megatron_cpu.py`` (CUDA calls redirected, Transformer Engine stand-in).

Usage: ``torchrun --standalone --nproc-per-node N rl_megatron_worker.py [--record DIR] [posttrain grpo args]
[--then [--record DIR] [args] ...]``: each ``--then`` starts another run in the same processes (one launch
pays Megatron's ~20 s import once per rank, not once per run).
The arguments extend :data:`CPU_DEFAULTS` (float32 megatron actor and reference, HF rollout, a two-step run
with small batches, :func:`digit_share` as the reward); ``algorithm.adv_estimator=gae`` makes it PPO with a
critic (``grpo`` only sets the estimator's default). With ``--record DIR`` each rank writes
``DIR/rank<r>.pt``: per step, the packed batch as the advantage phase gets it (input ids, scores, old and
reference log-probs, and with a critic its values) and the advantages and returns it computed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

CPU_DEFAULTS = [
    "model_engine=megatron",
    "model.enable_gradient_checkpointing=false",
    "data.max_prompt_length=64",
    "data.train_batch_size=4",
    "data.seed=1",
    "actor.engine.dtype=float32",
    "actor.engine.use_distributed_optimizer=false",
    "actor.engine.max_token_len_per_gpu=4096",
    "actor.optim.lr=1e-4",
    "actor.optim.weight_decay=0.0",
    "actor.optim.clip_grad=1.0",
    "actor.ppo_mini_batch_size=2",
    "actor.use_kl_loss=true",
    "actor.kl_loss_coef=0.001",
    "actor.kl_loss_type=low_var_kl",
    "ref.engine.dtype=float32",
    "ref.engine.max_token_len_per_gpu=4096",
    "rollout.name=hf",
    "rollout.dtype=float32",
    "rollout.n=4",
    "rollout.response_length=10",
    "rollout.prompt_length=64",
    f"reward.custom_reward_function={Path(__file__).resolve()}:digit_share",
    "trainer.logger=[file]",
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
]
"""A tiny GRPO run on CPU; layouts and paths come from the command line."""


def digit_share(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A dense reward a random model earns something from: the share of digits in the response."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)


@contextlib.contextmanager
def recording(store: list[dict[str, torch.Tensor]]) -> Iterator[None]:
    """Append a copy of each step's batch, as the advantage phase gets it (with a critic: its values), and
    the advantages and returns the phase computed, to ``store``."""
    from posttrain.trainers.rl import phases

    original = phases.compute_advantages

    def compute_advantages(batch, *args, **kwargs):
        record = {
            "input_ids": batch.input_ids.clone(),
            "score": batch.seq_fields["score"].clone(),
            "old_log_probs": batch.fields["old_log_probs"].clone(),
            "ref_log_probs": batch.fields["ref_log_probs"].clone(),
        }
        metrics = original(batch, *args, **kwargs)
        for key in ("values", "advantages", "returns"):  # values only with a critic (GAE)
            if key in batch.fields:
                record[key] = batch.fields[key].clone()
        store.append(record)
        return metrics

    phases.compute_advantages = compute_advantages
    try:
        yield
    finally:
        phases.compute_advantages = original


def main() -> None:
    from megatron_cpu import prepare_environment

    prepare_environment()
    from posttrain.trainers.main_ppo import run

    # The runs share this process group (as the one-process reference shares the test's), so the trainers do
    # not tear it down between runs and Megatron's model-parallel groups, made once, serve every run.
    torch.distributed.init_process_group("gloo")

    for args in split_runs(sys.argv[1:]):
        record = None
        if args[:1] == ["--record"]:
            record, args = Path(args[1]), args[2:]
        store: list[dict[str, torch.Tensor]] = []
        with recording(store):
            run([*CPU_DEFAULTS, *args], "grpo")
        if record is not None:
            torch.save(store, record / f"rank{os.environ.get('RANK', '0')}.pt")
    if (
        torch.distributed.is_initialized()
    ):  # vLLM's external_launcher executor tears it down itself at release
        torch.distributed.destroy_process_group()


def split_runs(argv: list[str]) -> list[list[str]]:
    """The runs of one launch: argument lists separated by ``--then``."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    main()

"""Supervised fine-tuning: next-token cross-entropy on the assistant tokens of chat data, SPMD under torchrun.

Every process builds the same trainer. The training set is read, checked and tokenised first (bad files fail
before the engine is built); the engine is built by its config (``actor.engine.build(...)``). Each step
takes the next global batch of ``data.train_batch_size`` conversations from a seeded, resumable sampler, gives
each data-parallel rank a contiguous share as one packed batch, and runs ``engine.train_batch`` with the loss
``sum(-log p * mask) / global_num_tokens * dp_size`` per micro-batch: after the engine averages gradients over
data-parallel ranks this is the mean over every assistant token of the global batch, whatever the layout, so
one process and N processes see the same loss and gradient. Token accuracy (``train/token_acc``,
``val/token_acc``) is the fraction of those tokens that are the argmax of the logits predicting them, computed
by the engine inside its forward (``batch.meta['calculate_accuracy']``); an engine that does not compute it is
named in a warning at start and the metric is absent. The learning rate follows ``actor.optim``'s schedule
over the run's total steps. Validation loss and token accuracy (over the whole validation set) run every
``trainer.test_freq`` steps and at the end; checkpoints (engine state under ``actor/``, the sampler position
in ``data.pt``) are committed every ``trainer.save_freq`` steps and at the end, and a resumed run continues
with the next unseen batch.

    posttrain sft --config sft_tiny model.path=/tmp/tiny data.train_files=[/tmp/data/train.parquet]
    torchrun --nproc_per_node 2 -m posttrain.trainers.sft --config sft_tiny trainer.n_gpus_per_node=2 ...
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from posttrain.ckpt import CheckpointManager, load_trainer_state
from posttrain.core import LossContext, PackedBatch

from . import distributed as pdist
from . import preflight, threads
from .command import exit_code
from .config import SFTConfig, load_config
from .data.sampler import StatefulSampler, rank_slice
from .data.sft_dataset import SFTDataset
from .loop import StepLoop
from .model_files import load_tokenizer, require_model_weights
from .perf import peak_flops_per_device, step_flops
from .resume import resume_point
from .roles import fill_token_budget

ROLE = "actor"


def sft_loss(model_output: dict[str, torch.Tensor], micro: PackedBatch, ctx: LossContext):
    """Token-mean negative log-likelihood over the global batch (see the module docstring)."""
    mask = micro.loss_mask.to(model_output["log_probs"].device)
    nll_sum = -(model_output["log_probs"] * mask).sum()
    loss = nll_sum / max(ctx.global_num_tokens, 1) * ctx.dp_size
    return loss, {}


class SFTTrainer(StepLoop):
    """The SFT loop over one engine (the ``actor`` role)."""

    command = "sft"

    def __init__(self, cfg: SFTConfig) -> None:
        self.cfg = cfg
        self.owns_group = pdist.init_distributed()
        pdist.check_world_size(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
        torch.manual_seed(cfg.trainer.seed)
        require_model_weights(cfg.model, cfg.actor.engine)
        fill_token_budget(cfg.actor.engine, cfg.data.max_length)
        tokenizer = load_tokenizer(cfg.model)
        self.train_set = SFTDataset(cfg.data.train_files, tokenizer, cfg.data, key="data.train_files")
        self.val_set = (
            SFTDataset(cfg.data.val_files, tokenizer, cfg.data, key="data.val_files")
            if cfg.data.val_files
            else None
        )
        self.sampler = StatefulSampler(
            len(self.train_set), cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        self.total_steps = (
            cfg.trainer.total_training_steps or self.sampler.steps_per_epoch * cfg.trainer.total_epochs
        )
        optim = cfg.actor.optim
        if optim.total_training_steps < 0:
            optim = dataclasses.replace(optim, total_training_steps=self.total_steps)
        self.optim = optim
        self.engine = cfg.actor.engine.build(model=cfg.model, optim=optim, ckpt=cfg.checkpoint)
        self.dp_size = self.engine.get_data_parallel_size()
        self.dp_rank = self.engine.get_data_parallel_rank()
        self.meta = {"calculate_entropy": False, "calculate_accuracy": self.engine.computes_token_accuracy}
        if not self.engine.computes_token_accuracy:
            warnings.warn(
                f"{type(self.engine).__name__} (actor.engine.strategy={cfg.actor.engine.strategy}) does not "
                "compute token accuracy: SFT logs loss and validation loss without train/token_acc and "
                "val/token_acc",
                UserWarning,
                stacklevel=2,
            )
        if cfg.data.train_batch_size % self.dp_size:
            raise ValueError(
                f"data.train_batch_size={cfg.data.train_batch_size} does not split over "
                f"{self.dp_size} data-parallel ranks: make it a multiple of {self.dp_size}"
            )
        self.ckpt = CheckpointManager(cfg.trainer.default_local_dir, cfg.checkpoint)
        self.global_step = self._resume()
        self.model_shape = _model_shape(cfg.model.path)
        self.peak_flops = peak_flops_per_device(cfg.trainer.peak_tflops)
        self.tracker = self.make_tracker()

    # ------------------------------------------------------------------ checkpoints
    def _resume(self) -> int:
        point = resume_point(self.cfg.trainer)
        if point is None:
            return 0
        step, path = point
        self.engine.load_checkpoint(str(path / ROLE))
        state = load_trainer_state(path)
        self.sampler.load_state_dict(state["sampler"])
        threads.keep(state.get("torch_threads"))
        if pdist.rank() == 0:
            print(f"resumed from {path} (step {step}, epoch {self.sampler.epoch})", file=sys.stderr)
        return step

    def prepare_checkpoints(self) -> None:
        self.engine.prepare_checkpoint(ROLE, self.ckpt.writer)

    def save_checkpoint(self, step: int) -> None:
        staging = self.ckpt.stage(step)
        kwargs = {"writer": self.ckpt.writer} if self.ckpt.writer is not None else {}
        self.engine.save_checkpoint(str(staging / ROLE), global_step=step, **kwargs)
        state = {
            "global_step": step,
            "sampler": self.sampler.state_dict(),
            "torch_threads": torch.get_num_threads(),
        }
        self.ckpt.save_trainer_state(step, state)
        self.ckpt.commit(step)

    # ------------------------------------------------------------------ steps
    def train_step(self) -> dict[str, float]:
        epoch, indices = self.sampler.next_batch()
        local = rank_slice(indices, self.dp_rank, self.dp_size)
        batch = self.train_set.batch(local, meta=dict(self.meta))
        lr = self.optim.lr * self.optim.lr_multiplier(self.global_step, self.optim.total_training_steps)
        start = time.perf_counter()
        with self.engine.train_mode():
            out = self.engine.train_batch(batch, sft_loss)
        self.engine.lr_scheduler_step()
        step_s = time.perf_counter() - start
        src = self.engine.is_mp_src_rank_with_outputs()
        loss_part = sum(float(x) for x in out.get("loss", [])) if src else 0.0
        grad_norm = float(out.get("metrics", {}).get("grad_norm", float("-inf"))) if src else float("-inf")
        tokens = batch.num_tokens if src else 0
        flops = step_flops(*self.model_shape, batch.seqlens) if src else 0.0
        hits = _hits(out, batch) if src else 0.0
        loss_sum, tokens, flops, targets, hits = pdist.all_reduce(
            [loss_part, tokens, flops, float(batch.loss_mask.sum()) if src else 0.0, hits]
        )
        (grad_norm,) = pdist.all_reduce([grad_norm], op="max")
        metrics = {
            "train/loss": loss_sum / self.dp_size,
            "train/grad_norm": grad_norm,
            "train/skipped_step": float(
                not math.isfinite(grad_norm)
            ),  # counted by the engine, shown by the console
            "train/lr": lr,
            "train/epoch": epoch,
            "train/samples_seen": self._samples_seen(),
            "train/loss_tokens": targets,
            "perf/step_s": step_s,
            "perf/tokens": tokens,
            "perf/tokens_per_s": tokens / step_s,
            "perf/tflops_per_s": flops / step_s / 1e12,
        }
        if self.meta["calculate_accuracy"]:
            metrics["train/token_acc"] = hits / max(targets, 1.0)
        if self.peak_flops:
            metrics["perf/mfu"] = flops / step_s / (self.peak_flops * pdist.world_size())
        return metrics

    def _samples_seen(self) -> int:
        return (
            self.sampler.epoch * self.sampler.steps_per_epoch + self.sampler.step_in_epoch
        ) * self.sampler.batch_size

    def validate(self) -> dict[str, float]:
        """Token-mean NLL and token accuracy over the whole validation set (empty without
        ``data.val_files``)."""
        if self.val_set is None:
            return {}
        mine = list(range(len(self.val_set)))[self.dp_rank :: self.dp_size]
        per_batch = max(1, (self.cfg.data.val_batch_size or self.cfg.data.train_batch_size) // self.dp_size)
        (num_batches,) = pdist.all_reduce([-(-len(mine) // per_batch)], op="max")
        nll, count, hits = 0.0, 0.0, 0.0
        with self.engine.eval_mode():
            for b in range(int(num_batches)):
                idx = mine[b * per_batch : (b + 1) * per_batch]
                batch = self.val_set.batch(idx or [0], meta=dict(self.meta))
                if not idx:  # this rank ran out: a masked stand-in keeps the collectives in step
                    batch.loss_mask.zero_()
                out = self.engine.infer_batch(batch)
                if self.engine.is_mp_src_rank_with_outputs():
                    lp = out["model_output"]["log_probs"].float().cpu()
                    nll -= float((lp * batch.loss_mask).sum())
                    count += float(batch.loss_mask.sum())
                    hits += _hits(out, batch)
        nll, count, hits = pdist.all_reduce([nll, count, hits])
        metrics = {"val/loss": nll / max(count, 1.0)}
        if self.meta["calculate_accuracy"]:
            metrics["val/token_acc"] = hits / max(count, 1.0)
        return metrics


def _hits(out: dict[str, Any], batch: PackedBatch) -> float:
    """Loss-masked tokens that the engine found to be the argmax of their logits (0 without ``correct``)."""
    correct = out.get("model_output", {}).get("correct")
    return 0.0 if correct is None else float((correct.float().cpu() * batch.loss_mask).sum())


def _model_shape(path: str) -> tuple[int, int, int]:
    """(parameters, layers, hidden) of the HF model at ``path`` for the FLOPs count."""
    from transformers import AutoConfig

    from .model_init import count_parameters

    config = AutoConfig.from_pretrained(path)
    return count_parameters(path), int(config.num_hidden_layers), int(config.hidden_size)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="posttrain sft", description="Supervised fine-tuning on chat parquet data."
    )
    p.add_argument("--config", action="append", default=[], help="preset name or YAML file (repeatable)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.train_files=[train.parquet]")
    return p


def run(argv: Sequence[str]) -> dict[str, Any]:
    """Parse ``argv``, train, and return the last step's metrics."""
    args = parser().parse_args(list(argv))
    cfg = load_config(args.overrides, args.config, root=SFTConfig)
    preflight.check_sft(cfg)  # before any engine: each failure exits 2 naming the key
    threads.configure()
    trainer = SFTTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        png = trainer.close()
        if png is not None and pdist.rank() == 0:
            print(f"curves: {png}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    return exit_code("posttrain sft", lambda: run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""Compose a trainer from posttrain's packages: an engine, a checkpoint, a resume, a rollout weight sync.

Runs on a CPU in under a minute, with nothing downloaded (``uv run python examples/compose_trainer.py``):

1. a tiny random Qwen2 and its tokenizer, made offline (``posttrain.trainers.model_init``);
2. the FSDP2 engine, built from its config (``FSDP2EngineConfig(...).build(...)``), trains a few SFT steps on
   packed sequences with a token-mean loss;
3. a checkpoint through ``CheckpointManager``, then a second engine resumes from it: ``load_checkpoint`` returns
   the saved step, and the next step's loss is identical to the uninterrupted engine's;
4. an HF rollout, built from its config, takes the trained weights through the checksummed bucketed sync, and
   its log-probs of a sampled response match the engine's.

See docs/library.md for what each call promises.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from posttrain.ckpt import CheckpointManager, find_latest
from posttrain.core import LossContext, PackedBatch, SamplingConfig
from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
from posttrain.fsdp.config import FSDP2EngineConfig
from posttrain.rollout_hf.config import HFRolloutConfig
from posttrain.trainers.model_init import init_model

TEXTS = [
    "The largest of 3, 8 and 5 is 8.",
    "Two plus two is four.",
    "Paris is the capital of France.",
    "A tiny model learns short facts.",
]


def sft_loss(model_output: dict[str, torch.Tensor], micro: PackedBatch, ctx: LossContext):
    """Token-mean negative log-likelihood over the whole step: ``(loss, metrics)`` for each micro-batch."""
    nll = -(model_output["log_probs"] * micro.loss_mask).sum()
    return nll / max(ctx.global_num_tokens, 1) * ctx.dp_size, {}


def make_engine(model: ModelConfig, root: Path):
    """The FSDP2 engine from its config, initialised (in a plain process it trains the unwrapped module)."""
    engine_cfg = FSDP2EngineConfig(
        dtype="float32", use_dynamic_bsz=True, max_token_len_per_gpu=512, use_torch_compile=False
    )
    optim = OptimizerConfig(lr=1e-3, total_training_steps=10)
    ckpt = CheckpointConfig(save_contents=["model", "optimizer", "extra"])
    return engine_cfg.build("language_model", model=model, optim=optim, ckpt=ckpt), ckpt


def train_step(engine, batch: PackedBatch) -> float:
    """One optimizer step; ``train_batch`` returns the loss of each micro-batch."""
    with engine.train_mode():
        out = engine.train_batch(batch, sft_loss)
    engine.lr_scheduler_step()
    return float(sum(out["loss"]))


def check_rollout_sync(engine, model: ModelConfig, tokenizer, version: int) -> float:
    """Sync the engine's weights into an HF rollout; return the largest log-prob gap on a sampled response."""
    rollout = HFRolloutConfig(dtype="float32").build(model, device="cpu")
    with engine.eval_mode():
        stream, peft_config = engine.get_per_tensor_param()
        report = rollout.update_weights(stream, peft_config=peft_config, version=version)
    assert rollout.weight_version() == version, "the rollout does not serve the synced weights"
    prompt = tokenizer("The largest of 2, 9 and 4 is")["input_ids"]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=0)
    (sample,) = rollout.generate([prompt], sampling)
    seq = list(sample.prompt_ids) + list(sample.response_ids)
    mask = [0.0] * len(sample.prompt_ids) + [1.0] * len(sample.response_ids)
    batch = PackedBatch.from_sequences([seq], [mask], fields={"temperature": [[1.0] * len(seq)]})
    with engine.eval_mode():
        engine_lp = engine.infer_batch(batch)["model_output"]["log_probs"][len(sample.prompt_ids) :]
    gap = float((engine_lp - torch.as_tensor(sample.log_probs)).abs().max())
    print(f"rollout sync: {report.num_tensors} tensors, version {version}, max log-prob gap {gap:.2e}")
    rollout.release()
    return gap


def main(out: Path, steps: int = 3) -> None:
    torch.manual_seed(0)
    model_dir = init_model(out / "model", size="tiny", seed=0)
    model = ModelConfig(path=str(model_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    seqs = [tokenizer(t)["input_ids"] for t in TEXTS]
    batch = PackedBatch.from_sequences(seqs, meta={"calculate_entropy": False})

    engine, ckpt_cfg = make_engine(model, out)
    losses = [train_step(engine, batch) for _ in range(steps)]
    print("losses:", " ".join(f"{x:.4f}" for x in losses))
    assert losses[-1] < losses[0], "the loss did not fall"

    manager = CheckpointManager(out / "ckpt", ckpt_cfg)
    staging = manager.stage(steps)
    engine.save_checkpoint(str(staging / "actor"), global_step=steps)
    manager.commit(steps)
    manager.close()
    expected = train_step(engine, batch)  # the uninterrupted engine's next step

    step, path = find_latest(out / "ckpt")
    resumed, _ = make_engine(model, out)
    counters = resumed.load_checkpoint(str(path / "actor"))
    assert counters["global_step"] == step == steps, counters
    again = train_step(resumed, batch)
    print(f"resumed at step {counters['global_step']}: next loss {again:.6f} (uninterrupted {expected:.6f})")
    assert again == expected, "the resumed step differs from the uninterrupted one"

    gap = check_rollout_sync(resumed, model, tokenizer, version=steps + 1)
    assert gap < 1e-4, f"the rollout's log-probs differ from the engine's by {gap}"
    print("compose_trainer: OK")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    args = parser.parse_args()
    if args.out:
        main(Path(args.out))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))

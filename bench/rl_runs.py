"""One run of ``bench/rl_throughput.py`` (and ``bench/trl_grpo.py``): the work a step does, the random-init
model and the prompt parquet it needs (made once per work directory), and the ``key=value`` overrides that put
it on the presets a user runs."""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Work:
    """What one step does."""

    shape: str | None
    """``posttrain model init`` size; None takes ``--shapes``."""
    prompts: int
    """Prompts per step and GPU (each with ``n`` responses)."""
    n: int
    """Responses per prompt."""
    prompt_len: int
    """Tokens per prompt, chat template included."""
    response_len: int
    """Response cap in tokens."""
    vocab: int | None = None
    """Tokenizer size (None: the shape's own)."""
    tokens_per_gpu: int | None = None
    """``max_token_len_per_gpu`` of actor and reference (None: the preset's)."""
    preset: str = "grpo_gsm8k"
    """The ``--config`` task preset the run starts from (``vllm_gpu`` is stacked on ``grpo_gsm8k`` for vLLM,
    as examples/grpo_fsdp.sh does)."""
    mini_prompts: int | None = None
    """``actor.ppo_mini_batch_size`` per GPU (None: all the step's prompts, one optimizer step)."""
    bf16: bool = True
    """bf16 engines and rollout (the preset's); fp32 otherwise."""


WORKS = {
    "bench": Work(shape=None, prompts=32, n=8, prompt_len=256, response_len=1024),
    # the README's GRPO command: examples/grpo_fsdp.sh with data.train_batch_size=128
    # actor.ppo_mini_batch_size=64
    "readme": Work(shape=None, prompts=128, n=5, prompt_len=256, response_len=1024, mini_prompts=64),
    "small": Work(
        shape="0.5b",
        prompts=32,
        n=8,
        prompt_len=32,
        response_len=256,
        vocab=448,
        preset="grpo_tiny",
        tokens_per_gpu=16384,
    ),
    "tiny": Work(
        shape="tiny", prompts=4, n=4, prompt_len=24, response_len=16, tokens_per_gpu=4096, bf16=False
    ),
}
WORKS["issue"] = WORKS["small"]  # the name BENCHMARKS.md's older records ran it under
DRIFT = 0.10
"""The most a later step's generation may be slower than the first's, per generated token."""


def prepare_model(workdir: Path, shape: str, vocab: int | None) -> Path:
    """A random-init model of ``shape`` (made once per workdir; the tokenizer is written last)."""
    from posttrain.trainers.model_init import count_parameters, init_model

    out = workdir / "models" / f"{shape}-v{vocab or 'default'}"
    if not (out / "tokenizer.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        init_model(out, size=shape, vocab_size=vocab)
        print(
            f"[rl-bench] model {shape}: {count_parameters(out):,} parameters in "
            f"{time.perf_counter() - start:.0f}s -> {out}",
            file=sys.stderr,
        )
    return out


def digit_prompts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` user messages of random digits that render to exactly ``length`` tokens in the chat
    template."""
    overhead = len(chat_ids(tokenizer, ""))
    if length <= overhead:
        raise ValueError(f"--prompt-len {length} must exceed the chat template's {overhead} tokens")
    rng = random.Random(seed)
    texts = ["".join(rng.choice("0123456789") for _ in range(length - overhead)) for _ in range(count)]
    got = {len(chat_ids(tokenizer, t)) for t in texts[:4]}
    if got != {length}:
        raise ValueError(
            f"digit prompts render to {sorted(got)} tokens, not {length}: digits must be 1 token each"
        )
    return texts


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prepare_data(workdir: Path, model_dir: Path, work: Work, rows: int) -> Path:
    """A parquet of ``rows`` prompts in verl's columns (data_source synthetic_arithmetic: the ``####``
    rule)."""
    from transformers import AutoTokenizer

    from posttrain.trainers.data.convert import write_parquet
    from posttrain.trainers.data.synthetic import make_row

    path = workdir / "data" / f"{model_dir.name}-p{work.prompt_len}-r{rows}.parquet"
    if not path.is_file():
        tok = AutoTokenizer.from_pretrained(model_dir)
        texts = digit_prompts(tok, rows, work.prompt_len)
        kwargs = dict(data_source="synthetic_arithmetic", ability="math", instruction="", split="train")
        write_parquet([make_row(t, "#### 7", "7", index=i, **kwargs) for i, t in enumerate(texts)], path)
    return path


def overrides(
    work: Work,
    args: argparse.Namespace,
    model: Path,
    data: Path,
    rollout: str,
    world: int,
    run_dir: Path,
    mode: str = "sync",
    placement: str = "colocated",
):
    """The ``key=value`` list of one run: what examples/grpo_fsdp.sh passes on top of its presets (model,
    data, batch, rollout, trainer) and the work's sizes; every other setting is the preset's."""
    prompts = work.prompts * world
    out = [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        "data.prompt_key=prompt",
        f"data.train_batch_size={prompts}",
        f"actor.ppo_mini_batch_size={(work.mini_prompts or work.prompts) * world}",
        "algorithm.adv_estimator=grpo",
        f"rollout.name={rollout}",
        f"rollout.n={work.n}",
        f"rollout.response_length={work.response_len}",
        f"trainer.total_training_steps={args.warmup + args.steps}",
        f"trainer.n_gpus_per_node={world}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
    ]
    if work.prompt_len > 512 or work.preset != "grpo_gsm8k":
        out += [f"rollout.prompt_length={work.prompt_len}"]
    if work.tokens_per_gpu is not None:
        out += [f"{r}.engine.max_token_len_per_gpu={work.tokens_per_gpu}" for r in ("actor", "ref")]
    if not work.bf16:  # CPU smoke run: fp32, and compiling the log-prob chunk costs more than it saves
        out += ["rollout.dtype=float32"]
        for role in ("actor", "ref"):
            out += [f"{role}.engine.dtype=float32", f"{role}.engine.use_torch_compile=false"]
    if args.no_kl:
        out += ["actor.use_kl_loss=false"]
    if mode != "sync":
        # one batch past the timed steps, so the last timed step also trains while the next batch generates
        out += [f"trainer.mode={mode}", f"trainer.total_training_steps={args.warmup + args.steps + 1}"]
        out += placement_overrides(placement, rollout, world, on_gpu=work.bf16)
    return out + list(args.set)


def presets(work: Work, rollout: str) -> list[str]:
    """The ``--config`` presets of a run, as examples/grpo_fsdp.sh stacks them."""
    return [work.preset] + (["vllm_gpu"] if rollout == "vllm" and work.preset == "grpo_gsm8k" else [])


def placement_overrides(placement: str, rollout: str, world: int, on_gpu: bool) -> list[str]:
    """Where an overlapped run's rollout generates: beside the trainer (vLLM's engine core in a process of its
    own), or in a rollout process per trainer rank (vLLM in-process there) on the trainer's GPU (``process``)
    or on a GPU of its own (``disaggregated``: GPUs ``world`` to ``2 * world - 1``); the CPU smoke run's
    rollout process stays on the CPU."""
    if placement == "colocated":
        return ["rollout.executor=multiprocess"] if rollout == "vllm" else []
    out = ["trainer.rollout_placement=process"]
    if on_gpu:
        first = world if placement == "disaggregated" else 0
        out += [f"trainer.rollout_devices=[{','.join(f'cuda:{first + rank}' for rank in range(world))}]"]
    if rollout == "vllm":
        out += ["rollout.executor=inprocess"]
        if placement == "disaggregated":
            out += ["rollout.gpu_memory_utilization=0.85"]
    return out

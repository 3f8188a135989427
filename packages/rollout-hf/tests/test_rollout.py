"""HFRollout against hand-written references built from the same HF model."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import build_tiny_model

from posttrain.core import RolloutConfig, SamplingConfig
from posttrain.core.weight_sync import WeightSyncError
from posttrain.rollout_hf import HFRollout

PROMPTS = [[5, 17, 33, 101, 7], [9, 250], [44, 45, 46, 300, 301, 302, 303, 12]]


def make_rollout(path: str, **overrides) -> HFRollout:
    cfg = RolloutConfig(dtype="float32", update_weights_bucket_megabytes=1, **overrides)
    return HFRollout(cfg, path, device="cpu")


def greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """One prompt, no padding, no KV cache: the full forward at every step, argmax."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            token = int(torch.argmax(logits))
            logps.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logps


def sampled_logprob_reference(model, prompt, response, temperature, top_k, top_p) -> list[float]:
    """log p(token) under temperature, then top-k, then top-p, written per position in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double()
    out = []
    for j, token in enumerate(response):
        scaled = (logits[len(prompt) - 1 + j] / temperature).tolist()
        order = sorted(range(len(scaled)), key=lambda v: -scaled[v])
        kept = order[:top_k] if top_k > 0 else order
        z = [math.exp(scaled[v] - scaled[kept[0]]) for v in kept]
        probs = [p / sum(z) for p in z]
        nucleus, mass = [], 0.0
        for v, p in zip(kept, probs):
            if mass >= top_p:
                break
            nucleus.append(v)
            mass += p
        assert token in nucleus, f"sampled token {token} is outside the top-k/top-p set"
        num = math.exp(scaled[token] - scaled[kept[0]])
        out.append(math.log(num / sum(math.exp(scaled[v] - scaled[kept[0]]) for v in nucleus)))
    return out


def test_registry_finds_hf_rollout_and_its_config():
    from posttrain.core.registry import load_target, rollout_config_class
    from posttrain.rollout_hf.config import HFRolloutConfig

    assert rollout_config_class("hf") is HFRolloutConfig
    assert load_target(HFRolloutConfig.rollout_class) is HFRollout


def test_greedy_matches_hand_written_loop(tiny_model_dir):
    rollout = make_rollout(tiny_model_dir)
    model = build_tiny_model()
    samples = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    assert [s.prompt_index for s in samples] == [0, 1, 2]
    for prompt, sample in zip(PROMPTS, samples):
        tokens, logps = greedy_reference(model, prompt, 10)
        assert sample.prompt_ids == prompt
        assert sample.response_ids == tokens
        assert sample.finish_reason == "length"
        torch.testing.assert_close(
            sample.log_probs.double(), torch.tensor(logps, dtype=torch.float64), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, -1, 1.0), (1.3, 20, 0.9), (1.0, -1, 0.5)])
def test_sampled_logprobs_are_those_of_the_sampling_distribution(tiny_model_dir, temperature, top_k, top_p):
    rollout = make_rollout(tiny_model_dir)
    model = build_tiny_model()
    sampling = SamplingConfig(
        temperature=temperature, top_k=top_k, top_p=top_p, n=3, max_new_tokens=6, seed=1
    )
    samples = rollout.generate(PROMPTS[:2], sampling)
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1, "n samples of one prompt should differ"
    for s in samples:
        ref = sampled_logprob_reference(model, s.prompt_ids, s.response_ids, temperature, top_k, top_p)
        torch.testing.assert_close(
            s.log_probs.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-4, rtol=0
        )


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    sampling = SamplingConfig(temperature=1.0, n=2, max_new_tokens=8)
    a, b = make_rollout(tiny_model_dir, seed=3), make_rollout(tiny_model_dir, seed=3)
    first = [s.response_ids for s in a.generate(PROMPTS, sampling)]
    assert first == [s.response_ids for s in b.generate(PROMPTS, sampling)]
    state = a.state_dict()
    second = [s.response_ids for s in a.generate(PROMPTS, sampling)]
    assert second != first, "the rollout generator must advance between calls"
    b.load_state_dict(state)
    assert second == [s.response_ids for s in b.generate(PROMPTS, sampling)]
    seeded = SamplingConfig(temperature=1.0, n=2, max_new_tokens=8, seed=11)
    assert [s.response_ids for s in a.generate(PROMPTS, seeded)] == [
        s.response_ids for s in make_rollout(tiny_model_dir, seed=99).generate(PROMPTS, seeded)
    ]


def test_agenerate_equals_generate_for_the_same_prompt_seed_and_sampling(tiny_model_dir):
    """Requests awaited together (one prompt each, as the agent loop sends them) decode one at a time on the
    rollout's request thread and give exactly the samples of ``generate`` over that prompt alone."""
    import asyncio

    rollout = make_rollout(tiny_model_dir)
    calls = [SamplingConfig(temperature=1.0, n=2, max_new_tokens=8, seed=20 + i) for i in range(len(PROMPTS))]

    async def requests():
        return await asyncio.gather(
            *(rollout.agenerate(p, c, i) for i, (p, c) in enumerate(zip(PROMPTS, calls)))
        )

    answers = asyncio.run(requests())
    for i, (prompt, call, got) in enumerate(zip(PROMPTS, calls, answers)):
        want = rollout.generate([prompt], call)
        assert [s.prompt_index for s in got] == [i, i]
        for g, w in zip(got, want):
            assert g.prompt_ids == w.prompt_ids and g.response_ids == w.response_ids
            assert g.finish_reason == w.finish_reason and torch.equal(g.log_probs, w.log_probs)
    rollout.release()


def test_stop_tokens_end_a_response(tiny_model_dir):
    rollout = make_rollout(tiny_model_dir)
    free = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    stop = free[0].response_ids[3]
    cut = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10, stop_token_ids=[stop]))
    for f, c in zip(free, cut):
        if stop in f.response_ids:
            end = f.response_ids.index(stop) + 1
            assert c.response_ids == f.response_ids[:end] and c.finish_reason == "stop"
            assert len(c.log_probs) == end
        else:
            assert c.response_ids == f.response_ids and c.finish_reason == "length"
    assert cut[0].finish_reason == "stop"


def perturbed_state(seed: int = 5, tied: bool = False):
    model = build_tiny_model(tied=tied)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_update_weights_gives_the_greedy_tokens_of_the_new_model(tiny_model_dir):
    rollout = make_rollout(tiny_model_dir)
    new_model = perturbed_state()
    before = [
        s.response_ids for s in rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    ]
    report = rollout.update_weights(iter(new_model.state_dict().items()))
    assert report.num_tensors == len(new_model.state_dict()) and report.num_buckets >= 2
    after = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    expected = [greedy_reference(new_model, p, 10)[0] for p in PROMPTS]
    assert [s.response_ids for s in after] == expected
    assert before != expected, "the perturbation must change the greedy tokens for this test to mean anything"


def test_dummy_load_format_starts_random_and_needs_a_full_sync(tiny_model_dir):
    """``rollout.load_format=dummy``: random weights built from the config, generation and an adapter-only
    sync refused until every weight has arrived, then the greedy tokens of the synced model."""
    rollout = make_rollout(tiny_model_dir, load_format="dummy")
    name = "model.embed_tokens.weight"
    assert not torch.equal(rollout.model.state_dict()[name], build_tiny_model().state_dict()[name])
    with pytest.raises(RuntimeError, match=r"random weights \(rollout.load_format=dummy\)"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0))
    with pytest.raises(ValueError, match="before any base weights"):
        rollout.update_weights(iter([]), peft_config={"r": 8, "lora_alpha": 16}, base_sync_done=True)
    new_model = perturbed_state()
    rollout.update_weights(iter(new_model.state_dict().items()))
    after = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    assert [s.response_ids for s in after] == [greedy_reference(new_model, p, 10)[0] for p in PROMPTS]


def test_deterministic_turns_on_deterministic_kernels(tiny_model_dir, monkeypatch):
    """``deterministic=True`` (the trainer's ``actor.engine.full_determinism``) makes torch raise on ops
    without a deterministic kernel and sets cuBLAS's workspace, process-wide; restored after the test."""
    for var in ("CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        HFRollout(RolloutConfig(dtype="float32"), tiny_model_dir, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_tied_embeddings_sync_once_and_partial_sync_raises(tmp_path):
    build_tiny_model(tied=True).save_pretrained(tmp_path)
    rollout = make_rollout(str(tmp_path))
    new_model = perturbed_state(tied=True)
    state = new_model.state_dict()
    # engines (like save_pretrained) send a tied lm_head once, under the embedding's name
    rollout.update_weights(iter((k, v) for k, v in state.items() if k != "lm_head.weight"))
    samples = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))
    assert [s.response_ids for s in samples] == [greedy_reference(new_model, p, 6)[0] for p in PROMPTS]
    with pytest.raises(WeightSyncError, match="untouched"):
        rollout.update_weights(iter((k, v) for k, v in state.items() if k != "model.norm.weight"))
    with pytest.raises(RuntimeError, match="weight sync"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0))


class CorruptingRollout(HFRollout):
    """Flips one byte of the second bucket in transit."""

    def _make_transport(self, receiver):
        inner = super()._make_transport(receiver)

        class Corrupt:
            def send(self, bucket):
                if bucket.index == 1:
                    meta = bucket.metas[0]
                    bucket.buffer[meta.offset] ^= 0x10
                inner.send(bucket)

        return Corrupt()


def test_corrupted_bucket_raises_and_blocks_generation(tiny_model_dir):
    rollout = CorruptingRollout(
        RolloutConfig(dtype="float32", update_weights_bucket_megabytes=1), tiny_model_dir
    )
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        rollout.update_weights(iter(perturbed_state().state_dict().items()))
    with pytest.raises(RuntimeError, match="weight sync"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0))


def test_unknown_name_and_wrong_shape_raise(tiny_model_dir):
    rollout = make_rollout(tiny_model_dir)
    with pytest.raises(WeightSyncError, match="does not have"):
        rollout.update_weights(iter([("model.not_a_layer.weight", torch.zeros(3))]))
    with pytest.raises(WeightSyncError, match="shape"):
        rollout.update_weights(iter([("model.norm.weight", torch.zeros(7))]))
    with pytest.raises(ValueError, match="DoRA"):
        rollout.update_weights(iter([]), peft_config={"r": 8, "lora_alpha": 16, "use_dora": True})


def test_sleep_and_wake_up(tiny_model_dir):
    rollout = make_rollout(tiny_model_dir)
    rollout.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=2))
    with pytest.raises(ValueError, match="unknown"):
        rollout.wake_up(["weights", "optimizer"])
    rollout.wake_up()
    assert len(rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=2))) == 3
    rollout.release()
    with pytest.raises(RuntimeError, match="released"):
        rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=2))
    short = make_rollout(tiny_model_dir, prompt_length=4, response_length=4)
    with pytest.raises(ValueError, match="max_model_len"):
        short.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generation_sync_and_offload(tiny_model_dir):
    rollout = HFRollout(
        RolloutConfig(dtype="float32", update_weights_bucket_megabytes=1), tiny_model_dir, "cuda"
    )
    new_model = perturbed_state()
    rollout.update_weights(iter(new_model.state_dict().items()))
    rollout.sleep(1)
    assert next(rollout.model.parameters()).device.type == "cpu"
    rollout.wake_up(["weights"])
    assert next(rollout.model.parameters()).device.type == "cuda"
    samples = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    assert [s.response_ids for s in samples] == [greedy_reference(new_model, p, 10)[0] for p in PROMPTS]
    sampled = rollout.generate(PROMPTS, SamplingConfig(temperature=1.0, n=2, max_new_tokens=6, seed=4))
    assert [s.response_ids for s in sampled] == [
        s.response_ids
        for s in rollout.generate(PROMPTS, SamplingConfig(temperature=1.0, n=2, max_new_tokens=6, seed=4))
    ]


@pytest.mark.parametrize(("spelling", "want"), [("half", torch.float16), ("bf16", torch.bfloat16)])
def test_rollout_dtype_aliases(tiny_model_dir, spelling, want):
    rollout = HFRollout(RolloutConfig(dtype=spelling), tiny_model_dir, device="cpu")
    assert rollout.dtype is want and next(rollout.model.parameters()).dtype is want
    with pytest.raises(ValueError, match="rollout.dtype='int8'"):
        HFRollout(RolloutConfig(dtype="int8"), tiny_model_dir, device="cpu")

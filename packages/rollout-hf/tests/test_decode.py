"""The device-side decode loop: greedy tokens equal ``model.generate``'s for every cache and mask path, rows
that finish early leave the others untouched, sampling is multinomial's draw, and bad options are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_model

from posttrain.core import RolloutConfig, SamplingConfig
from posttrain.rollout_hf import HFRollout
from posttrain.rollout_hf.config import HFRolloutConfig
from posttrain.rollout_hf.decode import prepared_masks_supported
from posttrain.rollout_hf.sampling import process_logits, select_tokens

PROMPTS = [[5, 17, 33, 101, 7], [9, 250], [44, 45, 46, 300, 301, 302, 303, 12]]


def generate_reference(model, prompt: list[int], steps: int) -> list[int]:
    """HF's own greedy ``generate`` on one unpadded prompt (it stops on the model's eos)."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=steps, pad_token_id=0, eos_token_id=2
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory) -> str:
    """The tiny model with every layer a (wide) sliding-window layer: HF builds its masks, static cache
    too."""
    from transformers import AutoModelForCausalLM

    model = build_tiny_model()
    model.config.use_sliding_window, model.config.sliding_window, model.config.max_window_layers = (
        True,
        512,
        0,
    )
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    path = tmp_path_factory.mktemp("sliding")
    model.save_pretrained(path)
    assert not prepared_masks_supported(AutoModelForCausalLM.from_pretrained(path))
    return str(path)


@pytest.mark.parametrize("variant", ["static", "dynamic", "eager", "sliding"])
def test_greedy_equals_hf_generate(tiny_model_dir, sliding_dir, variant):
    path = sliding_dir if variant == "sliding" else tiny_model_dir
    cache = "dynamic" if variant == "dynamic" else "static"
    rollout = HFRollout(HFRolloutConfig(dtype="float32", cache=cache, stop_check_interval=3), path)
    if variant == "eager":  # additive float masks instead of sdpa's boolean ones
        rollout.model.set_attn_implementation("eager")
        assert prepared_masks_supported(rollout.model)
    model = build_tiny_model()
    samples = rollout.generate(PROMPTS * 2, SamplingConfig(temperature=0, max_new_tokens=12))
    for prompt, sample in zip(PROMPTS * 2, samples):
        want = generate_reference(model, prompt, 12)
        assert sample.response_ids == want
        assert sample.finish_reason == ("stop" if want[-1] == 2 else "length")


def test_rows_that_stop_early_leave_the_others_unchanged(tiny_model_dir):
    rollout = HFRollout(HFRolloutConfig(dtype="float32", stop_check_interval=1), tiny_model_dir)
    free = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10))
    stops = sorted({s.response_ids[1] for s in free})  # every row stops by its second token
    cut = rollout.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=10, stop_token_ids=stops))
    assert all(c.finish_reason == "stop" and len(c.response_ids) <= 2 for c in cut)
    for f, c in zip(free, cut):
        assert c.response_ids == f.response_ids[: len(c.response_ids)]
        torch.testing.assert_close(c.log_probs, f.log_probs[: len(c.log_probs)])


def test_sampling_is_multinomials_draw():
    """The same tokens as ``torch.multinomial`` on the same probabilities and generator (the old loop's
    draw)."""
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    sampling = SamplingConfig(temperature=0.8, top_k=50)
    for _ in range(3):
        tokens, _ = select_tokens(logits, sampling, gen_a)
        probs = torch.log_softmax(process_logits(logits, sampling), -1).exp()
        assert torch.equal(tokens, torch.multinomial(probs, 1, generator=gen_b).squeeze(-1))


@dataclasses.dataclass(kw_only=True)
class OtherRolloutConfig(RolloutConfig):
    """Another rollout's config: its knobs would be lost in an HFRolloutConfig."""

    name: str = "other"
    other_knob: int = 1


def test_bad_options_name_the_fix(tiny_model_dir):
    with pytest.raises(ValueError, match="needs rollout.cache=static"):
        HFRolloutConfig(compile=True, cache="dynamic")
    with pytest.raises(ValueError, match="cache='paged'"):
        HFRolloutConfig(cache="paged")
    with pytest.raises(ValueError, match="stop_check_interval=0"):
        HFRolloutConfig(stop_check_interval=0)
    with pytest.raises(ValueError, match="router hooks"):
        HFRolloutConfig(return_routed_experts=True, compile=True)
    with pytest.raises(ValueError, match="load_format='safetensors'.*rollout.name=vllm"):
        HFRolloutConfig(load_format="safetensors")
    with pytest.raises(ValueError, match="OtherRolloutConfig .* cannot configure a HFRolloutConfig"):
        HFRolloutConfig.of(OtherRolloutConfig())
    rollout = HFRollout(HFRolloutConfig(dtype="float32", cache="dynamic"), tiny_model_dir)
    assert rollout.config.cache == "dynamic"
    plain = HFRollout(RolloutConfig(dtype="float32", n=3), tiny_model_dir)  # the shared fields, HF defaults
    assert type(plain.config) is HFRolloutConfig and (plain.config.n, plain.config.cache) == (3, "static")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_decode_has_no_host_sync_per_token(tiny_model_dir):
    """``set_sync_debug_mode('warn')`` flags every synchronising CUDA call: a generation of 128 tokens makes a
    fixed number (input copies, the cache's set-up, the final copies) plus one per ``stop_check_interval``."""
    import warnings

    rollout = HFRollout(RolloutConfig(dtype="float32"), tiny_model_dir, "cuda")
    sampling = SamplingConfig(temperature=1.0, n=2, max_new_tokens=128, seed=0)
    rollout.generate(PROMPTS, sampling)  # warm-up (cuBLAS handles, caching allocator)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            samples = rollout.generate(PROMPTS, sampling)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    steps = max(len(s.response_ids) for s in samples)
    assert len(syncs) <= steps // 8 + 24, (steps, [str(w.message)[:80] for w in syncs[:5]])


@pytest.mark.gpu
@cuda
def test_cuda_compiled_step_gives_the_eager_tokens(tiny_model_dir):
    config = RolloutConfig(dtype="float32", prompt_length=16, response_length=24)
    eager = HFRollout(config, tiny_model_dir, "cuda")
    compiled = HFRollout(
        HFRolloutConfig(dtype="float32", prompt_length=16, response_length=24, compile=True),
        tiny_model_dir,
        "cuda",
    )
    for prompts in (PROMPTS, PROMPTS[::-1]):  # the second call reuses the graph (same padded shapes)
        sampling = SamplingConfig(temperature=0, max_new_tokens=24)
        want = [s.response_ids for s in eager.generate(prompts, sampling)]
        assert [s.response_ids for s in compiled.generate(prompts, sampling)] == want


class GroupedAttention(torch.nn.Module):
    num_key_value_groups = 7
    is_causal = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_decode_attention_equals_hf_sdpa(dtype):
    """A masked one-token query over 7 query heads per kv head: the same output as HF's repeat_kv + SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from posttrain.rollout_hf.attention import rollout_attention_forward

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 14, 1, 64, generator=gen).to(dtype)
    k, v = (torch.randn(3, 2, 40, 64, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(3, 1, 1, 40, generator=gen) > 0.3
    got, _ = rollout_attention_forward(GroupedAttention(), q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(GroupedAttention(), q, k, v, mask, scaling=0.125)
    assert got.shape == want.shape == (3, 1, 14, 64)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


def test_rollout_model_uses_the_folded_attention(tiny_model_dir):
    from posttrain.rollout_hf.attention import ATTN_IMPLEMENTATION

    rollout = HFRollout(RolloutConfig(dtype="float32"), tiny_model_dir)
    assert rollout.model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert prepared_masks_supported(rollout.model)

"""MoE router replay on one CPU process (a tiny Qwen3-MoE, local SequentialMLP experts).

R2: the log-prob pass records routing and a training pass replays exactly that routing, also when the training
pass splits the batch into other, reordered micro-batches. R3: the routing the HF rollout recorded, replayed
by the engine, gives HF's log-probs, and the routers keep using the rollout's experts after their weights
change.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.core.testing import TINY_QWEN3_MOE, save_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe")


def capture_by_token(batch, loss_fn):
    """(loss fn that files each micro-batch's log-probs under the batch's token order, the (T,) result)."""
    batch.fields["token_index"] = torch.arange(batch.num_tokens, dtype=torch.float32)
    result = torch.full((batch.num_tokens,), float("nan"))
    order: list[list[int]] = []

    def capture(out, micro, ctx):
        rows = micro.fields["token_index"].long()
        result[rows] = out["log_probs"].detach().cpu()
        order.append(rows.tolist())
        return loss_fn(out, micro, ctx)

    return capture, result, order


def test_r2_records_and_replays_routing(megatron_env, tiny_moe, packed_batch):
    from megatron_cpu import hf_log_probs, make_engine, nll_loss
    from transformers import AutoModelForCausalLM

    from posttrain.core.config import RouterReplayConfig

    eng = make_engine(tiny_moe, router_replay=RouterReplayConfig(mode="R2"))
    batch = packed_batch.select([0, 2])
    with eng.eval_mode():
        first = eng.infer_batch(batch)["model_output"]
        again = eng.infer_batch(batch)["model_output"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(first["log_probs"].double(), hf_log_probs(hf, batch), atol=2e-5, rtol=0)
    routed = first["routed_experts"]
    assert routed.shape == (
        batch.num_tokens,
        TINY_QWEN3_MOE["num_hidden_layers"],
        TINY_QWEN3_MOE["num_experts_per_tok"],
    )
    assert torch.equal(routed, again["routed_experts"])

    captured: list[torch.Tensor] = []

    def capture(out, micro, ctx):
        captured.append(out["log_probs"].detach())
        return nll_loss(out, micro, ctx)

    with eng.train_mode():
        batch.fields["routed_experts"] = routed
        eng.forward_backward_batch(batch, capture)
        eng.optimizer_zero_grad()
        batch.fields["routed_experts"] = (routed + 1) % TINY_QWEN3_MOE["num_experts"]
        eng.forward_backward_batch(batch, capture)
        eng.optimizer_zero_grad()
        batch.fields["routed_experts"] = routed
        losses = [sum(eng.train_batch(batch, nll_loss)["loss"]) for _ in range(3)]
    assert torch.equal(captured[0], first["log_probs"])  # replaying the record reproduces the pass exactly
    assert (captured[1] - first["log_probs"]).abs().max() > 1e-3  # and replay really drives the routers
    assert losses[2] < losses[0]


def test_r2_replay_follows_tokens_into_reordered_micro_batches(megatron_env, tiny_moe, packed_batch):
    """One forward-only micro-batch records; a token budget of 14 splits the update into 3 micro-batches of
    the sequences [1], [3], [0, 2] (balanced partition), and each replays its own tokens' routing: bitwise the
    log-probs of the same micro-batches routed by the (unchanged) routers, and the recording pass's log-probs
    up to the float32 noise of another packing."""
    from megatron_cpu import nll_loss

    from posttrain.core.config import RouterReplayConfig

    eng = _dynamic_engine(tiny_moe, RouterReplayConfig(mode="R2"))
    batch = packed_batch
    with eng.eval_mode():
        first = eng.infer_batch(batch)["model_output"]
    passes = {}
    for name, routing in [
        ("routed", None),
        ("replayed", first["routed_experts"]),
        ("misaligned", torch.roll(first["routed_experts"], 1, dims=0)),
    ]:
        batch.fields.pop("routed_experts", None)
        if routing is not None:
            batch.fields["routed_experts"] = routing
        capture, passes[name], order = capture_by_token(batch, nll_loss)
        with eng.train_mode():
            eng.forward_backward_batch(batch, capture)
            eng.optimizer_zero_grad()
        cu = batch.host_cu_seqlens
        assert [o[0] for o in order] == [cu[1], cu[3], cu[0]]  # reordered micro-batches
    assert torch.equal(passes["replayed"], passes["routed"])
    torch.testing.assert_close(passes["replayed"], first["log_probs"], atol=2e-6, rtol=0)  # measured 4.8e-7
    assert (passes["misaligned"] - first["log_probs"]).abs().max() > 1e-3


def _dynamic_engine(path, router_replay):
    from megatron_cpu import make_engine

    return make_engine(
        path,
        router_replay=router_replay,
        use_dynamic_bsz=True,
        micro_batch_size_per_gpu=None,
        max_token_len_per_gpu=14,
        infer_max_token_len_per_gpu=64,
    )


def observed_routing(eng, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, (T, layers, experts) bool expert maps the routers used) of a forward-only pass, read by
    forward hooks on Megatron-Core's routers (micro-batches of whole sequences in batch order)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in eng.chunks[0].modules() if isinstance(m, TopKRouter)]
    maps: dict[int, list[torch.Tensor]] = {id(r): [] for r in routers}
    handles = [r.register_forward_hook(lambda m, a, out: maps[id(m)].append(out[1])) for r in routers]
    try:
        with eng.eval_mode():
            out = eng.infer_batch(batch)["model_output"]
    finally:
        for h in handles:
            h.remove()
    used = torch.stack([torch.cat(maps[id(r)])[: batch.num_tokens] for r in routers], dim=1)
    return out["log_probs"], used


def as_maps(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T, layers, k) expert ids -> (T, layers, experts) bool; -1 rows -> experts 0..k-1 (the engine's
    fill)."""
    idx = torch.where(indices < 0, torch.arange(indices.shape[-1]), indices.long())
    return torch.zeros(*indices.shape[:2], num_experts, dtype=torch.bool).scatter_(2, idx, True)


def test_r3_replays_hf_rollout_routing(megatron_env, tiny_moe):
    from megatron_cpu import hf_log_probs, make_engine

    from posttrain.core import RolloutConfig, SamplingConfig
    from posttrain.core.batch import PackedBatch
    from posttrain.core.config import RouterReplayConfig
    from posttrain.rollout_hf import HFRollout

    rollout = HFRollout(RolloutConfig(dtype="float32", return_routed_experts=True), tiny_moe)
    prompts = [[5, 17, 33, 101, 7], [9, 250, 3]]
    samples = rollout.generate(prompts, SamplingConfig(n=2, max_new_tokens=6, seed=0))
    batch = PackedBatch.from_sequences([s.prompt_ids + s.response_ids for s in samples])
    rollout_routing = torch.cat([s.routed_experts for s in samples])
    known = rollout_routing[:, 0, 0] >= 0  # every row but each sequence's last token
    num_experts = TINY_QWEN3_MOE["num_experts"]

    eng = make_engine(tiny_moe, router_replay=RouterReplayConfig(mode="R3"))
    free_lp, free_used = observed_routing(eng, batch)  # no field: the routers route
    batch.fields["routed_experts"] = rollout_routing
    lp, used = observed_routing(eng, batch)
    with torch.no_grad():
        reference = hf_log_probs(rollout.model, batch)
    torch.testing.assert_close(lp.double(), reference, atol=2e-5, rtol=0)
    torch.testing.assert_close(free_lp.double(), reference, atol=2e-5, rtol=0)  # same weights, same routing
    assert torch.equal(used, as_maps(rollout_routing, num_experts))
    assert torch.equal(free_used[known], used[known])

    with torch.no_grad():  # reverse the experts' order in every router: other experts win the top-k
        for name, p in eng.chunks[0].named_parameters():
            if name.endswith("router.weight"):
                p.copy_(p.flip(0))
    _, replayed = observed_routing(eng, batch)
    assert torch.equal(replayed, as_maps(rollout_routing, num_experts))  # still the rollout's experts
    del batch.fields["routed_experts"]
    _, rerouted = observed_routing(eng, batch)
    assert not torch.equal(rerouted[known], replayed[known])

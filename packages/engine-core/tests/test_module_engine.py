"""The shared engine over one module: micro-batch loop, optimizer calls, offload moves and the clipped
norm."""

import math

import pytest
import torch

from posttrain.core.batch import PackedBatch
from posttrain.core.config import CheckpointConfig, EngineConfig, ModelConfig, OptimizerConfig
from posttrain.core.engine import BaseEngine
from posttrain.core.module_engine import ModuleEngineMixin, ensure_process_group
from posttrain.core.optimizer import (
    OptimizerMixin,
    build_adamw,
    grad_norm_and_clip,
    move_optimizer_state,
)

VOCAB = 17


class ToyModuleEngine(ModuleEngineMixin, OptimizerMixin, BaseEngine):
    """A bigram model: ``values[t]`` is a score of token t given token t-1 (0 at a sequence's first token)."""

    def initialize(self) -> None:
        torch.manual_seed(0)
        self._device = torch.device("cpu")
        self.module = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 4), torch.nn.Linear(4, VOCAB))
        self.optimizer, self.lr_scheduler = build_adamw(self.module, self.optimizer_config, fused=False)

    def _forward_micro(self, mb):
        scores = self.module(mb.input_ids).log_softmax(-1)
        nxt = scores.gather(-1, torch.roll(mb.input_ids, -1)[:, None])[:, 0]
        aligned = torch.roll(nxt, 1).index_fill(0, mb.cu_seqlens[:-1].long(), 0.0)
        return {"values": aligned}

    def to(self, device, model=True, optimizer=True, grad=True):
        pass

    def clip_grad_norm(self):
        return grad_norm_and_clip(
            self.module.parameters(), self.optimizer_config.clip_grad, None, self.device
        )

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True

    def get_per_tensor_param(self, **kwargs):
        raise NotImplementedError

    def save_checkpoint(self, *args, **kwargs):
        raise NotImplementedError

    def load_checkpoint(self, *args, **kwargs):
        raise NotImplementedError


def _engine(**engine_kwargs):
    optim = OptimizerConfig(lr=0.1, lr_warmup_steps=4)
    eng = ToyModuleEngine(ModelConfig(), EngineConfig(**engine_kwargs), optim, CheckpointConfig())
    eng.initialize()
    return eng


def _batch():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 2, 7, 3, 4)]
    return PackedBatch.from_sequences(seqs, [torch.ones(len(s)) for s in seqs])


def _loss(out, mb, ctx):
    return -(out["values"] * mb.loss_mask).sum() / ctx.global_num_tokens, {"n": mb.num_seqs}


def _grads(eng):
    return [p.grad.clone() for p in eng.module.parameters()]


@pytest.mark.parametrize(
    "layout", [{"max_token_len_per_gpu": 8}, {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}]
)
def test_micro_batches_equal_one_pass(layout):
    batch = _batch()
    whole, split = _engine(max_token_len_per_gpu=64), _engine(**layout)
    outs, grads = [], []
    for eng in (whole, split):
        with eng.train_mode():
            eng.optimizer_zero_grad()
            outs.append(eng.forward_backward_batch(batch, _loss))
            grads.append(_grads(eng))
    assert len(outs[1]["loss"]) > 1 and sum(outs[1]["metrics"]["n"]) == batch.num_seqs
    torch.testing.assert_close(outs[0]["model_output"]["values"], outs[1]["model_output"]["values"])
    torch.testing.assert_close(sum(outs[0]["loss"]), sum(outs[1]["loss"]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


def test_forward_only_needs_no_loss_and_training_does():
    eng = _engine(max_token_len_per_gpu=8)
    with eng.eval_mode():
        out = eng.infer_batch(_batch())
    assert out["model_output"]["values"].shape == (_batch().num_tokens,) and out["loss"] == []
    with pytest.raises(ValueError, match="needs a loss_fn"):
        eng.forward_backward_batch(_batch(), None)


def test_optimizer_calls_step_and_follow_the_schedule():
    eng = _engine(max_token_len_per_gpu=64)
    before = [p.detach().clone() for p in eng.module.parameters()]
    with eng.train_mode():
        out = eng.train_batch(_batch(), _loss)
    assert math.isfinite(out["metrics"]["grad_norm"])
    assert all(not torch.equal(a, b) for a, b in zip(before, eng.module.parameters()))
    assert eng.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)  # warmup step 0 of 4
    assert eng.lr_scheduler_step() == pytest.approx(0.1 * 2 / 4)
    eng.optimizer = None
    eng.module[0].weight.grad = torch.ones_like(eng.module[0].weight)
    eng.optimizer_zero_grad()  # forward-only: the module's grads
    assert eng.module[0].weight.grad is None


def test_grad_norm_and_clip_equal_torch():
    g = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(2)]
    params.append(torch.nn.Parameter(torch.randn(4, generator=g).double()))
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * 3
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    norm = grad_norm_and_clip(params, 1.0, None, torch.device("cpu"))
    want = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert norm == pytest.approx(float(want), rel=1e-6)
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.grad, c.grad)
    assert grad_norm_and_clip(params, 0.0, None, torch.device("cpu")) == pytest.approx(1.0, rel=1e-5)


def test_moves_keep_adam_step_in_place():
    module = torch.nn.Linear(3, 2)
    optimizer, _ = build_adamw(module, OptimizerConfig(lr=0.1), fused=False)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    step = {id(s["step"]): s["step"] for s in optimizer.state.values()}
    move_optimizer_state(optimizer, "meta")
    for state in optimizer.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        assert step[id(state["step"])] is state["step"] and not state["step"].is_meta


def test_no_process_group_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ensure_process_group() is False

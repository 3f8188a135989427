"""The vocab-parallel head's values and hand-written gradients against float64 autograd of log_softmax."""

from __future__ import annotations

import pytest
import torch

from posttrain.megatron.head import vocab_parallel_argmax_hits, vocab_parallel_logprobs


def _reference(logits, targets, temp):
    logp = torch.log_softmax(logits.double() / temp.double()[:, None], dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_log_probs_entropy_and_gradients_equal_autograd(dtype, tol, chunk):
    g = torch.Generator().manual_seed(0)
    n, vocab = 11, 37
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    temp = torch.rand(n, generator=g) + 0.5
    w_lp, w_ent = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double()

    ref_in = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = _reference(ref_in, targets, temp)
    (w_lp * ref_lp + w_ent * ref_ent).sum().backward()

    got_in = logits.detach().clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(got_in, targets, 0, None, True, temp, chunk)
    assert lp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
    (w_lp * lp.double() + w_ent * ent.double()).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=tol, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=tol, rtol=0)
    assert got_in.grad.dtype == dtype
    torch.testing.assert_close(got_in.grad.double(), ref_in.grad, atol=tol, rtol=0)


def test_log_probs_only_and_no_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 9, (6,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, 0, None, False, None, 4)
    assert ent is None
    lp.sum().backward()
    ref = logits.detach().clone().requires_grad_()
    torch.log_softmax(ref, -1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(logits.grad, ref.grad, atol=1e-12, rtol=0)


def test_a_shard_owns_only_its_columns():
    """One TP shard without the others: targets outside [vocab_start, vocab_start + width) add nothing."""
    logits = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    lp, _ = vocab_parallel_logprobs(logits, torch.tensor([5, 9]), 4, None, False, None, 2)
    # uniform shard: log Z = log 4; row 0's target (5) is column 1 here, row 1's (9) is not in the shard
    torch.testing.assert_close(lp.double(), torch.tensor([-torch.log(torch.tensor(4.0)).item()] * 2).double())
    lp.sum().backward()
    torch.testing.assert_close(logits.grad[0], torch.tensor([-0.25, 0.75, -0.25, -0.25], dtype=torch.float64))
    torch.testing.assert_close(logits.grad[1], torch.full((4,), -0.25, dtype=torch.float64))


def test_bad_chunk_size_names_the_setting():
    with pytest.raises(ValueError, match="entropy_from_logits_chunk_size"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0, None, False, None, 0)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_argmax_hits_equal_torch_argmax(chunk):
    """First index of the maximum, as torch.argmax (a tie is a hit only for the first column), in bf16 too."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 13, generator=g)
    logits[3, [2, 7]] = 50.0  # a tie: argmax is column 2
    want = logits.argmax(-1)
    targets = torch.where(torch.rand(9, generator=g) < 0.5, want, torch.randint(0, 13, (9,), generator=g))
    targets[3] = 7
    for dtype in (torch.float32, torch.bfloat16):
        hits = vocab_parallel_argmax_hits(logits.to(dtype), targets, 0, None, chunk)
        assert hits.dtype == torch.float32
        ref = (logits.to(dtype).argmax(-1) == targets).float()
        assert torch.equal(hits, ref) and 0 < float(hits.sum()) < 9 and hits[3] == 0


def test_compiled_chunk_math_equals_eager():
    """``use_compile`` (the engine's on CUDA; inductor's C++ backend here): the same values and gradients as
    the eager functions, on bf16 logits of a shard that owns only some targets, chunks of uneven length."""
    g = torch.Generator().manual_seed(3)
    n, width, start = 21, 40, 8
    logits = (torch.randn(n, width, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 64, (n,), generator=g)  # some fall outside [8, 48)
    temp = torch.rand(n, generator=g) + 0.5
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    runs = []
    for use_compile in (False, True):
        x = logits.clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(x, targets, start, None, True, temp, 8, use_compile)
        (w_lp * lp + w_ent * ent).sum().backward()
        runs.append((lp.detach(), ent.detach(), x.grad))
    for i, (eager, compiled) in enumerate(zip(*runs, strict=True)):
        assert compiled.dtype == eager.dtype
        rtol = 2**-7 if i == 2 else 1e-5  # the gradient is bf16: one rounding step apart at most
        torch.testing.assert_close(compiled.float(), eager.float(), atol=1e-5, rtol=rtol)
    assert runs[0][2].abs().sum() > 0

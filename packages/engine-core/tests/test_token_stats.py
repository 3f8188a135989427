"""The chunked next-token head: log-probs, entropy and accuracy equal the full-vocabulary computation."""

import pytest
import torch
import torch.nn.functional as F

from posttrain.core.batch import PackedBatch
from posttrain.core.token_stats import (
    HeadRequest,
    align_to_tokens,
    next_token_stats,
    shifted_targets,
    token_outputs,
)

T, H, V = 11, 8, 13


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    bias = torch.randn(V, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    temp = 0.5 + torch.rand(T, generator=g)
    return hidden, weight, bias, ids, temp


def _reference(hidden, weight, bias, targets, inv_temp):
    logits = F.linear(hidden, weight, bias)
    z = logits * inv_temp[:, None]
    logp = F.log_softmax(z, -1)
    log_prob = logp.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    correct = logits.argmax(-1).eq(targets).float()
    return log_prob, entropy, correct


@pytest.mark.parametrize("chunk_size", [1, 4, T])
@pytest.mark.parametrize("checkpointed", [True, False])
def test_chunks_equal_the_full_vocabulary(chunk_size, checkpointed):
    hidden, weight, bias, ids, temp = _inputs()
    targets, inv_temp = shifted_targets(ids, temp)
    assert torch.equal(targets[:-1], ids[1:]) and torch.allclose(inv_temp[:-1], 1 / temp[1:])
    request = HeadRequest(targets, inv_temp, True, chunk_size, checkpoint=checkpointed, with_accuracy=True)
    stats = next_token_stats(hidden, weight, bias, request)
    want = _reference(hidden, weight, bias, targets, inv_temp)
    assert stats.shape == (T, 3)
    for col, ref in enumerate(want):
        torch.testing.assert_close(stats[:, col], ref)
    got_grads = torch.autograd.grad((stats[:, 0] + stats[:, 1]).sum(), (hidden, weight))
    want_grads = torch.autograd.grad((want[0] + want[1]).sum(), (hidden, weight))
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref)


def test_columns_follow_the_request():
    hidden, weight, bias, ids, temp = _inputs(1)
    targets, inv_temp = shifted_targets(ids, temp)
    with torch.no_grad():
        only_log_prob = next_token_stats(hidden, weight, None, HeadRequest(targets, inv_temp, False, 3))
        with_accuracy = next_token_stats(
            hidden, weight, None, HeadRequest(targets, inv_temp, False, 3, with_accuracy=True)
        )
    assert only_log_prob.shape == (T, 1) and with_accuracy.shape == (T, 2)
    assert torch.equal(with_accuracy[:, 0], only_log_prob[:, 0])


def test_outputs_sit_on_the_token_they_score():
    batch = PackedBatch.from_sequences([[1, 2, 3], [4, 5]])
    per_position = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0])
    assert align_to_tokens(per_position, batch.cu_seqlens).tolist() == [0.0, 10.0, 11.0, 0.0, 13.0]
    stats = torch.stack([per_position, -per_position, per_position % 2], -1)
    out = token_outputs(stats, batch.cu_seqlens, with_entropy=True, with_accuracy=True)
    assert out["entropy"].tolist() == [0.0, -10.0, -11.0, 0.0, -13.0]
    assert out["correct"].tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert set(token_outputs(stats[:, :1], batch.cu_seqlens, False, False)) == {"log_probs"}

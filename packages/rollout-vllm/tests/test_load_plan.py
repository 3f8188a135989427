"""The recorded load plan against loading every tensor through ``load_weights`` (no vLLM needed).

The model below loads like vLLM's dense layers do (a fused q/k/v parameter written shard by shard through
``narrow``, a default loader, a transposed view) and like the loads the plan must refuse (padding rows filled,
a cast before the copy, two tensors writing the same rows). Its tensors arrive as views of a real bucket.
"""

from __future__ import annotations

import torch

from posttrain.core.weight_sync import BucketSender, InProcessTransport, unpack_bucket
from posttrain.rollout_vllm.load_plan import LoadPlan

H, VOCAB, PADDED = 8, 10, 16


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * H, H), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
        self.proj = torch.nn.Parameter(torch.zeros(H, 2 * H), requires_grad=False)  # stored transposed
        self.embed = torch.nn.Parameter(torch.zeros(PADDED, H), requires_grad=False)  # vocab padded
        self.scale = torch.nn.Parameter(torch.zeros(H, dtype=torch.float64), requires_grad=False)
        self.shared = torch.nn.Parameter(torch.zeros(H), requires_grad=False)

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, w in weights:
            if name in ("q", "k", "v"):
                shard = "qkv".index(name)
                self.qkv.data.narrow(0, shard * H, H).copy_(w)
                loaded.add("qkv")
            elif name == "norm":
                self.norm.data.copy_(w)
                loaded.add("norm")
            elif name == "proj":
                self.proj.data.copy_(w.t())
                loaded.add("proj")
            elif name == "embed":
                self.embed.data[:VOCAB].copy_(w)
                self.embed.data[VOCAB:].fill_(0)
                loaded.add("embed")
            elif name == "scale":
                self.scale.data.copy_(w.to(torch.float64))
                loaded.add("scale")
            elif name in ("shared_a", "shared_b"):
                self.shared.data.copy_(w)
                loaded.add("shared")
        return loaded


def stream(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(q=(H, H), k=(H, H), v=(H, H), norm=(H,), proj=(2 * H, H), embed=(VOCAB, H), scale=(H,))
    out = [(name, torch.randn(*shape, generator=gen)) for name, shape in shapes.items()]
    return out + [("shared_a", torch.randn(H, generator=gen)), ("shared_b", torch.randn(H, generator=gen))]


def buckets(weights: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """The stream as the worker gets it: views of each bucket (kept: the test's sender reuses no buffer)."""
    out: list[list[tuple[str, torch.Tensor]]] = []

    def receive(bucket):
        out.append(list(unpack_bucket(bucket)))

    for name, tensor in weights:  # one sender per tensor: every tensor keeps its own bucket
        BucketSender(InProcessTransport(receive), 4096).send([(name, tensor)])
    return out


def load_planned(model: Model, plan: LoadPlan, weights) -> set[str]:
    loaded: set[str] = set()
    for bucket in buckets(weights):
        names, rest = plan.replay(bucket)
        loaded |= names | model.load_weights(rest)
    return loaded


def recorded(model: Model) -> LoadPlan:
    plan = LoadPlan(model)
    for bucket in buckets(stream(0)):
        plan.record(model.load_weights, bucket)
    plan.finish()
    return plan


def test_replay_writes_what_load_weights_writes():
    planned, reference = Model(), Model()
    plan = recorded(planned)
    assert plan.refusals().keys() == {"embed", "scale", "shared_a", "shared_b"}, plan.refusals()
    assert "wrote a parameter" in plan.refusals()["embed"]
    assert "read the tensor" in plan.refusals()["scale"]
    assert "overlap" in plan.refusals()["shared_a"]
    new = stream(1)
    assert load_planned(planned, plan, new) == reference.load_weights(new)
    for (name, got), want in zip(planned.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(got, want), name
    assert not torch.equal(planned.qkv, Model().qkv)


def test_replay_of_planned_tensors_does_not_call_load_weights():
    model = Model()
    plan = recorded(model)
    planned = [
        [(n, t) for n, t in bucket if n in ("q", "k", "v", "norm", "proj")] for bucket in buckets(stream(2))
    ]
    for bucket in filter(None, planned):
        _, rest = plan.replay(bucket)
        assert rest == []
    assert torch.equal(model.proj, dict(stream(2))["proj"].t())


def test_a_replaced_parameter_invalidates_the_plan():
    model = Model()
    plan = recorded(model)
    assert plan.valid(model)
    model.norm = torch.nn.Parameter(torch.zeros(H), requires_grad=False)
    assert not plan.valid(model)


def test_a_tensor_of_another_shape_goes_through_load_weights():
    model = Model()
    plan = recorded(model)
    odd = buckets([("norm", torch.ones(2 * H))])[0]
    _, rest = plan.replay(odd)
    assert [n for n, _ in rest] == ["norm"]

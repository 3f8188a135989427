"""Without a vLLM engine: shared-memory and CUDA IPC syncs into another process, corruption, argument
checks."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest
import torch
from vllm_testing import receive_in_child

from posttrain.core.weight_sync import BucketSender
from posttrain.rollout_vllm.transport import BucketOpener, RpcBucketTransport


def stream(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(64, 32 + i, generator=gen) for i in range(6)} | {
        "ids": torch.arange(17, dtype=torch.int64)
    }


def sync_to_child(
    weights: dict[str, torch.Tensor],
    corrupt_bucket: int | None = None,
    kind: str = "shm",
    device: str = "cpu",
) -> tuple[list[str], object]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receive_in_child, args=(child,))
    proc.start()
    replies: list[str] = []

    def send(payload: bytes) -> None:
        if corrupt_bucket is not None and len(replies) == corrupt_bucket:
            transport.buffer[5] ^= 0x40
            if transport.buffer.is_cuda:
                torch.cuda.synchronize()
        parent.send(payload)
        replies.append(parent.recv())

    transport = RpcBucketTransport(kind, 20_000, device, send)
    try:
        BucketSender(transport, 20_000, buffer=transport.buffer).send(
            (n, t.to(device)) for n, t in weights.items()
        )
        parent.send(None)
        result = parent.recv() if corrupt_bucket is None else None
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        transport.close()
    return replies, result


def test_shared_memory_sync_reaches_another_process_bit_exact():
    weights = stream()
    replies, got = sync_to_child(weights)
    assert len(replies) >= 3 and set(replies) == {"ok"}
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(torch.from_numpy(got[name]), tensor), name


def test_corrupted_shared_memory_bucket_is_detected_by_the_receiver():
    replies, _ = sync_to_child(stream(), corrupt_bucket=1)
    assert replies[0] == "ok"
    assert replies[1].startswith("WeightSyncError: bucket 1: checksum mismatch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_sync_reaches_another_process_bit_exact():
    weights = stream()
    replies, got = sync_to_child(weights, kind="cuda_ipc", device="cuda")
    assert len(replies) >= 3 and set(replies) == {"ok"}
    for name, tensor in weights.items():
        assert torch.equal(torch.from_numpy(got[name]), tensor), name
    replies, _ = sync_to_child(weights, corrupt_bucket=2, kind="cuda_ipc", device="cuda")
    assert replies[2].startswith("WeightSyncError: bucket 2: checksum mismatch")


def test_transport_and_payload_errors_name_the_fix():
    with pytest.raises(ValueError, match="use one of inprocess, shm, cuda_ipc"):
        RpcBucketTransport("nccl", 16, "cpu", print)
    with pytest.raises(ValueError, match="use shm on CPU"):
        RpcBucketTransport("cuda_ipc", 16, "cpu", print)
    with pytest.raises(TypeError, match="pickled bytes"):
        BucketOpener().open("not a payload")


def test_config_is_validated():
    from posttrain.rollout_vllm.config import VLLMRolloutConfig

    for bad, message in (
        ({"executor": "ray"}, "rollout.executor='ray' is unknown"),
        ({"transport": "nccl"}, "rollout.transport='nccl' is unknown"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization=0.0 must be in \(0, 1\]"),
        ({"gpu_memory_gib": -1.0}, "gpu_memory_gib=-1.0 must be >= 0"),
        ({"tensor_model_parallel_size": 0}, "tensor_model_parallel_size=0 must be >= 1"),
        ({"lora_int_id": 0}, "lora_int_id=0 must be >= 1"),
        ({"top_k": 0}, "rollout.top_k=0"),  # the shared fields' checks run too
    ):
        with pytest.raises(ValueError, match=message):
            VLLMRolloutConfig(**bad)


def test_entry_points_resolve_to_the_rollout_and_its_config():
    from posttrain.core.registry import load_target, rollout_config_class
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    assert rollout_config_class("vllm") is VLLMRolloutConfig
    assert load_target(VLLMRolloutConfig.rollout_class) is VLLMRollout


def test_dtype_names():
    from posttrain.rollout_vllm.engine_args import dtype_name

    assert dtype_name("bf16") == dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name("fp32") == "float32"
    with pytest.raises(ValueError, match="int8"):
        dtype_name("int8")


def test_sender_rejects_a_buffer_smaller_than_the_bucket():
    with pytest.raises(ValueError, match="at least 1000 bytes"):
        BucketSender(print, 1000, buffer=torch.empty(10, dtype=torch.uint8))


def test_executor_choices_are_checked_before_vllm_starts(tmp_path):
    from posttrain.core.rollout import RolloutConfig
    from posttrain.rollout_vllm.config import VLLMRolloutConfig
    from posttrain.rollout_vllm.rollout import VLLMRollout

    (tmp_path / "config.json").write_text("{}")
    cases = [
        (VLLMRolloutConfig(executor="external_launcher"), "launch with torchrun"),
        (VLLMRolloutConfig(executor="multiprocess", transport="inprocess"), "use shm"),
        (RolloutConfig(dtype="int4"), "int4"),  # a plain RolloutConfig takes the vLLM defaults
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            VLLMRollout(config, str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="not a local HF model directory"):
        VLLMRollout(RolloutConfig(), str(tmp_path / "missing"), device="cpu")


def test_routed_experts_are_aligned_with_the_tokens():
    from posttrain.rollout_vllm.outputs import align_routing

    fed = torch.arange(2 * 3 * 2, dtype=torch.int64).reshape(3, 2, 2).numpy()  # 3 tokens fed, 2 layers, top-2
    out = align_routing(fed, length=4)
    assert out.dtype == torch.int32 and out.shape == (4, 2, 2)
    assert torch.equal(out[:3], torch.as_tensor(fed, dtype=torch.int32))
    assert (out[3] == -1).all(), "the last sampled token was never fed: its row is -1"
    assert torch.equal(align_routing(fed, length=3)[:2], out[:2]) and (align_routing(fed, 3)[2] == -1).all()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_installed_vllm_can_return_routed_experts():
    from posttrain.rollout_vllm.engine_args import routed_experts_supported

    assert routed_experts_supported()


def test_lora_wrapped_layers_expose_their_base_parameters_only_while_loading():
    from posttrain.rollout_vllm.extension import lora_base_aliases

    class Wrapper(torch.nn.Module):  # the shape of vLLM's ...WithLoRA layers: the real layer is base_layer
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = torch.nn.Linear(3, 2)

    model = torch.nn.Sequential(Wrapper(), torch.nn.Linear(2, 2))
    before = dict(model.named_parameters())
    with lora_base_aliases(model):
        during = dict(model.named_parameters())
        assert (
            during["0.weight"] is model[0].base_layer.weight and during["0.bias"] is model[0].base_layer.bias
        )
        assert "0.base_layer.weight" not in during, (
            "named_parameters lists each Parameter once, under the alias"
        )
    assert dict(model.named_parameters()).keys() == before.keys()


def test_lora_wrapped_fused_layers_lend_their_base_load_weights_while_loading():
    from posttrain.rollout_vllm.extension import lora_base_aliases

    class Fused(torch.nn.Linear):  # vLLM's QKVParallelLinear: load_weights reads the shard id off the tensor
        def load_weights(self, weights):
            for name, tensor in weights:
                rows = {"q": slice(0, 2), "k": slice(2, 3)}[tensor.shard_id]
                getattr(self, name).data[rows] = tensor
                yield name

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_layer = Fused(3, 3, bias=False)

    model = torch.nn.Sequential(Wrapper())
    q, k = torch.ones(2, 3), torch.full((1, 3), 2.0)
    q.shard_id, k.shard_id = "q", "k"
    with lora_base_aliases(model):
        assert "0.weight" not in dict(model.named_parameters()), (
            "a layer with its own loader lends no aliases"
        )
        assert list(model[0].load_weights([("weight", q), ("weight", k)])) == ["weight", "weight"]
    assert torch.equal(model[0].base_layer.weight, torch.cat([q, k]))
    assert not hasattr(model[0], "load_weights")

"""The engine's path for torch 2.11 (the GPU image's torch), taken here by hiding what 2.11 lacks.

torchtitan 0.3.0's FSDP module needs ``torch.distributed.fsdp.DataParallelMeshDims`` (torch >= 2.12); without
it the engine imports torchtitan's model modules bare and shards with torch's ``fully_shard``
(:mod:`posttrain.torchtitan.compat`). Two gloo ranks on that path equal one process on torchtitan's own path,
and the FSDP units it builds are the ones torchtitan's ``apply_fsdp_to_decoder`` builds. A Qwen3-MoE takes the
same step there in one process; in a process group it is refused before the model is built."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_worker import LENGTHS
from titan_testing import make_batch, make_engine, pg_loss, save_tiny_model, tiny_hf_config

from posttrain.core.testing import torchrun
from posttrain.torchtitan.compat import titan_fsdp_importable


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo CPU exactness test")
def test_torch211_path_two_ranks_equal_one_process(tmp_path: Path) -> None:
    save_tiny_model(tmp_path / "model")
    ref = make_engine(str(tmp_path / "model"), max_token_len_per_gpu=16)
    with ref.train_mode():
        norm = ref.train_batch(make_batch(LENGTHS), pg_loss)["metrics"]["grad_norm"]
    want = dict(ref.get_per_tensor_param()[0])
    torchrun(Path(__file__).with_name("torch211_worker.py"), tmp_path, timeout=600)
    got = torch.load(tmp_path / "torch211.pt")
    assert got["bare_package"] and not got["titan_fsdp_imported"]
    assert got["norm"] == pytest.approx(norm, rel=1e-5)
    assert set(got["params"]) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_torch211_path_moe_in_one_process(tmp_path: Path) -> None:
    """A Qwen3-MoE in one process on the 2.11 path (torchtitan's model modules imported bare) takes the same
    step as on torchtitan's own path: the grad norm and every updated weight."""
    from test_moe import MOE

    save_tiny_model(tmp_path / "moe", "qwen3_moe", **MOE)
    ref = make_engine(str(tmp_path / "moe"))
    with ref.train_mode():
        norm = ref.train_batch(make_batch(LENGTHS), pg_loss)["metrics"]["grad_norm"]
    want = dict(ref.get_per_tensor_param()[0])
    worker = Path(__file__).with_name("torch211_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), "moe"], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "torch211_moe.pt")
    assert got["bare_package"] and got["norm"] == pytest.approx(norm, rel=1e-6)
    assert set(got["params"]) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)


def _units(model: torch.nn.Module) -> list[tuple[tuple[str, ...], bool]]:
    """Each FSDP unit as (its modules' names, reshards after forward)."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, tuple[list[str], bool]] = {}
    for name, sub in model.named_modules():
        if isinstance(sub, FSDPModule):
            group = sub._get_fsdp_state()._fsdp_param_group
            reshard = group is not None and group.post_forward_mesh_info is not None
            groups.setdefault(id(sub._get_fsdp_state()), ([], reshard))[0].append(name)
    return sorted((tuple(names), reshard) for names, reshard in groups.values())


@pytest.mark.skipif(
    not titan_fsdp_importable(), reason="torchtitan's apply_fsdp_to_decoder needs torch >= 2.12 to import"
)
@pytest.mark.parametrize(("tie", "policy"), [(True, "default"), (False, "default"), (False, "always")])
def test_fsdp_units_equal_torchtitans(tie: bool, policy: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from posttrain.torchtitan import modeling
    from posttrain.torchtitan.attention import PackedSDPA
    from posttrain.torchtitan.compat import fully_shard_decoder

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        units = []
        for shard in (apply_fsdp_to_decoder, fully_shard_decoder):
            model = modeling.build_model(tiny_hf_config(tie=tie), PackedSDPA.Config())
            shard(
                model,
                mesh,
                param_dtype=torch.float32,
                reduce_dtype=torch.float32,
                pp_enabled=False,
                reshard_after_forward_policy=policy,
            )
            units.append(_units(model))
        assert units[0] == units[1]
        assert len(units[0]) == (4 if tie else 5)  # root, tied ends, 2 blocks (+ the embeddings alone)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen attention runs on CUDA only")
def test_torch_varlen_attention_equals_packed_sdpa() -> None:
    from posttrain.torchtitan.attention import PackedSDPA, packed_metadata
    from posttrain.torchtitan.compat import TorchVarlenAttention

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 20, 4, 32, device=dev, generator=gen).bfloat16()
    k, v = (torch.randn(1, 20, 2, 32, device=dev, generator=gen).bfloat16() for _ in range(2))
    meta = packed_metadata([0, 5, 17, 20], dev)
    got = TorchVarlenAttention(TorchVarlenAttention.Config())(q, k, v, attention_masks=meta, enable_gqa=True)
    want = PackedSDPA(PackedSDPA.Config())(
        q.float(), k.float(), v.float(), attention_masks=meta, enable_gqa=True
    )
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_moe_under_torch_distributed_refused_before_build(tmp_path: Path, monkeypatch) -> None:
    """On a torch without ``DataParallelMeshDims`` (2.11) a MoE model in a process group is refused by name
    before the model is built (torch's ``fully_shard`` path has dense decoders' units only)."""
    import torch.distributed.fsdp as fsdp
    from test_moe import MOE

    from posttrain.core.config import CheckpointConfig, ModelConfig, OptimizerConfig
    from posttrain.torchtitan.config import TorchTitanEngineConfig
    from posttrain.torchtitan.engine import TorchTitanLanguageModelEngine

    path = save_tiny_model(tmp_path / "moe", "qwen3_moe", **MOE)
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)
    eng = TorchTitanLanguageModelEngine(
        ModelConfig(path=path), TorchTitanEngineConfig(dtype="fp32"), OptimizerConfig(), CheckpointConfig()
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(
            ValueError, match=r"lacks .*DataParallelMeshDims.*train the MoE model in one process"
        ):
            eng.initialize()
        assert eng.module is None and eng.parallel_dims is None
    finally:
        dist.destroy_process_group()

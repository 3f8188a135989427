"""The megatron engine against the FSDP engine on one CPU process, fp32: first-step parity and cross-backend
resume.

Both engines start from the same tiny Qwen2 directory, see the same packed batches and use the same AdamW
config (weight decay 0: Megatron exempts biases and norms from weight decay, torch's AdamW does not). The FSDP
engine runs FSDP2 over the one-rank gloo group of the Megatron fixture. Resume goes through the FSDP engine's
checkpoint layout (HF names, flattened AdamW state): FSDP -> Megatron with its default config, Megatron ->
FSDP with ``engine.portable_checkpoint=true``. Each resumed step must equal the original engine continuing;
FSDP -> Megatron -> FSDP without a step in between must give the same tensors bit for bit (fp32 and bf16
Megatron). Two gloo ranks (``cross_backend_worker.py``) do the same at TP=2, PP=2 and DP=2 with the
distributed optimizer, the last also with an async portable save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cross_backend_worker import ASYNC_ROUND_TRIP, LAYOUTS, ROUND_TRIP, batch, optim

from posttrain.core.testing import torchrun

pytestmark = pytest.mark.slow


def _fsdp(path: str, ckpt=None):
    from posttrain.core.config import CheckpointConfig, ModelConfig
    from posttrain.fsdp.config import FSDPEngineConfig
    from posttrain.fsdp.engine import FSDPLanguageModelEngine

    eng = FSDPLanguageModelEngine(
        ModelConfig(path=path),
        FSDPEngineConfig(strategy="fsdp2", dtype="fp32", use_dynamic_bsz=False, micro_batch_size_per_gpu=2),
        optim(),
        ckpt or CheckpointConfig(),
    )
    eng.initialize()
    return eng


def _megatron(path: str, ckpt=None, **engine_kw):
    from megatron_cpu import make_engine

    return make_engine(path, optim=optim(), ckpt=ckpt, **engine_kw)


def _step(eng, seed: int) -> dict:
    from megatron_cpu import nll_loss

    with eng.train_mode():
        out = eng.train_batch(batch(seed), nll_loss)
        eng.lr_scheduler_step()
    return {
        "loss": sum(out["loss"]),
        "grad_norm": out["metrics"]["grad_norm"],
        "log_probs": out["model_output"]["log_probs"].detach().cpu(),
    }


def _params(eng) -> dict[str, torch.Tensor]:
    kw = {"dtype": torch.float32} if hasattr(eng, "layout") else {}
    return {k: v.detach().float().cpu().clone() for k, v in eng.get_per_tensor_param(**kw)[0]}


def _assert_same_step(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)


def _assert_same_params(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        # Adam's step is ~lr * sign(m / sqrt(v)): entries with a near-zero moment may move differently by
        # fp32 noise, so the bound is 1% of lr (a lost moment or LR step is off by ~lr)
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=0, msg=name)


def test_first_step_equals_fsdp_engine(megatron_env, tiny_qwen2):
    fsdp, mcore = _fsdp(tiny_qwen2), _megatron(tiny_qwen2)
    assert _params(mcore).keys() == _params(fsdp).keys()
    want, got = _step(fsdp, 0), _step(mcore, 0)
    _assert_same_step(got, want)
    assert want["grad_norm"] > 1.0  # the clip was active
    _assert_same_params(_params(mcore), _params(fsdp))


def test_fsdp_checkpoint_resumes_on_megatron(megatron_env, tiny_qwen2, tmp_path):
    role = tmp_path / "global_step_2" / "actor"
    fsdp = _fsdp(tiny_qwen2)
    for seed in (0, 1):
        _step(fsdp, seed)
    fsdp.save_checkpoint(str(role), global_step=2)
    want = _step(fsdp, 2)

    mcore = _megatron(tiny_qwen2)
    mcore.load_checkpoint(str(role))
    assert mcore._lr_step == 2
    _assert_same_step(_step(mcore, 2), want)
    _assert_same_params(_params(mcore), _params(fsdp))

    native = tmp_path / "native" / "actor"
    mcore.save_checkpoint(str(native), global_step=3)
    with pytest.raises(ValueError, match="engine.portable_checkpoint=true"):
        fsdp.load_checkpoint(str(native))


def test_portable_megatron_checkpoint_resumes_on_fsdp_and_megatron(megatron_env, tiny_qwen2, tmp_path):
    from safetensors.torch import load_file

    from posttrain.ckpt import read_role_manifest
    from posttrain.ckpt.cli import main as ckpt_cli
    from posttrain.core.config import CheckpointConfig

    role = tmp_path / "global_step_2" / "actor"
    contents = CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"])
    mcore = _megatron(tiny_qwen2, ckpt=contents, portable_checkpoint=True)
    for seed in (0, 1):
        _step(mcore, seed)
    mcore.save_checkpoint(str(role), global_step=2)
    at_save = _params(mcore)
    want = _step(mcore, 2)
    want_params = _params(mcore)
    manifest = read_role_manifest(role)
    assert manifest["backend"] == "megatron" and manifest["layout"] == "dcp-hf-names"

    fsdp = _fsdp(tiny_qwen2)
    fsdp.load_checkpoint(str(role))
    assert fsdp.lr_scheduler.last_epoch == 2
    _assert_same_step(_step(fsdp, 2), want)
    _assert_same_params(_params(fsdp), want_params)

    again = _megatron(tiny_qwen2)
    assert again.load_checkpoint(str(role)) == {"global_step": 2, "skipped_steps": 0}
    _assert_same_step(_step(again, 2), want)
    _assert_same_params(_params(again), want_params, atol=1e-7)

    assert ckpt_cli(["export-hf", str(role), str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(at_save)
    assert all(torch.equal(exported[k], v) for k, v in at_save.items())
    saved_hf = load_file(str(role / "huggingface" / "model.safetensors"))
    assert all(torch.equal(saved_hf[k], v) for k, v in at_save.items())


def _two_rank_resume(hf_path: str, tmp_path: Path) -> None:
    """FSDP trains 2 steps and saves; the worker resumes step 3 in each 2-rank layout and saves portable; FSDP
    resumes step 4 from each of those. Everything must equal FSDP continuing."""
    role, out = tmp_path / "fsdp" / "actor", tmp_path / "out"
    fsdp = _fsdp(hf_path)
    for seed in (0, 1):
        _step(fsdp, seed)
    fsdp.save_checkpoint(str(role), global_step=2)
    want3 = _step(fsdp, 2)
    want3_params = _params(fsdp)
    want4 = _step(fsdp, 3)
    want4_params = _params(fsdp)

    torchrun(Path(__file__).with_name("cross_backend_worker.py"), hf_path, role, out)
    for name in LAYOUTS:
        got = torch.load(out / f"{name}.pt")
        assert got["lr_step"] == 3, name
        assert got["loss"] == pytest.approx(want3["loss"], rel=1e-5), name
        assert got["grad_norm"] == pytest.approx(want3["grad_norm"], rel=1e-5), name
        _assert_same_params(got["params"], want3_params)
        back = _fsdp(hf_path)  # the portable checkpoint that layout wrote after step 3
        back.load_checkpoint(str(out / name / "actor"))
        _assert_same_step(_step(back, 3), want4)
        _assert_same_params(_params(back), want4_params)
    want = _dcp_tensors(role)
    for name in [*ROUND_TRIP, *ASYNC_ROUND_TRIP]:  # fp32 main weights and Adam state survive bf16 unchanged
        got = _dcp_tensors(out / name / "actor")
        assert sorted(got) == sorted(want), name
        assert all(torch.equal(got[k], v) for k, v in want.items()), name


@pytest.mark.dist
def test_fsdp_checkpoint_resumes_at_tp2_pp2_dp2_and_back(megatron_env, tiny_qwen2, tmp_path):
    _two_rank_resume(tiny_qwen2, tmp_path)


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_checkpoint_resumes_at_tp2_pp2_dp2_and_back_on_gpus(tiny_qwen2, tmp_path):
    """The same on 2 GPUs (NCCL); the FSDP engine runs its plain module on cuda:0 (no process group)."""
    _two_rank_resume(tiny_qwen2, tmp_path)


def _dcp_tensors(role: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from posttrain.ckpt.hf import dcp_tensor_metadata

    metadata = dcp_tensor_metadata(role / "dist_ckpt")
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(role / "dist_ckpt")), no_dist=True)
    return out


@pytest.mark.parametrize(("dtype", "tied"), [("float32", False), ("bfloat16", False), ("float32", True)])
def test_fsdp_checkpoint_through_megatron_is_bit_exact(megatron_env, tiny_qwen2, tmp_path, dtype, tied):
    """FSDP save -> megatron load -> portable save writes the same fp32 master weights and Adam state, also
    when the megatron model runs in bf16 (the optimizer keeps fp32 main parameters) and with tied
    embeddings."""
    from megatron_cpu import make_engine, make_tiny_qwen2

    if tied:
        tiny_qwen2 = make_tiny_qwen2(str(tmp_path / "tied"), tie_word_embeddings=True)
    fsdp = _fsdp(tiny_qwen2)
    for seed in (0, 1):
        _step(fsdp, seed)
    fsdp.save_checkpoint(str(tmp_path / "fsdp" / "actor"), global_step=2)
    mcore = make_engine(tiny_qwen2, optim=optim(), portable_checkpoint=True, dtype=dtype)
    mcore.load_checkpoint(str(tmp_path / "fsdp" / "actor"))
    mcore.save_checkpoint(str(tmp_path / "mcore" / "actor"), global_step=2)
    want, got = _dcp_tensors(tmp_path / "fsdp" / "actor"), _dcp_tensors(tmp_path / "mcore" / "actor")
    assert sorted(got) == sorted(want)
    assert any(k.endswith(".exp_avg_sq") for k in want)
    assert ("model.lm_head.weight" in want) is not tied
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

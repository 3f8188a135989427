"""``engine.vanilla_mbridge=true``: the deprecated standalone ``mbridge`` (0.15.1, the test dependency group)
builds a tiny Qwen2 on the CPU (local layers: no Transformer Engine) and equals the HF model, at TP=1 in this
process and at TP=2 with sequence parallelism on 2 gloo ranks (this file is also that torchrun worker:
``torchrun --nproc-per-node 2 test_vanilla_mbridge.py HF_DIR OUT_DIR``).

One engine per layout: its log-probs before training against the HF forward, its exported weights against the
HF state dict, then one training step against the plain HF + AdamW reference step.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

from posttrain.core.testing import torchrun


def compare_with_hf(eng, hf_path: str) -> dict | None:
    """Differences to the HF model (on the rank that holds the outputs; None elsewhere). Every rank calls
    it."""
    from megatron_cpu import hf_log_probs, nll_loss, reference_step, sample_batch
    from transformers import AutoModelForCausalLM

    batch = sample_batch()
    with eng.eval_mode():
        log_probs = eng.infer_batch(batch).get("model_output", {}).get("log_probs")
    exported = {k: v.cpu().clone() for k, v in eng.get_per_tensor_param()[0]}  # views of the parameters
    with eng.train_mode():
        out = eng.train_batch(batch, nll_loss)
    trained = {k: v.cpu() for k, v in eng.get_per_tensor_param()[0]}
    if not eng.is_mp_src_rank_with_outputs():
        return None
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    with torch.no_grad():
        ref_lp = hf_log_probs(hf, batch)
    ref_loss, ref_norm, ref_params = reference_step(hf_path, batch, lr=1e-3, clip=1.0)
    return {
        "logprob_maxdiff": float((log_probs.cpu().double() - ref_lp).abs().max()),
        "export_names_equal": sorted(exported) == sorted(hf.state_dict()),
        "export_maxdiff": max(float((exported[k] - v).abs().max()) for k, v in hf.state_dict().items()),
        "loss_diff": abs(sum(out["loss"]) - ref_loss),
        "grad_norm_rel": abs(out["metrics"]["grad_norm"] - ref_norm) / ref_norm,
        "param_maxdiff": max(float((trained[k] - v).abs().max()) for k, v in ref_params.items()),
    }


def check(results: dict) -> None:
    assert results["logprob_maxdiff"] < 1e-5
    assert results["export_names_equal"] and results["export_maxdiff"] == 0.0
    assert results["loss_diff"] < 1e-5
    assert results["grad_norm_rel"] < 1e-4
    assert results["param_maxdiff"] < 1e-5  # 1% of one Adam step at lr=1e-3


@pytest.fixture(scope="module")
def tp1(megatron_env, tiny_qwen2):
    """(differences to HF of a TP=1 vanilla engine, the warnings its build raised)."""
    from megatron_cpu import make_engine

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = make_engine(tiny_qwen2, vanilla_mbridge=True)
    return compare_with_hf(eng, tiny_qwen2), caught


@pytest.mark.slow
def test_build_warns_deprecated(tp1):
    from posttrain.megatron.vanilla import DEPRECATION

    assert any(w.category is DeprecationWarning and str(w.message) == DEPRECATION for w in tp1[1])


@pytest.mark.slow
def test_tp1_log_probs_export_and_one_step_equal_hf(tp1):
    check(tp1[0])


@pytest.mark.slow
@pytest.mark.dist
def test_tp2_sequence_parallel_equals_hf(tiny_qwen2, tmp_path):
    torchrun(__file__, tiny_qwen2, tmp_path)
    check(json.loads((tmp_path / "results.json").read_text()))


def test_missing_mbridge_names_the_install(monkeypatch):
    from posttrain.megatron import vanilla
    from posttrain.megatron.config import McoreEngineConfig

    monkeypatch.setitem(sys.modules, "mbridge", None)  # what `import mbridge` sees when it is not installed
    with pytest.warns(FutureWarning):
        cfg = McoreEngineConfig(vanilla_mbridge=True)
    with pytest.warns(DeprecationWarning), pytest.raises(ImportError, match="pip install"):
        vanilla.check(cfg)


def test_scaled_rope_is_refused():
    from transformers import Qwen2Config

    from posttrain.megatron import vanilla

    config = Qwen2Config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type='default'"):
        vanilla._copy_rope_theta(config)
    config = Qwen2Config()
    vanilla._copy_rope_theta(config)
    assert config.rope_theta == config.rope_parameters["rope_theta"]


def main(hf_path: str, out_dir: str) -> None:
    """The TP=2 torchrun worker: writes ``OUT_DIR/results.json`` from the rank that holds the outputs."""
    from megatron_cpu import make_engine, prepare_environment

    prepare_environment()
    torch.distributed.init_process_group("gloo")
    eng = make_engine(hf_path, vanilla_mbridge=True, tensor_model_parallel_size=2, sequence_parallel=True)
    results = compare_with_hf(eng, hf_path)
    if results is not None:
        Path(out_dir, "results.json").write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""The config tree loads without torch (``posttrain config show`` stays fast), the registries' built-in names
are the names their torch modules register, and a custom estimator registered before the config is built is
accepted by it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from posttrain.trainers.algorithms import names


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_config_and_default_tree_load_without_torch():
    out = _run(
        """
        import sys
        import posttrain.trainers.config as config
        import posttrain.trainers.cli
        config.load_config()
        config.load_config(root=config.SFTConfig)
        print(sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules))
        """
    )
    assert out == "[]"


@pytest.mark.parametrize(
    "registry", [names.ADV_ESTIMATORS, names.POLICY_LOSSES, names.KL_ESTIMATORS, names.CORRECTIONS]
)
def test_builtin_names_are_what_the_torch_module_registers(registry):
    import importlib

    importlib.import_module(registry.module)
    assert sorted(registry.fns) == sorted(registry.builtin) == registry.names()


def test_custom_estimator_registered_before_the_config_is_accepted():
    out = _run(
        """
        from posttrain.trainers.config import load_config
        try:
            load_config(["algorithm.adv_estimator=mine"])
        except ValueError as exc:
            print(exc)
        from posttrain.trainers.algorithms import get_adv_estimator, register_adv_estimator

        @register_adv_estimator("mine")
        def mine(inputs, cfg):
            raise NotImplementedError

        cfg = load_config(["algorithm.adv_estimator=mine"])
        print(
            cfg.algorithm.adv_estimator, get_adv_estimator("grpo").__name__, get_adv_estimator("mine") is mine
        )
        """
    )
    refused, accepted = out.splitlines()
    assert "adv_estimator='mine'" in refused and "'grpo'" in refused and "'reinforce_plus_plus'" in refused
    assert accepted == "mine grpo True"

"""engine-core must stay light: no megatron, vLLM or Transformer Engine behind its imports."""

import subprocess
import sys

HEAVY = ("megatron", "vllm", "transformer_engine")


def test_importing_core_loads_no_backend():
    code = (
        "import sys, importlib, pkgutil, posttrain.core as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'posttrain.core.'): importlib.import_module(m.name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"posttrain.core pulled in {out}"


def test_no_namespace_init_shipped():
    import posttrain

    for path in posttrain.__path__:
        assert not (__import__("pathlib").Path(path) / "__init__.py").exists(), f"{path} has __init__.py"

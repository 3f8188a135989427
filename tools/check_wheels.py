"""Import every module of the installed posttrain wheels and check the namespace layout.

Run by the nox ``build`` session inside a venv where only the built wheels (and their dependencies) are
installed. Fails when a wheel ships ``posttrain/__init__.py``, when a sibling pin is not exact, or when a module
does not import. Modules whose import needs Transformer Engine (Megatron-Bridge imports it unconditionally) must
fail with an ImportError that names it, which counts as a pass on a machine without it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import zipfile
from pathlib import Path


def check_wheel(path: Path) -> list[str]:
    errors = []
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        if "posttrain/__init__.py" in names:
            errors.append(f"{path.name} ships posttrain/__init__.py (breaks the PEP 420 namespace)")
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        for line in zf.read(meta).decode().splitlines():
            m = re.match(r"Requires-Dist: (posttrain[-\w]*)\s*(.*)", line)
            if m and "==" not in m.group(2):
                errors.append(f"{path.name}: sibling requirement {line!r} is not pinned with ==")
    return errors


def import_all() -> list[str]:
    import posttrain

    errors = []
    for info in pkgutil.walk_packages(posttrain.__path__, "posttrain."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            if "transformer_engine" in str(exc):
                print(f"  {info.name}: needs Transformer Engine ({exc})")
                continue
            errors.append(f"import {info.name}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - report every failure, not just the first
            errors.append(f"import {info.name}: {type(exc).__name__}: {exc}")
        else:
            print(f"  {info.name}: ok")
    return errors


def main(wheels: list[str]) -> int:
    errors = [e for w in wheels for e in check_wheel(Path(w))]
    errors += import_all()
    for e in errors:
        print("ERROR", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Load a user reward function from ``module:function`` or ``path/to/file.py:function``.

The function is called like verl's custom reward functions,
``fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)``, and returns a number or a dict
with a ``score`` key (its other keys are kept as extra per-sample values).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _import(module: str) -> Any:
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise ValueError(f"reward function file {module!r} does not exist")
        spec = importlib.util.spec_from_file_location(f"posttrain_custom_reward_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            raise ValueError(
                f"reward function module {module!r} cannot be imported ({exc}): check the name, "
                "install it, or give a file path like my_rewards.py:score"
            ) from exc
        raise


def load_reward_fn(target: str) -> Callable[..., Any]:
    """The callable named by ``module:function`` (or ``file.py:function``)."""
    module, sep, name = target.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(
            f"reward function {target!r} must look like package.module:function or path/to/file.py:function"
        )
    mod = _import(module)
    fn = getattr(mod, name, None)
    if fn is None:
        public = sorted(n for n in vars(mod) if not n.startswith("_") and callable(getattr(mod, n)))
        raise ValueError(f"reward function {name!r} is not defined in {module!r} (it defines {public})")
    if not callable(fn):
        raise ValueError(f"{target!r} is a {type(fn).__name__}, not a function")
    return fn

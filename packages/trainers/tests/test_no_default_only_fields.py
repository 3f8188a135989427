"""No config field accepts only its default: for every leaf field of the SFT and RL trees and of every
installed engine and rollout config class, some value other than the default (of the field's type; for
strings, the words of the field's docstring) builds the config. A field that refuses them all is a knob that
does nothing; a key a user may still bring belongs in the migration table
(posttrain.core.config.migrations)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import types
import typing
import warnings
from functools import cache
from importlib.metadata import entry_points

from posttrain.trainers.config import PostTrainConfig, SFTConfig


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, for ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(inspect.getsource(sys.modules[klass.__module__]))
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr):
                if isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                    docs[stmt.target.id] = after.value.value
    return docs


def default_of(spec: dataclasses.Field) -> typing.Any:
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def candidates(cls: type, spec: dataclasses.Field, hint: typing.Any) -> list[typing.Any]:
    """Values of the field's type other than its default."""
    default = default_of(spec)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = typing.get_origin(hint) or hint
    if base in (typing.Union, types.UnionType):
        base = typing.get_origin(args[0]) or args[0]
    words = re.findall(r"[A-Za-z0-9_.:\-]+", field_docs(cls).get(spec.name, ""))
    if base is typing.Any:
        base = type(default) if default is not None else str
    pools = {
        bool: [True, False],
        int: [1, 2, 4, 8, 16, 0, -1, 1024],
        float: [0.5, 0.1, 1.0, 2.0, 4.0, 0.0, 1e-3],
        str: [*words, "x", "float32"],
        list: [
            [],
            ["x"],
            ["cpu"],
            *(
                [[v / 2 for v in default]]
                if isinstance(default, list) and default and isinstance(default[0], float)
                else []
            ),
        ],
        dict: [{}, {"x": 1}],
        tuple: [tuple(v * 0.5 for v in default)] if isinstance(default, tuple) else [],
    }
    return [v for v in pools.get(base, []) if v != default]


def classes_in(root: type) -> set[type]:
    """``root`` and every dataclass its default tree holds."""
    found, todo = set(), [root()]
    while todo:
        obj = todo.pop()
        found.add(type(obj))
        todo += [v for v in vars(obj).values() if dataclasses.is_dataclass(v)]
    return found


def installed_config_classes() -> set[type]:
    classes = set()
    for group in ("posttrain.engines", "posttrain.rollouts"):
        for ep in entry_points(group=group):
            classes |= classes_in(ep.load())
    return classes


COMPANIONS = {
    "rollout_placement": {"mode": "one_step_off"},
    "rollout_devices": {"mode": "one_step_off", "rollout_placement": "process"},
    "stream_episodes": {"mode": "stream"},
    "stale_policy": {"mode": "async"},
    "cap": {"mode": "tis"},
    "cap_low": {"mode": "mis"},
}
"""Fields that take effect only beside another field's value: the check sets that value too."""
SELECTORS = {"strategy"}
"""An engine config's ``strategy`` is the name its class is registered under: another value is another
class."""


def default_only_fields(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    bad = []
    for spec in dataclasses.fields(cls):
        if not spec.init or spec.name in SELECTORS or dataclasses.is_dataclass(default_of(spec)):
            continue
        accepted = False
        for value in candidates(cls, spec, hints[spec.name]):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cls(**{**COMPANIONS.get(spec.name, {}), spec.name: value})
            except (ValueError, TypeError):
                continue
            accepted = True
            break
        if not accepted:
            bad.append(f"{cls.__module__}.{cls.__name__}.{spec.name}")
    return bad


def test_every_field_accepts_a_value_other_than_its_default():
    classes = classes_in(SFTConfig) | classes_in(PostTrainConfig) | installed_config_classes()
    classes -= {SFTConfig, PostTrainConfig}  # the roots' own fields are model_engine and nested configs
    bad = sorted(name for cls in classes for name in default_only_fields(cls))
    assert not bad, f"fields that accept only their default: {bad}"
    assert default_only_fields(PostTrainConfig) == []  # model_engine: fsdp is accepted


def test_the_check_finds_a_default_only_field():
    @dataclasses.dataclass(kw_only=True)
    class Knob:
        kernels: bool = False
        """Only false is accepted."""

        def __post_init__(self) -> None:
            if self.kernels:
                raise ValueError("only false")

    sys.modules[__name__].Knob = Knob  # inspect finds the class in this module's source
    assert default_only_fields(Knob) == [f"{__name__}.Knob.kernels"]

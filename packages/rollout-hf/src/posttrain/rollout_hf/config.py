"""The HF rollout's config: the fields every rollout shares plus the decode loop's own knobs.

Registered as ``hf`` in the ``posttrain.rollouts`` entry-point group (it
builds :class:`~posttrain.rollout_hf.rollout.HFRollout`), so with ``rollout.name=hf`` (the default) every
field here is a ``rollout.<field>`` key (``rollout.compile=true``). Importing this module imports no
transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.core.rollout import RolloutConfig

CACHES = ("static", "dynamic")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(kw_only=True)
class HFRolloutConfig(RolloutConfig):
    """:class:`~posttrain.core.rollout.RolloutConfig` and what only the HF rollout reads
    (:mod:`posttrain.rollout_hf.decode`)."""

    rollout_class: ClassVar[str] = "posttrain.rollout_hf.rollout:HFRollout"

    name: str = "hf"
    """The rollout backend (``hf``)."""
    cache: str = "static"
    """KV cache: ``static`` (preallocated for the prompt width plus ``max_new_tokens``) or ``dynamic``
    (transformers' ``DynamicCache``, for models whose layers a static cache does not cover)."""
    compile: bool = False
    """``torch.compile`` the one-token decode forward (needs ``cache=static``; not with
    ``return_routed_experts``, whose router hooks must run eagerly). The first call compiles; later calls of
    the same shape reuse it."""
    compile_mode: str = "reduce-overhead"
    """``torch.compile`` mode of the decode forward (``reduce-overhead`` captures CUDA graphs)."""
    stop_check_interval: int = 8
    """Decode steps between the checks whether every row has finished (each check is one host sync)."""

    @property
    def serves_requests(self) -> bool:
        """Always: ``HFRollout.agenerate`` queues single requests on its request thread."""
        return True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache not in CACHES:
            raise ValueError(f"rollout.cache={self.cache!r} is unknown: use one of {', '.join(CACHES)}")
        if self.compile and self.cache != "static":
            raise ValueError("rollout.compile=true needs rollout.cache=static (a fixed-shape KV cache)")
        if self.compile and self.return_routed_experts:
            raise ValueError(
                "rollout.compile=true with rollout.return_routed_experts=true: the router hooks must run "
                "eagerly; set one of them to false"
            )
        if self.stop_check_interval < 1:
            raise ValueError(f"rollout.stop_check_interval={self.stop_check_interval} must be >= 1")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"rollout.load_format={self.load_format!r}: the hf rollout loads {' or '.join(LOAD_FORMATS)} "
                "(other formats are vLLM's: rollout.name=vllm)"
            )

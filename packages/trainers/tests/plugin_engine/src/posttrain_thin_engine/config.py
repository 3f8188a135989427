"""``ThinEngineConfig``: the FSDP engine's knobs plus ``record_to``; registered as ``thin`` in
``posttrain.engines``.

Imports only the FSDP config (no torch model code), as a config module must.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.fsdp.config import FSDPEngineConfig


@dataclass(kw_only=True)
class ThinEngineConfig(FSDPEngineConfig):
    """The thin engine: single-process FSDP engines that record each step they train."""

    engines: ClassVar[dict[str, str]] = {
        "language_model": "posttrain_thin_engine.engine:ThinLanguageModelEngine",
        "value_model": "posttrain_thin_engine.engine:ThinValueModelEngine",
    }
    variant: ClassVar[str] = "thin"

    strategy: str | None = "thin"
    """``thin``."""
    record_to: str = ""
    """A file each engine appends ``<engine class> <model type> step`` to after each optimizer step
    ('' = none)."""

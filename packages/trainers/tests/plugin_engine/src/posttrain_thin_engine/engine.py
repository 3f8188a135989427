"""The thin engines: posttrain's FSDP engines that append a line per optimizer step to ``record_to``."""

from __future__ import annotations

from posttrain.fsdp.engine import FSDPLanguageModelEngine, FSDPValueModelEngine


class _Recording:
    def optimizer_step(self):  # type: ignore[no-untyped-def]
        out = super().optimizer_step()  # type: ignore[misc]
        path = self.engine_config.record_to  # type: ignore[attr-defined]
        if path:
            kind = "value_model" if self.value_model else "language_model"  # type: ignore[attr-defined]
            with open(path, "a") as f:
                f.write(f"{type(self).__name__} {kind} step\n")
        return out


class ThinLanguageModelEngine(_Recording, FSDPLanguageModelEngine):
    """The causal LM engine."""


class ThinValueModelEngine(_Recording, FSDPValueModelEngine):
    """The value engine."""

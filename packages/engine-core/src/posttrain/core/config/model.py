"""The model a role trains: where its Hugging Face files are and how to adapt it (LoRA, checkpointing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class ModelConfig:
    """A Hugging Face model directory (config.json + safetensors) and its training options."""

    path: str = ""
    """Local directory of the HF model (no hub downloads)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None = ``path``."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the model."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Fields set on the HF config before the model is built."""
    enable_gradient_checkpointing: bool = True
    """Recompute decoder-layer activations in backward."""
    lora_rank: int = 0
    """LoRA rank; 0 trains all parameters."""
    lora_alpha: int = 16
    """LoRA scaling numerator."""
    target_modules: Any = "all-linear"
    """LoRA target modules: a list of names or ``all-linear``."""
    exclude_modules: Any = None
    """Modules excluded from LoRA."""
    lora_adapter_path: str | None = None
    """Start from an existing peft adapter directory."""

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"model.lora_rank={self.lora_rank} must be >= 0 (0 disables LoRA)")

    @property
    def tokenizer_dir(self) -> str:
        """Directory to load the tokenizer from."""
        return self.tokenizer_path or self.path

"""The model a role trains: where its Hugging Face files are and how to adapt it (LoRA, checkpointing).

:meth:`ModelConfig.require_weights` is the check the trainers run before building any engine: an HF directory
with a ``config.json`` but no weight file would otherwise become a randomly initialised model without a word
(``from_config``), which is what a checkpoint's ``huggingface/`` folder holds unless ``hf_model`` was saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .loader import ConfigError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The files ``from_pretrained`` loads weights from (one of them must exist)."""


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
    enable_gradient_checkpointing: bool | None = True
    """Recompute decoder-layer activations in backward (the megatron engine: full recompute of each layer;
    torchtitan: ``engine.activation_checkpointing`` full unless set). null: the engine chooses from the
    model's size, its micro-batch token budget and the free device memory
    (:func:`posttrain.core.memory_policy.resolve_gradient_checkpointing`) and logs the choice."""
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

    def require_weights(self, key: str = "model.path") -> None:
        """Raise a ConfigError (a ValueError) naming the fix unless ``path`` is a directory holding HF
        weights; ``key`` names the config key in the message."""
        if not self.path:
            raise ConfigError(
                f"{key} is empty: set {key}=<local HF model dir> (make a tiny one with "
                "`posttrain model init --size tiny --out DIR`)"
            )
        path = Path(self.path)
        if not path.is_dir():
            raise ConfigError(
                f"{key}={self.path!r} is not a directory: give a local Hugging Face model directory"
            )
        if any((path / name).is_file() for name in WEIGHT_FILES):
            return
        role_dir = path.parent if path.name == "huggingface" else Path("<global_step_N>/actor")
        raise ConfigError(
            f"{key}={self.path!r} holds no weights (none of {', '.join(WEIGHT_FILES)}), so training would "
            "start from a random model. A checkpoint's huggingface/ folder holds weights only when the run "
            "saved with hf_model in checkpoint.save_contents (e.g. checkpoint.save_contents="
            f"[model,optimizer,extra,hf_model]); for a checkpoint saved without it, run `posttrain ckpt "
            f"export-hf {role_dir} <out dir>` and set {key}=<out dir>. For a random model on purpose, write "
            "one with `posttrain model init --out DIR`."
        )

    @property
    def tokenizer_dir(self) -> str:
        """Directory to load the tokenizer from."""
        return self.tokenizer_path or self.path

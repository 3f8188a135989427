"""Dataset config: which parquet files, which columns, how long and how to batch."""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.config.loader import ConfigError


@dataclass(kw_only=True)
class DataConfig:
    """Parquet datasets for SFT (a chat column) and RL (verl's prompt columns)."""

    train_files: list[str] = field(default_factory=list)
    """Training parquet files."""
    val_files: list[str] = field(default_factory=list)
    """Validation parquet files."""
    messages_key: str = "messages"
    """SFT: column holding the chat (a list of {role, content})."""
    prompt_key: str = "prompt"
    """RL: column holding the prompt chat."""
    reward_fn_key: str = "data_source"
    """RL: column that selects the reward function."""
    max_length: int = 1024
    """SFT: longest tokenised conversation."""
    truncation: str = "error"
    """What to do with a longer one: error (names the row), left or right."""
    max_prompt_length: int | None = None
    """RL: longest prompt in tokens (longer prompts are filtered out); None = ``rollout.prompt_length``, the
    one key to set (a different value here is rejected, see :meth:`prompt_length`)."""
    train_batch_size: int = 8
    """Sequences (SFT) or prompts (RL) per optimizer step, over all data-parallel ranks."""
    val_batch_size: int | None = None
    """Batch size for validation (None: the whole validation set at once for RL, train_batch_size for SFT)."""
    shuffle: bool = True
    """Shuffle the training set each epoch."""
    seed: int = 1
    """Seed of the shuffle."""

    def __post_init__(self) -> None:
        if self.truncation not in ("error", "left", "right"):
            raise ValueError(f"data.truncation={self.truncation!r}: use error, left or right")
        if self.train_batch_size < 1:
            raise ValueError(f"data.train_batch_size={self.train_batch_size} must be >= 1")
        if self.max_length < 2:
            raise ValueError(f"data.max_length={self.max_length} must be >= 2")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length} must be >= 1 or null")

    def prompt_length(self, rollout_prompt_length: int) -> int:
        """RL: the prompt length filter, which is the rollout's ``prompt_length`` (the rollout sizes its
        context for it); a ConfigError when ``max_prompt_length`` is set to something else."""
        if self.max_prompt_length is None or self.max_prompt_length == rollout_prompt_length:
            return rollout_prompt_length
        raise ConfigError(
            f"data.max_prompt_length={self.max_prompt_length} differs from rollout.prompt_length="
            f"{rollout_prompt_length}: both set the prompt length; set rollout.prompt_length="
            f"{self.max_prompt_length} and leave data.max_prompt_length unset (it follows the rollout)"
        )

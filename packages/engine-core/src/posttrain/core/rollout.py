"""The rollout contract: generate responses, take new weights, sleep and wake.

A rollout receives weights as a stream of (HF name, full tensor) pairs. Backends move them with the bucketed
protocol of :mod:`posttrain.core.weight_sync`, so every sync is checksummed whatever the transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

if TYPE_CHECKING:
    import torch

    from .config.model import ModelConfig


@dataclass(kw_only=True)
class SamplingKnobs:
    """The sampling knobs a rollout config and one generate call share (declared once, here)."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = all."""
    n: int = 1
    """Responses per prompt (GRPO's group size in a rollout config)."""

    def _check_sampling(self, prefix: str) -> None:
        if self.temperature < 0:
            raise ValueError(f"{prefix}temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"{prefix}top_k={self.top_k} must be -1 (off) or >= 1")
        if self.n < 1:
            raise ValueError(f"{prefix}n={self.n} must be >= 1")


@dataclass(kw_only=True)
class SamplingConfig(SamplingKnobs):
    """How to sample the responses of one generate call."""

    max_new_tokens: int = 64
    """Response length cap."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these (the eos token is always one)."""
    seed: int | None = None
    """Seed for this call's sampling (None: the rollout's own generator). The call's prompts draw
    independently:
    two equal prompts in one call (the n episodes of one agent task) get different samples. A rollout that
    seeds each request (vLLM) gives prompt ``i`` the seed :meth:`prompt_seed` ``(i)``."""

    def __post_init__(self) -> None:
        self._check_sampling("")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")

    def prompt_seed(self, index: int) -> int | None:
        """The seed of the call's prompt ``index`` (None when the call has none)."""
        if self.seed is None:
            return None
        return (self.seed * 1_000_003 + index * 104_729) % (2**31)


@dataclass(kw_only=True)
class RolloutConfig(SamplingKnobs):
    """The fields every rollout shares: which backend, the lengths and dtype, the weight sync, and (inherited
    from
    :class:`SamplingKnobs`: temperature, top_p, top_k, n) how training rollouts sample. Field names follow
    verl's ``actor_rollout_ref.rollout``.

    Each rollout package subclasses it with its own knobs
    (``posttrain.rollout_vllm.config.VLLMRolloutConfig``, ``posttrain.rollout_hf.config.HFRolloutConfig``) and
    registers the subclass under its rollout name in the ``posttrain.rollouts`` entry-point group; the
    trainers' config loader picks it by ``rollout.name``, and its
    :meth:`build` returns the rollout (:attr:`rollout_class`)."""

    rollout_class: ClassVar[str] = ""
    """``module:Class`` of the :class:`BaseRollout` this config builds (set by each rollout's config
    class)."""

    name: str = "hf"
    """Backend: ``hf`` (transformers generate, the CPU default), ``vllm``, or another installed rollout."""
    prompt_length: int = 512
    """Longest prompt in tokens."""
    response_length: int = 512
    """Longest response in tokens."""
    dtype: str = "bfloat16"
    """Weights dtype inside the rollout engine."""
    max_model_len: int | None = None
    """Context length of the rollout engine; None = prompt_length + response_length."""
    free_cache_engine: bool = True
    """Sleep the rollout (free KV cache) while training runs."""
    update_weights_bucket_megabytes: int = 2048
    """Bucket size of the weight-sync protocol."""
    load_format: str = "auto"
    """``auto`` loads the weights of ``model.path``; ``dummy`` starts from random weights and relies on the
    first sync (so an actor built from a Megatron dist_ckpt may point ``model.path`` at a folder without
    weights)."""
    seed: int = 0
    """Rollout sampling seed: the engine's own seed, and in the RL trainer mixed with ``trainer.seed``, the
    step and the data-parallel rank into each generate call's seed."""
    val_temperature: float = 0.0
    """Sampling temperature when validating (0 = greedy)."""
    val_n: int = 1
    """Responses per prompt when validating."""
    return_routed_experts: bool = False
    """MoE models: record the top-k experts every MoE layer chose for every token the rollout fed to the model
    (``RolloutSample.routed_experts``), for rollout router replay (``actor.engine.router_replay.mode=R3``)."""

    def __post_init__(self) -> None:
        self._check_sampling("rollout.")
        if self.update_weights_bucket_megabytes < 1:
            raise ValueError(
                f"rollout.update_weights_bucket_megabytes={self.update_weights_bucket_megabytes} must be >= 1"
            )

    @classmethod
    def of(cls, config: RolloutConfig) -> Self:
        """``config`` as this class: itself when it already is one; a plain :class:`RolloutConfig` keeps every
        shared field but ``name`` and takes this class's defaults for the rest; another rollout's config is a
        ValueError (its own knobs would be lost)."""
        if isinstance(config, cls):
            return config
        if type(config) is not RolloutConfig:
            raise ValueError(
                f"a {type(config).__name__} (rollout.name={config.name!r}) cannot configure a "
                f"{cls.__name__}: build a {cls.__name__}, or a plain RolloutConfig with the shared fields "
                "only"
            )
        shared = {f.name: getattr(config, f.name) for f in fields(RolloutConfig) if f.name != "name"}
        return cls(**shared)

    def build(self, model: ModelConfig | str, *, device: Any, deterministic: bool = False) -> BaseRollout:
        """The rollout this config configures, over ``model`` (the trainer's :class:`ModelConfig` or an HF
        directory), on ``device``; ``deterministic`` (the trainer's ``actor.engine.full_determinism``) turns
        on whatever makes the rollout's generation repeatable."""
        from .registry import ROLLOUT_PACKAGES, load_target

        if not self.rollout_class:
            hint = ROLLOUT_PACKAGES.get(self.name, f"the package that registers rollout {self.name!r}")
            raise ValueError(
                f"rollout.name={self.name!r}: this {type(self).__name__} names no rollout class; install "
                f"{hint} (the loader then picks its config class), or set rollout.name to an installed "
                "rollout"
            )
        cls = load_target(self.rollout_class)
        if not (isinstance(cls, type) and issubclass(cls, BaseRollout)):
            raise TypeError(f"{self.rollout_class} is not a BaseRollout subclass")
        return cls(self, model, device=device, deterministic=deterministic)

    @property
    def serves_requests(self) -> bool | None:
        """Whether the rollout this config builds generates one request at a time (``agenerate``: the
        asynchronous agent loop, stream mode), so a run can be refused before anything is built; None: the
        config cannot tell, the built rollout does (:func:`serves_requests`)."""
        return None

    def sampling(self, validate: bool = False) -> SamplingConfig:
        """Sampling for a training rollout (this config's :class:`SamplingKnobs`), or for validation
        (``val_temperature``, ``val_n``, no top-p/top-k), up to ``response_length`` new tokens."""
        if validate:
            return SamplingConfig(
                temperature=self.val_temperature, n=self.val_n, max_new_tokens=self.response_length
            )
        shared = {f.name: getattr(self, f.name) for f in fields(SamplingKnobs)}
        return SamplingConfig(**shared, max_new_tokens=self.response_length)


@dataclass
class RolloutSample:
    """One generated response."""

    prompt_index: int
    """Index of its prompt in the request."""
    prompt_ids: list[int]
    """Prompt token ids."""
    response_ids: list[int]
    """Generated token ids (stop token included when generation stopped on one)."""
    log_probs: torch.Tensor
    """(len(response_ids),) float32 log-probs of the sampled tokens under the sampling distribution."""
    finish_reason: str = "length"
    """``stop`` or ``length``."""
    routed_experts: torch.Tensor | None = None
    """With ``RolloutConfig.return_routed_experts``: (len(prompt_ids) + len(response_ids), MoE layers, k)
    int32 expert ids the rollout's routers chose for each token, aligned with ``prompt_ids + response_ids``.
    The last token was sampled but never fed to the model: its row is -1. None otherwise."""
    response_mask: list[int] | None = None
    """A multi-turn episode (:mod:`posttrain.core.env`): 1 on the ids the model sampled, 0 on the
    environment's ids between its turns (their ``log_probs`` are 0); None: every response id was sampled."""


@dataclass
class SyncReport:
    """What a weight sync moved."""

    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


class BaseRollout(ABC):
    """A generation engine that can take new weights.

    Built by :meth:`RolloutConfig.build`, which calls ``cls(config, model, device=..., deterministic=...)``: a
    subclass's constructor takes those (``config`` its own config class, ``model`` a :class:`ModelConfig` or
    an HF directory)."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[RolloutSample]:
        """``sampling.n`` samples per prompt, grouped by prompt (prompt 0's n samples first). Prompts are
        token ids, used as given (the agent loop passes whole multi-turn trajectories), and every sample
        carries the log-probs of its sampled ids."""

    @abstractmethod
    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        peft_config: dict[str, Any] | None = None,
        base_sync_done: bool = False,
        version: int | None = None,
    ) -> SyncReport:
        """Load a stream of (HF name, full tensor); every tensor is verified before generation resumes. A
        complete, verified sync makes ``version`` the one :meth:`weight_version` reports; a failed one clears
        it."""

    def weight_version(self) -> int | None:
        """The version of the weights being served: the ``version`` of the last complete sync (None before
        one, or after a failed one). Trainers compare it with the actor's before every rollout."""
        return getattr(self, "_weight_version", None)

    def sleep(self, level: int = 1) -> None:
        """Free memory for training (level 1: KV cache and weights offloaded; level 2: weights discarded)."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back ``weights`` and/or ``kv_cache`` (both when None)."""

    def release(self) -> None:
        """Free everything; the rollout cannot be used afterwards."""


def serves_requests(rollout: Any) -> bool:
    """Whether ``rollout`` generates one request at a time through an awaitable ``agenerate(prompt_ids,
    sampling,
    prompt_index)`` (the asynchronous agent loop and stream mode need it). A rollout whose ``agenerate`` works
    only in some settings says which with a ``serves_requests`` attribute (vLLM: with
    ``rollout.executor=server``); otherwise having ``agenerate`` is the answer."""
    return bool(getattr(rollout, "serves_requests", hasattr(rollout, "agenerate")))

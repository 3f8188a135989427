"""The vLLM rollout's config: the fields every rollout shares plus vLLM's own engine and weight-sync knobs.

Registered as ``vllm`` in the ``posttrain.rollouts`` entry-point group (it
builds :class:`~posttrain.rollout_vllm.rollout.VLLMRollout`), so ``rollout.name=vllm`` on the command line
makes every field here a ``rollout.<field>`` key (``rollout.executor=multiprocess``). Importing this module
imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.rollout import RolloutConfig

from .engines import EXECUTORS

TRANSPORTS = ("inprocess", "shm", "cuda_ipc")
"""The weight-sync transports (the keys of :data:`.transport.BUFFERS`, named here so the config imports
without torch)."""


@dataclass(kw_only=True)
class VLLMRolloutConfig(RolloutConfig):
    """:class:`~posttrain.core.rollout.RolloutConfig` and what only vLLM reads."""

    rollout_class: ClassVar[str] = "posttrain.rollout_vllm.rollout:VLLMRollout"

    name: str = "vllm"
    """The rollout backend (``vllm``)."""
    executor: str = "auto"
    """Where vLLM's workers run: ``auto``, ``external_launcher``, ``inprocess``, ``multiprocess`` or
    ``server`` (:mod:`posttrain.rollout_vllm.rollout`); ``auto`` picks ``external_launcher``
    under an initialised torch.distributed and ``inprocess`` otherwise."""
    transport: str = "auto"
    """Weight-sync transport: ``auto``, ``inprocess``, ``shm`` or ``cuda_ipc``; ``auto`` passes tensors by
    reference when the worker is in this process, else shared memory (CPU) or CUDA IPC (GPU)."""
    tensor_model_parallel_size: int = 1
    """vLLM's tensor-parallel degree, independent of training; under torchrun vLLM's data-parallel size is the
    world size over it."""
    gpu_memory_utilization: float = 0.5
    """Share of the GPU memory that is free when the rollout starts (after the trainer's engines are built)
    that vLLM may take for weights, activations and KV cache. verl counts a share of the whole GPU; here a
    colocated trainer's memory is left out, so 0.5 means half of what the trainer left."""
    gpu_memory_gib: float = 0.0
    """An explicit vLLM memory budget in GiB (weights + KV cache); 0 = use ``gpu_memory_utilization``."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs in vLLM. None: graphs on a CUDA device (the decode of a small model is bound by
    kernel launches without them), eager elsewhere (vLLM's CPU backend would compile for minutes first)."""
    max_num_batched_tokens: int = 8192
    """vLLM scheduler token budget."""
    max_num_seqs: int | None = None
    """vLLM scheduler sequence budget: the most sequences decoded at once, and (with CUDA graphs) the largest
    decode batch captured as a graph. null: the RL trainer sets it to one generate call's sequences per rank
    (prompts x ``n``, rounded up to 16, at most
    1024: :func:`posttrain.core.memory_policy.choose_max_num_seqs`); a rollout built outside a trainer takes
    1024."""
    enable_prefix_caching: bool = True
    """vLLM prefix cache. A weight sync resets it (a Python walk over every KV block: 22 ms of a profiled 1.5B
    sync on an H200) when a request may have filled it since the last reset; vLLM's sleep resets it too, so
    after a sleep (the trainer's cycle) or with the cache off the sync skips the reset."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for vLLM's ``LLM`` / ``AsyncEngineArgs`` (e.g. ``block_size``); they win over
    the arguments built from the fields above, key by key; a ``compilation_config`` dict is merged into
    posttrain's."""
    lora_name: str = "posttrain"
    """Name of the LoRA adapter synced from the trainer (vLLM started with LoRA: ``model.lora_rank`` > 0)."""
    lora_int_id: int = 1
    """vLLM id of that adapter."""

    @property
    def serves_requests(self) -> bool:
        """With ``executor=server`` only: ``AsyncLLM`` takes single requests; the other executors take
        batches."""
        return self.executor == "server"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.executor not in EXECUTORS:
            raise ValueError(
                f"rollout.executor={self.executor!r} is unknown: use one of {', '.join(EXECUTORS)}"
            )
        if self.transport not in ("auto", *TRANSPORTS):
            raise ValueError(
                f"rollout.transport={self.transport!r} is unknown: use auto, {', '.join(TRANSPORTS)}"
            )
        if self.tensor_model_parallel_size < 1:
            raise ValueError(
                f"rollout.tensor_model_parallel_size={self.tensor_model_parallel_size} must be >= 1"
            )
        if self.gpu_memory_gib < 0:
            raise ValueError(f"rollout.gpu_memory_gib={self.gpu_memory_gib} must be >= 0 (0 = use the share)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs={self.max_num_seqs} must be >= 1 (or null to choose)")
        if self.lora_int_id < 1:
            raise ValueError(f"rollout.lora_int_id={self.lora_int_id} must be >= 1")

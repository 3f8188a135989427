"""Keys a user may bring that posttrain does not declare: verl's, and posttrain's own renamed or removed ones.

The loader consults :func:`migration_hint` for every key of the presets and overrides before it merges, so
such a key exits with a message naming the posttrain key it maps to (or saying there is none), instead of
"unknown config key". The table is data: an entry is a key pattern (``*`` matches one key segment, a trailing
``.**`` any remaining ones) and the message.
"""

from __future__ import annotations

import fnmatch

DOC = "docs/migrating-from-verl.md"

VERL_PREFIXES = {
    "actor_rollout_ref.actor.fsdp_config.": "actor.engine.",
    "actor_rollout_ref.actor.megatron.": "actor.engine.",
    "actor_rollout_ref.actor.checkpoint.": "checkpoint.",
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.ref.fsdp_config.": "ref.engine.",
    "actor_rollout_ref.ref.megatron.": "ref.engine.",
    "actor_rollout_ref.ref.": "ref.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.model.": "model.",
    "critic.fsdp_config.": "critic.engine.",
    "critic.megatron.": "critic.engine.",
}
"""verl key prefix -> the posttrain prefix the rest of the key carries over to."""

_NO_QAT = "posttrain has no quantisation-aware training (train in bf16 and quantise the exported HF model)"
_ENGINE = "*.engine."
_PORTABLE = (
    "write actor.engine.portable_checkpoint (and critic.engine.portable_checkpoint for a critic) "
    "with model_engine=megatron; the FSDP engines always save the portable layout"
)
_HF_SAVE = (
    "actor.engine.hf_save_kwargs (and critic.engine.hf_save_kwargs for a critic) with model_engine=megatron"
)

MOVED: dict[str, str] = {
    "data.max_response_length": "verl's key; posttrain's is rollout.response_length",
    "custom_reward_function.*": (
        "verl's key; posttrain's is reward.custom_reward_function=path/to/file.py:name"
    ),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": (
        "verl's key; posttrain's is actor.engine.max_token_len_per_gpu"
    ),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
        "verl's key; posttrain's is actor.engine.micro_batch_size_per_gpu"
    ),
    "actor_rollout_ref.actor.strategy": (
        "verl's key; posttrain's is model_engine (all roles) or actor.engine.strategy"
    ),
    "critic.strategy": "verl's key; posttrain's is critic.engine.strategy",
    "trainer.max_actor_ckpt_to_keep": "verl's key; posttrain's is checkpoint.max_ckpt_to_keep",
    _ENGINE + "qat.**": f"removed: {_NO_QAT}; there is no posttrain key",
    _ENGINE + "use_fused_kernels": (
        "removed: there are no fused log-prob kernels; the engines already compute log-probs and entropy "
        "from the hidden states in chunks (tune <role>.engine.entropy_from_logits_chunk_size)"
    ),
    _ENGINE + "router_replay.record_file": (
        "removed: recorded routing stays in memory (batch.fields['routed_experts']); there is no posttrain "
        "key"
    ),
    _ENGINE + "router_replay.replay_file": (
        "removed: R3 replays the rollout's routing; set rollout.return_routed_experts=true (no file key)"
    ),
    _ENGINE + "ulysses_sequence_parallel_size": (
        "removed: the FSDP engine has no Ulysses sequence parallelism; use model_engine=megatron with "
        "<role>.engine.context_parallel_size"
    ),
    _ENGINE + "dynamic_context_parallel": (
        "removed: no dynamic context parallelism; use <role>.engine.context_parallel_size"
    ),
    _ENGINE + "max_seqlen_per_dp_cp_rank": (
        "removed: no dynamic context parallelism; cap micro-batches with <role>.engine.max_token_len_per_gpu"
    ),
    _ENGINE
    + "pad_bshd_to_minibatch_max": "removed: the megatron engine always runs packed (THD) micro-batches",
    _ENGINE
    + "use_mbridge": "removed: megatron models are always built through a bridge (see vanilla_mbridge)",
    "*.optim.optimizer": "removed: the optimizer is always torch.optim.AdamW; there is no posttrain key",
    "data.pad_mode": (
        "removed: batches are always packed without padding (PackedBatch); there is no posttrain key"
    ),
    "rollout.mode": (
        "removed: the vLLM rollout's rollout.executor says where it runs (executor=server is async)"
    ),
    "checkpoint.portable": f"moved to the megatron engine's config: {_PORTABLE}",
    "checkpoint.mbridge_config": f"moved to the megatron engine's config: write {_HF_SAVE}",
    "checkpoint.mbridge_config.**": f"moved to the megatron engine's config: write {_HF_SAVE}",
    "actor_rollout_ref.actor.checkpoint.mbridge_config": f"verl's key; posttrain's is {_HF_SAVE}",
    "actor_rollout_ref.actor.checkpoint.mbridge_config.**": f"verl's key; posttrain's is {_HF_SAVE}",
}
"""key pattern -> what to write instead (or that nothing replaces it)."""


def migration_hint(key: str) -> str | None:
    """The message for ``key`` when posttrain does not declare it but knows what it was; None otherwise."""
    for pattern, message in MOVED.items():
        if _matches(key, pattern):
            return f"{key}: {message} (see {DOC})"
    for verl, ours in VERL_PREFIXES.items():
        if key.startswith(verl):
            return f"{key} is verl's key; posttrain's is {ours}{key[len(verl) :]} (see {DOC})"
    if key.startswith("+") or key.startswith("~"):
        return (
            f"{key}: Hydra's {key[0]}key syntax; posttrain declares every key, so write {key[1:]}=... "
            f"(`posttrain config show` lists them; see {DOC})"
        )
    return None


def _matches(key: str, pattern: str) -> bool:
    if pattern.endswith(".**"):
        head = pattern[:-3]
        parts = key.split(".")
        return any(fnmatch.fnmatchcase(".".join(parts[:i]), head) for i in range(1, len(parts)))
    return len(key.split(".")) == len(pattern.split(".")) and fnmatch.fnmatchcase(key, pattern)


def leaf_keys(node, prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of a nested mapping (a ``DictConfig`` or ``dict``)."""
    keys = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        if hasattr(value, "items") and len(value):
            keys += leaf_keys(value, key + ".")
        else:
            keys.append(key)
    return keys

"""MoE router replay: make the experts an update uses equal the experts chosen earlier.

The routing travels as a per-token batch field, ``batch.fields["routed_experts"]`` of shape (T, layers, k)
(integer expert ids, one row per token, the MoE layers in model order), so it follows its tokens through
:meth:`PackedBatch.select` into every micro-batch, whatever the micro-batching and sequence order.

R2 ("router replay"): a forward-only pass records each MoE layer's top-k expert indices per token and returns
them as ``model_output["routed_experts"]`` (int32, in the caller's token order); the trainer puts them into
the update batch's fields. R3 ("rollout router replay"): the rollout recorded them and the trainer puts them
into the batch's fields before the log-prob pass, so the log-prob pass and the update both replay them. A pass
whose batch has the field replays it (except the recording pass of R2): Megatron-Core's ``RouterReplay`` hooks
(enabled by ``moe_enable_routing_replay``) take the given indices instead of the router's top-k, in the
forward and in the activation-recompute backward; the router's probabilities are still computed and gathered
at them.

A row of -1 marks a token whose routing was never recorded (a rollout never feeds its last sampled token to
the model). Megatron-Core cannot route some tokens of a micro-batch and replay the others, so such rows replay
experts ``0..k-1``. That is exact for the log-probs only because those tokens affect none of them: the last
token of a sequence is seen by no later position (causal attention) and its own output predicts nothing, and
with dropless routing (no expert capacity) one token's experts do not change another token's output.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.batch import PackedBatch
from posttrain.core.config import RouterReplayConfig

FIELD = "routed_experts"
"""The batch field (and model output) holding (T, layers, k) expert indices."""


class RouterReplay:
    """Drives the Megatron-Core ``RouterReplay`` instances of one engine's routers.

    Megatron-Core also keeps every instance ever built in a process-wide list and its static helpers act on
    that list, so they would mix the routers of two engines (an actor and a reference, or a rebuilt engine);
    this driver acts only on the instances of its own model, collected by :meth:`attach`."""

    def __init__(self, config: RouterReplayConfig, sequence_parallel: bool = False) -> None:
        self.config = config
        self.sequence_parallel = sequence_parallel
        self.enabled = config.mode != "disabled"
        self.recording = False
        self.replaying = False
        self.instances: list[Any] = []

    def attach(self, chunks: list[torch.nn.Module]) -> None:
        """Collect the routers' replay instances of ``chunks`` (one per MoE layer, in layer order)."""
        self.instances = [
            m.router_replay
            for c in chunks
            for m in c.modules()
            if getattr(m, "router_replay", None) is not None
        ]

    def _set_action(self, name: str | None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for inst in self.instances:
            if name is None:
                inst.clear_router_replay_action()
            else:
                inst.set_router_replay_action(RouterReplayAction[name])

    def begin_pass(self, forward_only: bool, batch: PackedBatch) -> None:
        """Choose record (R2 forward-only), replay (the batch has ``fields['routed_experts']``) or nothing."""
        self.recording = self.replaying = False
        if not self.enabled:
            return
        self.clear()
        if forward_only and self.config.mode == "R2":
            self.recording = True
            self._set_action("RECORD")
        elif FIELD in batch.fields:
            self.replaying = True

    def before_micro(self, mb: PackedBatch, pad_to: int) -> None:
        """Hand this micro-batch's (T, layers, k) indices to the routers before its forward (replay only);
        -1 rows become experts ``0..k-1`` and padding rows repeat the first row."""
        if not self.replaying:
            return
        routed = mb.fields[FIELD].long()
        if routed.shape[1] != len(self.instances):
            raise ValueError(
                f"batch.fields[{FIELD!r}] has {routed.shape[1]} MoE layers, the model has "
                f"{len(self.instances)}: replay routing recorded with this model"
            )
        fill = torch.arange(routed.shape[-1], device=routed.device)
        routed = torch.where(routed < 0, fill, routed)
        if pad_to > routed.shape[0]:
            pad = routed[:1].expand(pad_to - routed.shape[0], *routed.shape[1:])
            routed = torch.cat([routed, pad])
        if self.sequence_parallel:
            from megatron.core import parallel_state as mpu

            size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
            per_rank = routed.shape[0] // size
            routed = routed[rank * per_rank : (rank + 1) * per_rank]
        for i, inst in enumerate(self.instances):
            inst.set_target_indices(routed[:, i].contiguous())
        self._set_action("REPLAY_FORWARD")

    def after_forward(self, num_tokens: int) -> torch.Tensor | None:
        """The (T, layers, k) indices recorded by this micro-batch's forward (recording passes only)."""
        if self.recording:
            data = torch.stack([inst.get_recorded_indices() for inst in self.instances], dim=1)
            if self.sequence_parallel:
                from megatron.core import parallel_state as mpu

                group = mpu.get_tensor_model_parallel_group()
                parts = [torch.empty_like(data) for _ in range(torch.distributed.get_world_size(group))]
                torch.distributed.all_gather(parts, data.contiguous(), group=group)
                data = torch.cat(parts)
            return data[:num_tokens]
        if self.replaying:
            self._set_action("REPLAY_BACKWARD")
        return None

    def end_pass(self) -> None:
        self._set_action(None)
        self.recording = self.replaying = False

    def clear(self) -> None:
        """Drop recorded and queued indices (after a pass's backward has consumed them)."""
        for inst in self.instances:
            inst.clear_indices()

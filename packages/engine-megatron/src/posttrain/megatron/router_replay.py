"""MoE router replay: make the experts an update uses equal the experts chosen earlier.

R2 ("router replay"): the forward-only log-prob pass records each MoE layer's top-k expert indices per token
and returns them as ``model_output["routed_experts"]`` (T, layers, k); the trainer passes them back in the
update batch as ``batch.meta["routed_experts"]``. R3 ("rollout router replay"): the rollout engine recorded them
and the trainer puts them in ``batch.meta["routed_experts"]``. In either mode a training pass with that entry
replays them: Megatron-Core's ``RouterReplay`` hooks (enabled by ``moe_enable_routing_replay``) take the given
indices instead of the router's top-k, in the forward and in the activation-recompute backward.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.batch import PackedBatch
from posttrain.core.config import RouterReplayConfig


class RouterReplay:
    """Per-engine driver of Megatron-Core's global router-replay instances."""

    def __init__(self, config: RouterReplayConfig, sequence_parallel: bool = False) -> None:
        self.config = config
        self.sequence_parallel = sequence_parallel
        self.enabled = config.mode != "disabled"
        self.recording = False
        self.replaying = False

    def _mc(self) -> Any:
        from megatron.core.transformer.moe import router_replay

        return router_replay

    def begin_pass(self, forward_only: bool, batch: PackedBatch) -> None:
        """Choose record / replay / nothing for the micro-batches of this pass."""
        self.recording = self.replaying = False
        if not self.enabled:
            return
        rr = self._mc()
        rr.RouterReplay.clear_global_indices()
        if "routed_experts" in batch.meta and not (forward_only and self.config.mode == "R2"):
            self.replaying = True
        elif forward_only and self.config.mode == "R2":
            self.recording = True
            rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.RECORD)

    def before_micro(self, routed: torch.Tensor | None, pad_to: int) -> None:
        """Hand this micro-batch's (T, layers, k) indices to the routers before its forward."""
        if not self.replaying:
            return
        if routed is None:
            raise ValueError(
                "router replay: batch.meta['routed_experts'] must cover every token of the batch"
            )
        rr = self._mc()
        routed = routed.long()
        if pad_to > routed.shape[0]:
            fill = routed[:1].expand(pad_to - routed.shape[0], *routed.shape[1:])
            routed = torch.cat([routed, fill])
        if self.sequence_parallel:
            from megatron.core import parallel_state as mpu

            size, rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
            per_rank = routed.shape[0] // size
            routed = routed[rank * per_rank : (rank + 1) * per_rank]
        rr.RouterReplay.set_replay_data([routed[:, i].contiguous() for i in range(routed.shape[1])])
        rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, num_tokens: int) -> torch.Tensor | None:
        """The (T, layers, k) indices recorded by this micro-batch's forward (recording passes only)."""
        if self.recording:
            data = torch.stack(self._mc().RouterReplay.get_recorded_data(), dim=1)
            if self.sequence_parallel:
                from megatron.core import parallel_state as mpu

                group = mpu.get_tensor_model_parallel_group()
                parts = [torch.empty_like(data) for _ in range(torch.distributed.get_world_size(group))]
                torch.distributed.all_gather(parts, data.contiguous(), group=group)
                data = torch.cat(parts)
            return data[:num_tokens]
        if self.replaying:
            self._mc().RouterReplay.set_global_router_replay_action(
                self._mc().RouterReplayAction.REPLAY_BACKWARD
            )
        return None

    def end_pass(self) -> None:
        if self.enabled:
            self._mc().RouterReplay.clear_global_router_replay_action()
        self.recording = self.replaying = False

    def clear(self) -> None:
        if self.enabled:
            self._mc().RouterReplay.clear_global_indices()

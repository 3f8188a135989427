"""The value head that replaces the LM output layer of a value model (critic).

Megatron's GPTModel calls ``output_layer(hidden, weight=..., runtime_gather_output=...)`` on the last stage.
The head is one ``hidden -> 1`` linear map replicated on every TP rank (its gradient is identical on all of
them); under sequence parallelism it first gathers the sequence shards so every rank sees all tokens.
"""

from __future__ import annotations

from typing import Any

import torch


class ValueHead(torch.nn.Module):
    """``hidden (s, b, h) -> values (s, b, 1)``; returns ``(values, None)`` like Megatron's linear layers."""

    def __init__(
        self,
        hidden_size: int,
        sequence_parallel: bool,
        init_std: float,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # drawn from its own generator: the same head at every TP/PP layout (the default generator's state
        # depends on how much of the model this rank built first)
        weight = torch.empty(1, hidden_size).normal_(
            0.0, init_std, generator=torch.Generator().manual_seed(seed)
        )
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.weight.sequence_parallel = False

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets
        )


def add_value_head(chunks: list[torch.nn.Module], seed: int = 0) -> list[torch.nn.Module]:
    """Pre-wrap hook: swap the output layer of the last-stage chunk for a :class:`ValueHead` drawn from
    ``seed``.

    The head is registered with Megatron-Bridge as a replicated module, so weight loading (which skips the
    LM head through ``allowed_mismatched_params``) knows how to treat it."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    AutoMapping.register_module_type("ValueHead", "replicated")
    for chunk in chunks:
        if getattr(chunk, "post_process", False) and getattr(chunk, "output_layer", None) is not None:
            cfg = chunk.config
            if chunk.share_embeddings_and_output_weights:
                raise ValueError(
                    "a value model cannot tie its head to the embeddings: remove "
                    "share_embeddings_and_output_weights=true from the critic's "
                    "engine.override_transformer_config (the engine unties value models itself)"
                )
            old = chunk.output_layer.weight
            chunk.output_layer = ValueHead(
                cfg.hidden_size, cfg.sequence_parallel, cfg.init_method_std, old.dtype, old.device, seed
            )
    return chunks

"""Record the experts an HF MoE model's routers choose while the rollout generates (rollout router replay,
R3).

In transformers 5 every sparse MoE block (Qwen3-MoE's ``mlp.gate``, likewise Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V3) calls a top-k router module that returns ``(router_logits, routing_weights, expert_indices)``
(Qwen3-MoE: ``topk(softmax(logits), num_experts_per_tok)``) and dispatches each token to exactly
``expert_indices``. A forward hook on each router keeps those indices, so the record is what the block used,
not a recomputation of it. The routers are found by class name (``*TopKRouter``), in module order, which is
layer order: the layout Megatron-Core's router replay expects.

One :class:`RoutingRecorder` covers one batched generation: the prefill forward over the left-padded prompts,
then one forward per decode step over every row (each feeding the token sampled at the step before; a finished
row's record past its end is never read). A sample's record is its prompt's rows of the prefill, then one row
per fed response token, then a row of -1 for the last response token, which was sampled but never fed to the
model.
"""

from __future__ import annotations

from typing import Any

import torch


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of every MoE layer of ``model``, in layer order; ValueError when there is none."""
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    if not routers:
        raise ValueError(
            f"rollout.return_routed_experts=true needs an MoE model with transformers top-k router modules "
            f"(e.g. Qwen3-MoE's mlp.gate); {type(model).__name__} has none: set "
            "rollout.return_routed_experts=false"
        )
    return routers


class RoutingRecorder:
    """Forward hooks on every MoE router for the duration of one generation (a context manager)."""

    def __init__(self, model: torch.nn.Module, num_rows: int, max_new_tokens: int) -> None:
        self.routers = find_routers(model)
        self.num_rows = num_rows
        self.max_new_tokens = max_new_tokens
        self._seen: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self.prefill: torch.Tensor | None = None
        """(rows, prompt width, layers, k) expert ids of the left-padded prefill."""
        self.decoded: torch.Tensor | None = None
        """(rows, max_new_tokens, layers, k): [i, j] holds response token j's experts, -1 if not fed."""

    def __enter__(self) -> RoutingRecorder:
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
        self._seen.append(output[-1])

    def record(self, step: int, input_shape: tuple[int, ...]) -> None:
        """File what the forward of decode ``step`` chose (step 0: the prefill); ``input_shape`` is its
        (rows, tokens) input."""
        assert len(self._seen) == len(self.routers), "one router call per MoE layer and forward"
        routed = torch.stack(self._seen, dim=1).to(torch.int32)  # (rows * tokens, layers, k)
        self._seen = []
        routed = routed.view(*input_shape, *routed.shape[1:])
        if step == 0:
            self.prefill = routed
            self.decoded = routed.new_full((self.num_rows, self.max_new_tokens, *routed.shape[2:]), -1)
        else:
            self.decoded[:, step - 1] = routed[:, 0]

    def sample(self, row: int, prompt_len: int, response_len: int) -> torch.Tensor:
        """(prompt_len + response_len, layers, k) int32 on the CPU for ``row``; the last row is -1."""
        width = self.prefill.shape[1]
        fed = [self.prefill[row, width - prompt_len :], self.decoded[row, : response_len - 1]]
        last = self.decoded.new_full((1, *self.decoded.shape[2:]), -1)
        return torch.cat([*fed, last]).cpu()

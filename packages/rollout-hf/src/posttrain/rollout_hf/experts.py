"""Per-expert weight names onto transformers' fused MoE expert parameters.

In transformers 5 an MoE layer of the Qwen2-MoE family (Qwen2-MoE, Qwen3-MoE and the models its conversion
mapping aliases to ``qwen2_moe``) holds its experts fused: ``mlp.experts.gate_up_proj`` (experts, 2 x
intermediate, hidden), each expert's gate rows first, and ``mlp.experts.down_proj`` (experts, hidden,
intermediate). Checkpoints, and so the trainer's weight stream, name every expert's projections separately
(``mlp.experts.<e>.gate_proj.weight``, ``up_proj``, ``down_proj``); transformers' ``qwen2_moe`` conversion
mapping merges them (``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)`` for gate and up) when it loads a
checkpoint. :func:`expert_slot` gives the slice of the fused parameter such a tensor fills, so a sync copies
it straight in.
"""

from __future__ import annotations

import re

import torch

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def expert_slot(name: str, targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(fused parameter, the view of it that tensor ``name`` fills, how many tensors fill the whole parameter)
    for a per-expert name whose fused parameter ``targets`` holds; None for any other name."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    down = match["proj"] == "down_proj"
    fused = targets.get(f"{match['prefix']}.{'down_proj' if down else 'gate_up_proj'}")
    expert = int(match["expert"])
    if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
        return None
    row = fused[expert]
    if down:
        return fused, row, fused.shape[0]
    half = row.shape[0] // 2
    return fused, row[:half] if match["proj"] == "gate_proj" else row[half:], 2 * fused.shape[0]

"""Write a random-init tiny Qwen3-MoE (:data:`moe_worker.TINY_QWEN3_MOE`) that uses the tokenizer of a
``posttrain model init`` directory, so the RL loop can run on an MoE model offline.

Usage: ``python make_tiny_moe.py TOKENIZER_DIR OUT_DIR``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def make_tiny_moe(tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Save the tiny Qwen3-MoE with ``tokenizer_dir``'s tokenizer, vocabulary size and special ids."""
    from moe_worker import TINY_QWEN3_MOE
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3MoeConfig

    base = AutoConfig.from_pretrained(tokenizer_dir)
    special = dict(eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id, bos_token_id=None)
    config = Qwen3MoeConfig(**{**TINY_QWEN3_MOE, "vocab_size": base.vocab_size}, **special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**special)
    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(make_tiny_moe(sys.argv[1], sys.argv[2]))

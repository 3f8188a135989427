"""Write a random-init tiny Qwen3-MoE (:data:`posttrain.core.testing.TINY_QWEN3_MOE`) that uses the tokenizer
of a ``posttrain model init`` directory, so the RL loop can run on an MoE model offline.

Usage: ``python make_tiny_moe.py TOKENIZER_DIR OUT_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from posttrain.core.testing import tiny_model


def make_tiny_moe(tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Save the tiny Qwen3-MoE with ``tokenizer_dir``'s tokenizer, vocabulary size and special ids."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    base = AutoConfig.from_pretrained(tokenizer_dir)
    special = dict(eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id, bos_token_id=None)
    model = tiny_model("qwen3_moe", seed=seed, vocab_size=base.vocab_size, **special)
    model.generation_config = GenerationConfig(**special)
    out = Path(out_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(make_tiny_moe(sys.argv[1], sys.argv[2]))

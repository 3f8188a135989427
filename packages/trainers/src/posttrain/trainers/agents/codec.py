"""Encode and decode with the tokenizer's Rust backend directly, when that gives the tokenizer's own ids and
text.

A Hugging Face fast tokenizer's ``encode(text, add_special_tokens=False)`` sets the backend's truncation,
padding and ``encode_special_tokens`` for the call, then runs ``backend.encode_batch([text])`` (which hands
the one text to its thread pool) and wraps the result. The agent loop encodes and decodes on every turn in the
process that also runs vLLM's front end, so :class:`Codec` calls ``backend.encode(text).ids`` itself when the
tokenizer's own call would do exactly that: a tokenizer class that does not override the encode or decode path
(:data:`PATH`), and, checked on every call, a backend with no truncation, no padding and the tokenizer's
``split_special_tokens``. Otherwise, and for slow tokenizers, it calls the tokenizer. ``decode`` goes to
``backend.decode`` when the tokenizer does not clean up tokenization spaces (the only thing its ``decode``
adds for a list of ids). What the agent loop's turn costs with it and without: BENCHMARKS.md, agent host CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PATH = ("encode", "encode_plus", "_encode_plus", "_batch_encode_plus", "decode", "_decode")
"""The methods between ``tokenizer.encode``/``decode`` and the backend."""
BASES = (
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
    "transformers.tokenization_utils_fast",
)
"""The modules whose versions of :data:`PATH` are the plain backend call (transformers 4 and 5)."""


def plain(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is a fast tokenizer whose class keeps transformers' own encode and decode
    path."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    cls = type(tokenizer)
    return all(getattr(getattr(cls, name, None), "__module__", BASES[0]) in BASES for name in PATH)


class Codec:
    """``tokenizer.encode(text, add_special_tokens=False)`` and ``tokenizer.decode(ids)``, the same ids and
    text with less Python in between."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer if plain(tokenizer) else None
        self.direct_decode = self.backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False
        )

    def direct(self) -> bool:
        """Whether the backend's state now is what the tokenizer's ``encode`` would set for its call."""
        b = self.backend
        if b is None or b.truncation is not None or b.padding is not None:
            return False
        split = getattr(self.tokenizer, "split_special_tokens", None)
        return split is None or bool(split) == b.encode_special_tokens

    def encode(self, text: str) -> list[int]:
        if self.direct():
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        if self.direct_decode:
            return self.backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(ids)

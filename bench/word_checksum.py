"""The weight sync's previous checksum, kept as the same-run baseline of ``bench/vllm_sync.py``: the bucket's
bytes read as int32 words, widened to int64, and two running sums (``cumsum``) over every word, read at the
tensors' ends (the operations of ``0cff9d8``'s ``posttrain.core.weight_sync.bucket_checksums``, now through
the product's own span machinery). The product replaced it with :mod:`posttrain.core.checksum` (256-byte row
hashes from one int8 matrix multiply, summed the same way)."""

from __future__ import annotations

import torch

from posttrain.core.checksum import span_sums

_SCAN_WORDS = 1 << 24


def word_bucket_checksums(
    buffer: torch.Tensor, spans: list[tuple[int, int]], chunk_words: int = _SCAN_WORDS
) -> list[int]:
    """The previous checksum of each ``(offset, nbytes)`` span of the flat uint8 ``buffer`` (4-byte aligned
    offsets, zero bytes to the next word): the product's running sums (:func:`span_sums`) over the buffer's
    int32 words, each widened to int64, ``chunk_words`` words at a time."""
    if not spans:
        return []
    starts = [off // 4 for off, _ in spans]
    ends = [(off + n + 3) // 4 for off, n in spans]
    words = buffer[: max(ends) * 4].view(torch.int32)
    return span_sums(lambda b, e: words[b:e].to(torch.int64), starts, ends, chunk_words, buffer.device)

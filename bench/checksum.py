"""The weight sync's bucket checksum alone: the row hashes of ``posttrain.core.checksum`` against the previous
word checksum (:mod:`word_checksum`), on the same bucket in the same run.

The bucket holds the tensors of a Qwen2.5-1.5B shape in bf16 (338 tensors, 3.09 GB in all, here cut into
buckets of ``--bucket-mb``), each at a multiple of 256 bytes with its tail zeroed, as the sender packs them.
Each checksum runs over every bucket once to warm up, then ``--reps`` times; the best time counts, reported as
ms for the whole model and GB/s. Both must give each tensor a checksum that matches its own
``tensor_checksum``, checked once for a few tensors (the row hashes) so the timed code is the product's.

    python bench/checksum.py [--device cuda|cpu] [--bucket-mb 2048] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from hf_rollout import timed  # warm-up call, then the timed ones, synchronised
from weight_sync import QWEN25_15B
from word_checksum import word_bucket_checksums

from posttrain.core.checksum import bucket_checksums, padded, tensor_checksum


def qwen_sizes(shape: dict) -> list[int]:
    """Element counts of the shape's tensors in HF order: the embedding, per layer q/k/v (weight, bias), o,
    gate, up, down and the two norms, the final norm (the tied ``lm_head`` is sent once, as the embedding)."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = [h * h, h, kv * h, kv, kv * h, kv, h * h, inter * h, inter * h, h * inter, h, h]
    return [shape["vocab_size"] * h] + per_layer * layers + [h]


def buckets(sizes: list[int], bucket_bytes: int, device: torch.device) -> list[tuple[torch.Tensor, list]]:
    """Random bf16 bytes laid out as the sender lays them: (buffer, spans) per bucket."""
    out, spans, offset = [], [], 0
    for n in sizes:
        nbytes = 2 * n
        if offset + padded(nbytes) > bucket_bytes:
            out.append(spans)
            spans, offset = [], 0
        spans.append((offset, nbytes))
        offset += padded(nbytes)
    out.append(spans)
    result = []
    for spans in out:
        end = max(off + padded(n) for off, n in spans)
        buf = torch.randint(-128, 128, (end,), dtype=torch.int8, device=device).view(torch.uint8)
        for off, n in spans:
            buf[off + n : off + padded(n)] = 0
        result.append((buf, spans))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bucket-mb", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = qwen_sizes(QWEN25_15B)
    data = buckets(sizes, args.bucket_mb << 20, device)
    buf, spans = data[0]
    got = bucket_checksums(buf, spans)
    for i in (0, 1, len(spans) - 1):  # the timed function's results are each tensor's own checksum
        off, n = spans[i]
        if got[i] != tensor_checksum(buf[off : off + n]):
            raise RuntimeError(f"bucket checksum of span {i} differs from its tensor_checksum")
    rows = timed(lambda: [bucket_checksums(b, s) for b, s in data], device, args.reps)["best_s"]
    words = timed(lambda: [word_bucket_checksums(b, s) for b, s in data], device, args.reps)["best_s"]
    nbytes = sum(2 * n for n in sizes)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tensors": len(sizes),
        "bytes": nbytes,
        "buckets": len(data),
        "rows_ms": round(rows * 1e3, 2),
        "words_ms": round(words * 1e3, 2),
        "rows_gb_s": round(nbytes / rows / 1e9, 1),
        "words_gb_s": round(nbytes / words / 1e9, 1),
        "words_over_rows": round(words / rows, 2),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

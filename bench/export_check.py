"""Check an SFT run's HF export against its own log: the token-mean NLL of the last checkpoint's export
(``global_step_N/actor/huggingface``, written with ``hf_model`` in ``checkpoint.save_contents``) over the
validation set, next to the ``val/loss`` the trainer logged at step N. Exits 1 when they differ by more than
``--rtol``.

    python3 bench/export_check.py RUN [--rtol 1e-2] [--device cuda] [--dtype float32]

The run's ``config.yaml`` gives the validation files, the tokenizer and the lengths, so the tokens and loss
masks are the trainer's own (``SFTDataset``). A bfloat16 engine's loss against a float32 forward of its
bfloat16 export differs by the engine's rounding: a few 1e-3 relative.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def export_nll(run: Path, step: int, device: str, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    from posttrain.trainers.config import SFTConfig, load_config
    from posttrain.trainers.data.sft_dataset import SFTDataset
    from posttrain.trainers.model_files import load_tokenizer

    cfg = load_config([], [str(run / "config.yaml")], root=SFTConfig)
    val = SFTDataset(cfg.data.val_files, load_tokenizer(cfg.model), cfg.data, key="data.val_files")
    hf_dir = run / f"global_step_{step}" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    nll = count = 0.0
    with torch.no_grad():
        for ids, mask in zip(val.input_ids, val.loss_mask):
            ids = torch.as_tensor(ids, device=device)
            mask = torch.as_tensor(mask, dtype=torch.float64, device=device)[1:]
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].double(), -1).gather(-1, ids[1:, None])[
                :, 0
            ]
            nll -= float((logp * mask).sum())
            count += float(mask.sum())
    return nll / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--rtol", type=float, default=1e-2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    args = p.parse_args(argv)
    rows = [
        json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    logged = [r for r in rows if "val/loss" in r]
    if not logged:
        raise SystemExit(
            f"{args.run}: no val/loss in metrics.jsonl (set data.val_files and trainer.test_freq)"
        )
    step, want = logged[-1]["step"], logged[-1]["val/loss"]
    got = export_nll(args.run, step, args.device, getattr(torch, args.dtype))
    rel = abs(got - want) / abs(want)
    print(f"step {step}: logged val/loss {want:.6f}, HF export's NLL {got:.6f} ({args.dtype}), rel {rel:.2e}")
    return 0 if rel <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())

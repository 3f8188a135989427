#!/usr/bin/env bash
# SFT with the FSDP2 engine on one node.
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct DATA_DIR=$HOME/data/gsm8k bash examples/sft_fsdp.sh [key=value ...]
#
# PRESET (default sft_gsm8k: bf16, cosine LR 1e-5, batch 64, 4 epochs) sets batch size, lengths and optimizer.
# Data: `posttrain data gsm8k --input <local gsm8k train file> --out $DATA_DIR` (and the test file), or
# `posttrain data synthetic --out $DATA_DIR`. With no GPU the run uses gloo on CPU: try it on the tiny model,
#   posttrain model init --size tiny --out /tmp/tiny
#   posttrain data synthetic --out /tmp/data
#   MODEL_PATH=/tmp/tiny DATA_DIR=/tmp/data NPROC=2 PRESET=sft_tiny bash examples/sft_fsdp.sh
# Extra arguments are config overrides and win over everything here.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a local Hugging Face model directory}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
SAVE_PATH=${SAVE_PATH:-$HOME/checkpoints/sft_fsdp/$(basename "$MODEL_PATH")}
PRESET=${PRESET:-sft_gsm8k}
NNODES=${NNODES:-1}
if command -v nvidia-smi >/dev/null 2>&1; then NGPU=$(nvidia-smi -L | wc -l); else NGPU=1; fi
NPROC=${NPROC:-$NGPU}
STRATEGY=${STRATEGY:-fsdp2}          # fsdp2 (per-parameter DTensor sharding) or fsdp (FSDP1)
FSDP_SIZE=${FSDP_SIZE:--1}           # -1 shards over all ranks; a divisor of the world size gives HSDP

# Batch size, lengths and the optimizer come from the preset ($PRESET); the arrays below set paths and layout.
DATA=(
    data.train_files="[$DATA_DIR/train.parquet]"
    data.val_files="[$DATA_DIR/test.parquet]"
    data.messages_key=messages
    data.truncation=error
)
MODEL=(
    model.path="$MODEL_PATH"
)
ENGINE=(
    model_engine="$STRATEGY"
    actor.engine.fsdp_size="$FSDP_SIZE"
)
TRAINER=(
    trainer.default_local_dir="$SAVE_PATH"
    trainer.project_name=${PROJECT:-gsm8k-sft}
    trainer.experiment_name=${EXPERIMENT:-sft-$(basename "$MODEL_PATH")-$STRATEGY}
    trainer.logger="${LOGGER:-[console,file]}"
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$NPROC"
)

torchrun --standalone --nnodes="$NNODES" --nproc_per_node="$NPROC" -m posttrain.trainers.sft \
    --config "$PRESET" "${DATA[@]}" "${MODEL[@]}" "${ENGINE[@]}" "${TRAINER[@]}" "$@"

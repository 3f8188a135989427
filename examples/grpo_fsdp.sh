#!/usr/bin/env bash
# GRPO with the FSDP2 engine on one node: posttrain's form of verl's `python -m verl.trainer.main_ppo
# model_engine=fsdp ...` (the same module layout: python -m posttrain.trainers.main_ppo, key=value overrides).
#
#   MODEL_PATH=/models/Qwen2.5-0.5B-Instruct DATA_DIR=$HOME/data/gsm8k bash examples/grpo_fsdp.sh [key=value ...]
#
# PRESET (default grpo_gsm8k: verl's GSM8K GRPO numbers, 1024 prompts x 5 responses, lr 1e-6, KL loss 0.001,
# bf16, vLLM rollout) sets batch sizes, lengths, the optimizer and the KL. ROLLOUT is vllm where vLLM imports and
# a GPU is present, else hf (transformers generate); with vllm the script stacks the vllm_gpu preset and
# rollout.tensor_model_parallel_size=$ROLLOUT_TP.
# Data: `posttrain data gsm8k --input <local gsm8k train parquet/jsonl> --out $DATA_DIR` and again with the test
# file (posttrain downloads nothing). No model at hand? `posttrain model init --size 0.5b --out /tmp/qwen-0.5b`
# writes a random-init model of Qwen2.5-0.5B's shape and vocabulary (1.5b too): it runs, it does not learn.
# On a CPU (gloo), the tiny model on the synthetic task:
#   posttrain model init --size tiny --out /tmp/tiny
#   posttrain data synthetic --out /tmp/data
#   MODEL_PATH=/tmp/tiny DATA_DIR=/tmp/data NPROC=1 PRESET=grpo_tiny bash examples/grpo_fsdp.sh trainer.total_training_steps=2
# Extra arguments are config overrides and win over everything here.
set -euo pipefail

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a local Hugging Face model directory}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
SAVE_PATH=${SAVE_PATH:-$HOME/checkpoints/grpo_fsdp/$(basename "$MODEL_PATH")}
PRESET=${PRESET:-grpo_gsm8k}
NNODES=${NNODES:-1}
if command -v nvidia-smi >/dev/null 2>&1; then NGPU=$(nvidia-smi -L | wc -l); else NGPU=1; fi
NPROC=${NPROC:-$NGPU}
STRATEGY=${STRATEGY:-fsdp2}          # fsdp2 (per-parameter DTensor sharding) or fsdp (FSDP1)
if [ -z "${ROLLOUT:-}" ]; then
    ROLLOUT=hf
    if command -v nvidia-smi >/dev/null 2>&1 && python -c "import vllm" >/dev/null 2>&1; then ROLLOUT=vllm; fi
fi
ROLLOUT_TP=${ROLLOUT_TP:-1}          # vLLM tensor parallel size; must divide NPROC

DATA=(
    data.train_files="[$DATA_DIR/train.parquet]"
    data.val_files="[$DATA_DIR/test.parquet]"
    data.prompt_key=prompt
)
MODEL=(
    model.path="$MODEL_PATH"
)
ENGINE=(
    model_engine="$STRATEGY"
)
ROLLOUT_ARGS=(
    rollout.name="$ROLLOUT"
)
PRESETS=(--config "$PRESET")
if [ "$ROLLOUT" = vllm ]; then  # vLLM's own keys: refused under rollout.name=hf
    PRESETS+=(--config vllm_gpu)
    ROLLOUT_ARGS+=(rollout.tensor_model_parallel_size="$ROLLOUT_TP")
fi
TRAINER=(
    trainer.default_local_dir="$SAVE_PATH"
    trainer.project_name=${PROJECT:-gsm8k-grpo}
    trainer.experiment_name=${EXPERIMENT:-grpo-$(basename "$MODEL_PATH")-$STRATEGY-$ROLLOUT}
    trainer.logger="${LOGGER:-[console,file]}"
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$NPROC"
)

torchrun --standalone --nnodes="$NNODES" --nproc_per_node="$NPROC" -m posttrain.trainers.main_ppo \
    "${PRESETS[@]}" algorithm.adv_estimator=grpo \
    "${DATA[@]}" "${MODEL[@]}" "${ENGINE[@]}" "${ROLLOUT_ARGS[@]}" "${TRAINER[@]}" "$@"

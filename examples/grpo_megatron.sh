#!/usr/bin/env bash
# GRPO with the Megatron engine (Megatron-Core through Megatron-Bridge) on one node: posttrain's form of verl's
# `python -m verl.trainer.main_ppo model_engine=megatron ...`. Needs GPUs and `pip install 'posttrain[megatron]'`
# (README.md, Installing); the rollout is vLLM where it imports, else hf.
#
#   MODEL_PATH=/models/Qwen2.5-7B-Instruct DATA_DIR=$HOME/data/gsm8k TP=2 bash examples/grpo_megatron.sh [key=value ...]
#
# PRESET (default grpo_gsm8k) sets batch sizes, lengths, the optimizer and the KL, as in examples/grpo_fsdp.sh.
# TP, PP and CP come from the environment and apply to the actor and the reference alike (every role must share
# the actor's layout); TP x PP x CP must divide NNODES x NPROC. MEGATRON_FSDP=1 shards both roles with
# Megatron-FSDP (ZeRO-3 on top of the TP/PP layout, PP=1; checkpoints in the fsdp_dtensor format), as the seed's
# Megatron-FSDP GRPO example does, and leaves CUDA_DEVICE_MAX_CONNECTIONS unset (Megatron-FSDP refuses 1). ROLLOUT_TP is vLLM's own tensor parallel size.
# Data: `posttrain data gsm8k --input <local file> --out $DATA_DIR` (train and test files). A random-init stand-in
# model: `posttrain model init --size 1.5b --out /tmp/qwen-1.5b`.
# Extra arguments are config overrides and win over everything here.
set -euo pipefail

MEGATRON_FSDP=${MEGATRON_FSDP:-0}
if [ "$MEGATRON_FSDP" = 1 ]; then
    unset CUDA_DEVICE_MAX_CONNECTIONS   # Megatron-FSDP needs it unset or > 1 (the engine refuses 1)
else
    export CUDA_DEVICE_MAX_CONNECTIONS=1   # lets Megatron overlap TP/SP communication with compute
fi
unset ROCR_VISIBLE_DEVICES

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a local Hugging Face model directory}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
SAVE_PATH=${SAVE_PATH:-$HOME/checkpoints/grpo_megatron/$(basename "$MODEL_PATH")}
PRESET=${PRESET:-grpo_gsm8k}
NNODES=${NNODES:-1}
if command -v nvidia-smi >/dev/null 2>&1; then NGPU=$(nvidia-smi -L | wc -l); else NGPU=1; fi
NPROC=${NPROC:-$NGPU}
TP=${TP:-1}
PP=${PP:-1}
CP=${CP:-1}
if [ -z "${ROLLOUT:-}" ]; then
    ROLLOUT=hf
    if python -c "import vllm" >/dev/null 2>&1; then ROLLOUT=vllm; fi
fi
ROLLOUT_TP=${ROLLOUT_TP:-$TP}

DATA=(
    data.train_files="[$DATA_DIR/train.parquet]"
    data.val_files="[$DATA_DIR/test.parquet]"
    data.prompt_key=prompt
)
MODEL=(
    model.path="$MODEL_PATH"
)
ENGINE=(model_engine=megatron)
for role in actor ref; do
    ENGINE+=(
        "$role.engine.tensor_model_parallel_size=$TP"
        "$role.engine.pipeline_model_parallel_size=$PP"
        "$role.engine.context_parallel_size=$CP"
        "$role.engine.vanilla_mbridge=false"
        "$role.engine.override_transformer_config.gradient_accumulation_fusion=false"
    )
    [ "$MEGATRON_FSDP" = 1 ] && ENGINE+=("$role.engine.use_megatron_fsdp=true")
done
ENGINE+=(actor.engine.use_distributed_optimizer=true)
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
    trainer.experiment_name=${EXPERIMENT:-grpo-$(basename "$MODEL_PATH")-megatron-tp$TP-pp$PP-$ROLLOUT}
    trainer.logger="${LOGGER:-[console,file]}"
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$NPROC"
)

torchrun --standalone --nnodes="$NNODES" --nproc_per_node="$NPROC" -m posttrain.trainers.main_ppo \
    "${PRESETS[@]}" algorithm.adv_estimator=grpo \
    "${DATA[@]}" "${MODEL[@]}" "${ENGINE[@]}" "${ROLLOUT_ARGS[@]}" "${TRAINER[@]}" "$@"

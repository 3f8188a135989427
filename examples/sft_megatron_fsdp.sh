#!/usr/bin/env bash
# SFT with the Megatron engine and Megatron-FSDP (ZeRO-3 sharding of params, grads and optimizer state on top
# of Megatron-Core's TP/PP/EP layout), through Megatron-Bridge. Needs GPUs and `pip install 'posttrain[megatron]'`.
#
#   MODEL_PATH=/models/Qwen2.5-Math-7B DATA_DIR=$HOME/data/gsm8k TP=4 bash examples/sft_megatron_fsdp.sh [key=value ...]
#
# TP, PP, EP (and CP) come from the environment; TP x PP x CP must divide NNODES x NPROC.
# Extra arguments are config overrides and win over everything here.
set -euo pipefail

unset CUDA_DEVICE_MAX_CONNECTIONS   # Megatron-FSDP needs it unset or > 1 (the engine refuses 1; TP/SP overlap wants 1)
unset ROCR_VISIBLE_DEVICES

MODEL_PATH=${MODEL_PATH:?set MODEL_PATH to a local Hugging Face model directory}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
SAVE_PATH=${SAVE_PATH:-$HOME/checkpoints/sft_megatron_fsdp/$(basename "$MODEL_PATH")}
NNODES=${NNODES:-1}
NPROC=${NPROC:-8}
TP=${TP:-4}
PP=${PP:-1}
EP=${EP:-1}
CP=${CP:-1}

DATA=(
    data.train_files="[$DATA_DIR/train.parquet]"
    data.val_files="[$DATA_DIR/test.parquet]"
    data.messages_key=messages
    data.train_batch_size=${TRAIN_BATCH_SIZE:-8}
    data.max_length=${MAX_LENGTH:-1024}
    data.truncation=error
)
MODEL=(
    model.path="$MODEL_PATH"
)
ENGINE=(
    model_engine=megatron
    actor.engine.tensor_model_parallel_size="$TP"
    actor.engine.pipeline_model_parallel_size="$PP"
    actor.engine.expert_model_parallel_size="$EP"
    actor.engine.context_parallel_size="$CP"
    actor.engine.vanilla_mbridge=false
    actor.engine.use_megatron_fsdp=true
    actor.engine.use_distributed_optimizer=true
    actor.engine.override_transformer_config.gradient_accumulation_fusion=false
    actor.engine.use_dynamic_bsz=true
    actor.engine.max_token_len_per_gpu=${MAX_TOKEN_LEN_PER_GPU:-1024}
)
OPTIM=(
    actor.optim.lr=${LR:-1e-5}
    actor.optim.weight_decay=0.1
    actor.optim.clip_grad=1.0
    actor.optim.betas="[0.9,0.95]"
    actor.optim.lr_decay_style=cosine
    actor.optim.min_lr=1e-6
)
TRAINER=(
    trainer.default_local_dir="$SAVE_PATH"
    trainer.project_name=${PROJECT:-gsm8k-sft}
    trainer.experiment_name=${EXPERIMENT:-SFT-$(basename "$MODEL_PATH")-mfsdp}
    trainer.logger="${LOGGER:-[console,file]}"
    trainer.total_epochs=${EPOCHS:-4}
    trainer.nnodes="$NNODES"
    trainer.n_gpus_per_node="$NPROC"
)

torchrun --standalone --nnodes="$NNODES" --nproc_per_node="$NPROC" -m posttrain.trainers.sft \
    "${DATA[@]}" "${MODEL[@]}" "${ENGINE[@]}" "${OPTIM[@]}" "${TRAINER[@]}" "$@"

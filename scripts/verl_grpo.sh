#!/usr/bin/env bash
# verl 0.9.1's GRPO (`python -m verl.trainer.main_ppo`, FSDP2 actor, vLLM 0.24 rollout) on the work of posttrain's
# `bench/rl_throughput.py --work readme` (same model, prompts, lengths and batch), for the lent GPU machine:
#
#   SHAPE=0.5b bash scripts/verl_grpo.sh [verl overrides ...]   # there, after the verl parts (scripts/verl_parts.sh)
#       # and a `SHAPE=... gpu_checks.sh readme` run (posttrain's arm) that made the model and prompts of that shape
#
#   bash scripts/verl_grpo.sh trainer.v1.trainer_mode=colocate_async trainer.v1.colocate_async.num_warmup_batches=1
#       # verl's asynchronous mode that fits one GPU (its one-step-off and fully-async recipes need a rollout pool
#       # of whole GPUs apart from the trainer's): generation goes on with partial rollouts until a batch is in,
#       # then vLLM sleeps, the actor trains, weights sync and the unfinished requests resume.
#
# Time: verl's start takes about 4.5 minutes on the H200 (Ray, TransferQueue, the vLLM server and its CUDA
# graphs, the actor and reference) and its first step took 6.4 (BENCHMARKS.md), so STEPS=2 or more outlives one
# 10-minute device call. Run it detached and read the log from later calls (a process that starts a new session
# survives its call while the machine stays warm):
#   (OUT=/tmp/verl-out STEPS=3 VERL_TIMEOUT=1500 setsid nohup bash scripts/verl_grpo.sh >/tmp/verl.txt 2>&1 &)
#   grep -c "step:" /tmp/verl-out/verl.log     # in the next calls
#
# The work: the model of shape SHAPE (0.5b, or 1.5b) and 256-token digit prompts under /tmp/rl_bench (rewritten
# with data_source openai/gsm8k so verl's default reward scores them), 128 prompts x 5 responses up to 1,024 tokens a step,
# mini-batches of 64 prompts, lr 1e-6, KL loss (low_var_kl, 0.001), bf16.
# verl's own performance settings for one GPU (its perf tuning guide docs/perf/perf_tuning.rst, the config defaults
# in verl/trainer/config/*.yaml, examples/grpo_trainer/run_qwen3_4b_fsdp.sh): remove padding (packed sequences),
# dynamic batch size with token budgets (ppo 16,384 tokens per GPU as posttrain's preset, at least the guide's
# 2 x (prompt + response); the forward-only log-prob passes 2x that, 32,768), verl's fused output head
# (model.use_fused_kernels, backend torch: log-probs and entropy from the hidden states in 512-token chunks),
# chunked prefill, vLLM CUDA graphs (enforce_eager=False) captured up to the 640 sequences of a step
# (rollout.cudagraph_capture_sizes; vLLM's own default stops at 512, so 640 running sequences decoded without
# graphs), free_cache_engine (vLLM sleeps while the actor trains), no parameter or optimizer offload (the model
# fits; verl keeps the forward-only reference's parameters on the CPU whatever the setting), FSDP forward
# prefetch and deferred gradient sync over micro-batches (the guide's FSDP items), vLLM at 0.6 of the memory
# and max_num_seqs 1024, gradient checkpointing off (what posttrain's policy chooses for this shape on an H200;
# the guide's checkpointing tip is for memory; VERL_GRAD_CKPT=True where posttrain's log shows it chose it on,
# as for the 1.5B shape on an 80 GB H100), verl's default V1 trainer (`trainer.use_v1=False` selects the
# deprecated ray_trainer path, which runs the same engine workers).
# Why the fused head: verl computes log-probs with flash-attn's Triton cross-entropy when flash-attn imports
# (verl/utils/torch_functional.py:35-39, 95-101) and otherwise with logprobs_from_logits_v2, a Python loop over
# every token row (torch_functional.py:173-205): 818k tokens a step, three times (old log-probs, reference,
# update with its backward), which is what made verl's step 1 actor phases 54 + 54 + 174 s with the GPU ~30%
# busy. verl's own environment has flash-attn 2.8.3 for torch 2.11 + CUDA 13 (pyproject.toml's fsdp extra, from
# verl's wheelhouse index, not PyPI); the bundle (scripts/verl_parts.sh) has none, so the fused head is the verl
# setting that takes the loop out. VERL_FUSED=triton picks verl's Triton kernel instead, VERL_FUSED=off the
# plain path (only sensible with flash-attn installed); VERL_CUDAGRAPH_MAX (640) sets the largest decode graph.
# One substitution: verl's default attention for the actor and reference is HF's flash_attention_2, which needs
# the flash-attn package, and flash-attn has no PyPI wheel for torch 2.11 + CUDA 13 (the image).
# bench/verl_torch_varlen.py registers the same packed computation with torch's varlen flash kernel (what
# posttrain's FSDP engine runs) and verl loads it through its own `model.external_lib` hook; the script checks it
# against SDPA on the GPU first. VERL_ATTN=sdpa runs HF's SDPA over a block-diagonal mask instead (slow: step 1's
# actor phases took over 2 minutes).
# Per-step metrics land in $OUT/verl.log (verl's console logger prints timing_s/gen, timing_s/step and
# perf/throughput each step).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"; mkdir -p "$out"
eval "$(bash /tmp/vstash/unpack.sh)"
export PYTHONPATH="$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"  # verl_torch_varlen, for verl's Ray workers too
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
model=/tmp/rl_bench/models/${SHAPE:-0.5b}-vdefault
src=$(ls "/tmp/rl_bench/data/${SHAPE:-0.5b}-vdefault-p256-r"*.parquet | tail -1) || {
  echo "verl_grpo.sh: no prompts for SHAPE=${SHAPE:-0.5b} under /tmp/rl_bench/data: run SHAPE=${SHAPE:-0.5b} bash scripts/gpu_checks.sh readme first" >&2; exit 1; }
data=/tmp/rl_bench/verl-data; mkdir -p "$data"
python3 - "$src" "$data/train.parquet" <<'PY'
import sys

import pyarrow as pa
import pyarrow.parquet as pq

t = pq.read_table(sys.argv[1])
t = t.set_column(t.schema.get_field_index("data_source"), "data_source", pa.array(["openai/gsm8k"] * t.num_rows))
pq.write_table(t, sys.argv[2])
PY
cp "$data/train.parquet" "$data/test.parquet"
attn="${VERL_ATTN:-torch_varlen}"
fused="${VERL_FUSED:-torch}"  # verl's fused output head backend: torch (hf_model.yaml's default), triton, or off
# vLLM's default decode graphs (1, 2, 4, 8..248 by 8, 256..512 by 16: the 51 sizes the log showed) extended by 16s
# to the 640 sequences a step runs (128 prompts x 5), as posttrain's rollout does (max_cudagraph_capture_size)
cg_max="${VERL_CUDAGRAPH_MAX:-640}"
cg="[1,2,4,$(seq -s, 8 8 248),$(seq -s, 256 16 "$cg_max")]"
if [ "$attn" = torch_varlen ]; then python3 bench/verl_torch_varlen.py || exit 1; fi
timeout "${VERL_TIMEOUT:-570}" python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \
  data.train_files="$data/train.parquet" data.val_files="$data/test.parquet" data.train_batch_size=128 \
  data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error \
  actor_rollout_ref.model.path="$model" actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.model.enable_gradient_checkpointing="${VERL_GRAD_CKPT:-False}" \
  `# verl/trainer/config/model/hf_model.yaml:60-68; perf_tuning.rst "fused kernels optimize the output head"` \
  actor_rollout_ref.model.use_fused_kernels="$([ "$fused" = off ] && echo False || echo True)" \
  actor_rollout_ref.model.fused_kernel_options.impl_backend="$([ "$fused" = off ] && echo torch || echo "$fused")" \
  actor_rollout_ref.model.external_lib="$([ "$attn" = torch_varlen ] && echo verl_torch_varlen || echo null)" \
  +actor_rollout_ref.model.override_config.attn_implementation="$attn" \
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.use_dynamic_bsz=True \
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.fsdp_config.param_offload=False \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.ref.fsdp_config.param_offload=False \
  `# perf_tuning.rst "Forward prefetch in FSDP training backend"; verl/utils/fsdp_utils.py honors it for fsdp2` \
  actor_rollout_ref.actor.fsdp_config.forward_prefetch=True \
  `# perf_tuning.rst "Reduce FSDP gradient synchronization"; FSDPEngineConfig's default (workers/config/engine.py)` \
  actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=True \
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=32768 \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5 \
  actor_rollout_ref.rollout.max_num_seqs=1024 actor_rollout_ref.rollout.enforce_eager=False \
  `# perf_tuning.rst "Balance performance and memory using cudagraph_capture_sizes"; rollout/rollout.yaml:54-58` \
  actor_rollout_ref.rollout.cudagraph_capture_sizes="$cg" \
  actor_rollout_ref.rollout.free_cache_engine=True actor_rollout_ref.rollout.enable_chunked_prefill=True \
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768 \
  trainer.critic_warmup=0 trainer.logger='["console"]' trainer.project_name=verl-bench trainer.experiment_name=readme \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps="${STEPS:-4}" trainer.val_before_train=False \
  trainer.test_freq=-1 trainer.save_freq=-1 trainer.default_local_dir=/tmp/verl-run "$@" 2>&1 \
  | tee "$out/verl.log" | grep -E "step:|Error|error" | cut -c1-2000 | tail -20

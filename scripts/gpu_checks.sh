#!/usr/bin/env bash
# The GPU checks of every package, for the lent GPU machine (or any CUDA box with torch, transformers, peft):
#   bash scripts/fetch_megatron_wheels.sh              # once, here: wheels into .whl/
#   uv build --all-packages --wheel --out-dir .whl     # here: posttrain's own wheels (entry points for the registry)
#   bash scripts/gpu_checks.sh tests|megatron|train|megathru|sync|push|ckpt|vllm|vllmsync   # there, with .whl carried;
#   results under $OUT (or ./gpu-out). vllm and vllmsync need the vLLM parts unpacked in /tmp/stash first.
#   bash scripts/gpu_checks.sh rl [bench/rl_throughput.py flags]   # GRPO steps; vLLM from /tmp/stash (vllm_parts.sh)
#   SHAPE=0.5b bash scripts/gpu_checks.sh readme [overrides]   # examples/grpo_fsdp.sh itself, work `rl --work readme`
#   bash scripts/gpu_checks.sh trl [bench/trl_grpo.py flags]       # the TRL peer; .trl-wheels carried too
#   bash scripts/gpu_checks.sh agents [bench/agent_throughput.py flags]   # async, stream and barrier agent loops,
#       0.5B, 256 episodes a batch, vLLM's default engine; vLLM from /tmp/stash; AGENT_TRL=1 adds TRL's
#       environment_factory (.trl-wheels carried too)
#   bash scripts/gpu_checks.sh agentgrpo   # `posttrain grpo` with the calculator env on vLLM, MODES="stream sync
#       sync:batched" (trainer.mode[:agent.loop])
#   bash scripts/gpu_checks.sh megatronrun sft|grpo   # the Megatron engine through the examples: 20 steps,
#       checkpoints, resume, HF export (Transformer Engine installed first)
#   bash scripts/gpu_checks.sh titan   # the TorchTitan engine's tests, sft and throughput; .titan-whl carried too
# Each part is short enough for one 10-minute call. Results are JSON/log files; BENCHMARKS.md records them.
# rl and trl append to /tmp/rl_bench/{rl,trl}.jsonl, which outlive a call while the machine stays warm (models
# and data there are made once), copy both to $OUT and print posttrain's step time over TRL's when both exist.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
eval "$(bash scripts/install_megatron_wheels.sh)"
export PYTHONPATH=/tmp/site  # the installed wheels carry the entry-point metadata the registries read
export PYTHONUNBUFFERED=1
rl_env() {  # vLLM from the carried parts (if unpacked), TRL from its wheels, nothing from the network
  if [ -f /tmp/stash/unpack.sh ]; then eval "$(bash /tmp/stash/unpack.sh)"
  else echo "gpu_checks: no /tmp/stash/unpack.sh: rollout=vllm runs will fail (scripts/vllm_parts.sh)" >&2; fi
  if [ -d .trl-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .trl-wheels/*.whl
  fi
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
  mkdir -p /tmp/rl_bench
  python3 - <<'PY' 2>&1 | tee -a "$out/versions.txt"
import importlib.metadata as m
for p in ("torch", "transformers", "accelerate", "huggingface-hub", "pyarrow", "fsspec", "vllm", "trl", "datasets"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        print(p, "missing")
PY
}
rl_report() {
  cp /tmp/rl_bench/*.jsonl "$out/" 2>/dev/null || true
  if [ -f /tmp/rl_bench/rl.jsonl ] && [ -f /tmp/rl_bench/trl.jsonl ]; then
    python3 bench/trl_grpo.py --report /tmp/rl_bench/rl.jsonl /tmp/rl_bench/trl.jsonl | tee "$out/vs_trl.txt"
  fi
}
nvidia-smi -L | tee "$out/gpus.txt"
# the device tool copies the working tree but may carry older git metadata: say when the files differ from HEAD
{ git rev-parse --short HEAD 2>/dev/null && { git diff --quiet HEAD 2>/dev/null || echo "(the files differ from it)"; }
} | tee "$out/commit.txt" || true
case "${1:-tests}" in
  tests)
    # one pytest per package: each tests/ folder has its own conftest module
    for t in engine-core/tests engine-fsdp/tests ckpt/tests rollout-hf/tests trainers/tests rollout-vllm/tests/test_transport.py; do
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider "packages/$t" 2>&1 | tail -15
    done 2>&1 | tee "$out/gpu_tests.log" ;;
  megatron)
    # engine-megatron's GPU tests, all in the folder: the 2-GPU ones (TP/PP/VPP parity, Megatron-FSDP checkpoint,
    # MoE, cross-backend; ~5-8 min, skipped on 1 GPU) and test_gpu_te.py (1 GPU, real Transformer Engine: TE layer
    # spec, HF parity fp32/bf16, Megatron-FSDP, MoE grouped GEMM + router replay; not timed yet, skipped until
    # `bash scripts/te_build_gpu.sh install ...` ran). With TE on 2 GPUs both may not fit one 590 s call:
    # MEGATRON_TESTS=packages/engine-megatron/tests/test_gpu_te.py runs only the TE tests.
    timeout 590 python3 -m pytest -q -m gpu -p no:cacheprovider ${MEGATRON_TESTS:-packages/engine-megatron/tests} 2>&1 \
      | tail -25 | tee "$out/gpu_megatron.log" ;;
  megatronrun)
    # SFT and GRPO through the examples with model_engine=megatron on the 0.5B shape (random init, the synthetic
    # arithmetic data): 20 steps with checkpoints at 10 and 20 (hf_model exported), then a run resumed from step 10,
    # compared by bench/resume_check.py (RTOL, ATOL; default 1e-3: GPU kernels need not repeat bits); SFT's export
    # is checked against its logged val/loss by bench/export_check.py. One part a call:
    #   bash scripts/gpu_checks.sh megatronrun sft    # examples/sft_megatron_fsdp.sh: Megatron-FSDP, fsdp_dtensor
    #   bash scripts/gpu_checks.sh megatronrun grpo   # examples/grpo_megatron.sh: vLLM (/tmp/stash), dist_ckpt
    #   (MEGATRON_FSDP=1 before it: GRPO with both roles on Megatron-FSDP, fsdp_dtensor)
    # Megatron-Bridge needs Transformer Engine: run `bash scripts/te_build_gpu.sh install ...` on the machine first.
    which=${2:?usage: gpu_checks.sh megatronrun sft|grpo [overrides]}; shift 2
    [ "$which" = grpo ] && rl_env
    d=/tmp/megatronrun; m=$d/model; mkdir -p "$d"
    [ -f "$m/config.json" ] || python3 -m posttrain.trainers.cli model init --size 0.5b --out "$m" >/dev/null
    [ -f "$d/data/test.parquet" ] || python3 -m posttrain.trainers.cli data synthetic --out "$d/data" \
      --num-train 4096 --num-test 64 >/dev/null
    for r in ref resumed; do
      run=$d/$which-$r; rm -rf "$run"; args=(trainer.total_training_steps=20 trainer.save_freq=10 trainer.test_freq=10
        "checkpoint.save_contents=[model,optimizer,extra,hf_model]" "trainer.logger=[console,file]")
      [ $r = resumed ] && args+=(trainer.resume_mode=resume_path "trainer.resume_from_path=$d/$which-ref/global_step_10")
      # GRPO at 16 prompts x 8 responses of up to 128 tokens, a quarter of the 32 x 8 x 256 that took 6.6 s a
      # step on an H100 after ~100 s of start-up (TE, Megatron, vLLM): that reference run alone outlasted 215 s
      [ "$which" = grpo ] && args+=(data.train_batch_size=16 actor.ppo_mini_batch_size=16 rollout.n=8
        rollout.response_length=128 trainer.val_before_train=false trainer.test_freq=-1)
      script=examples/sft_megatron_fsdp.sh; [ "$which" = grpo ] && script=examples/grpo_megatron.sh
      MODEL_PATH=$m DATA_DIR=$d/data SAVE_PATH=$run NPROC=1 TP=1 ROLLOUT=vllm timeout "${LIMIT:-280}" \
        bash $script "${args[@]}" "$@" > "$out/megatronrun_${which}_$r.log" 2>&1
      echo "== $which $r (rc $?)"; grep -E "posttrain\]|Error|error" "$out/megatronrun_${which}_$r.log" | tail -8
    done
    ls "$d/$which-ref/global_step_20/actor" "$d/$which-ref/global_step_20/actor/dist_ckpt" | head -20
    python3 bench/resume_check.py "$d/$which-ref" "$d/$which-resumed" --rtol "${RTOL:-1e-3}" --atol "${ATOL:-1e-3}" \
      | tail -12 | tee "$out/megatronrun_${which}_resume.txt"
    if [ "$which" = sft ]; then python3 bench/export_check.py "$d/sft-ref" | tee "$out/megatronrun_sft_export.txt"; fi ;;
  train)
    timeout 560 python3 bench/train_throughput.py --gpus 1,2 --compile-layers --out "$out/train.json" 2>&1 | tee "$out/train.log" | tail -40 ;;
  megathru)
    # the megatron engine (TP=1 and Megatron-FSDP DP=1, with TE installed also FP8 and TP=1 with TE hidden; TP=2 +
    # SP, Megatron-FSDP DP=2) next to the FSDP engine, on 1 and (where there are 2) 2 GPUs, same data, each run
    # in a process of its own
    # an 80 GB card (H100) takes 8,192 tokens per GPU and step: the local spec's TP=1 run peaks at ~100 GiB at 16,384
    gpus=1; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && gpus=1,2
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1); tokens=16384
    [ "$mem" -lt 100000 ] && tokens=8192
    # PROFILE=1: each run profiles one more step; the log ends with its kernel time by kind, run by run.
    # RUNS=megatron_tp1,fsdp_engine: only those runs (names: RUNS in bench/megatron_throughput.py). 12 timed
    # steps: at 6 the same run read 0.2328 and 0.2614 s/step in two launches on one H100
    timeout 580 python3 bench/megatron_throughput.py --gpus "${GPUS:-$gpus}" --tokens "${TOKENS:-$tokens}" \
      --steps "${STEPS:-12}" \
      ${PROFILE:+--profile} ${RUNS:+--runs "$RUNS"} --out "$out/megathru.json" 2>&1 \
      | tee "$out/megathru.log" | tail -30 ;;
  sync)
    timeout 200 python3 bench/weight_sync.py --bucket-mb 2048 --json "$out/ws1.json" 2>&1 | tee "$out/ws1.log" | tail -20
    timeout 200 python3 bench/weight_sync.py --gpus 2 --bucket-mb 2048 --json "$out/ws2.json" 2>&1 | tee "$out/ws2.log" | tail -20 ;;
  push)
    # the rollout process's push on one GPU: CUDA IPC into a worker on the trainer's GPU against host memory over gloo
    timeout 400 python3 bench/pair_push.py --device cuda --shape 1.5b --json "$out/push.json" 2>&1 | tee "$out/push.log" ;;
  ckpt)
    timeout 500 python3 bench/ckpt_throughput.py --dir /tmp/ckpt-bench --repeats 3 --unstaged --json "$out/ckpt.json" 2>&1 | tee "$out/ckpt.log" | tail -30 ;;
  vllm)
    # rollout-vllm against real vLLM (the parts in /tmp/stash, see docs/vllm-rollout.md), one pytest per file:
    # vLLM's CuMem allocator allows one sleep-mode engine per process.
    eval "$(bash /tmp/stash/unpack.sh)"
    # VLLM_TESTS="test_a test_b" runs only those files
    for t in ${VLLM_TESTS:-test_transport test_vllm_gpu test_vllm_load_plan_gpu test_vllm_inprocess test_vllm_tied test_vllm_processes test_external_launcher}; do
      echo "== $t"; timeout 300 python3 -m pytest -q -s -p no:cacheprovider "packages/rollout-vllm/tests/$t.py" 2>&1 \
        | tee -a "$out/vllm_full.log" | grep -E "passed|failed|rror|VLLM_GPU_MEMORY|^FAILED|^E " | head -30
    done 2>&1 | tee "$out/gpu_vllm.log" ;;
  vllmsync)
    eval "$(bash /tmp/stash/unpack.sh)"
    # the bucket checksum alone first (row hashes against the previous word checksum, same buckets): no vLLM needed
    # (8 files in $OUT in all with gpus.txt and commit.txt: a device call returns no more than 8)
    { timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider packages/engine-core/tests/test_weight_sync.py \
        2>&1 | tail -3; timeout 120 python3 bench/checksum.py --json "$out/checksum.json" 2>&1; } \
      | tee "$out/checksum.log"
    # the in-process run also prints a torch.profiler table of one more sync (whole output in vllm_sync_*.log)
    for ex in inprocess multiprocess; do
      prof=$([ $ex = inprocess ] && echo --profile)
      timeout 240 python3 bench/vllm_sync.py --executor $ex $prof --json "$out/vllm_sync_$ex.json" 2>&1 \
        | tee "$out/vllm_sync_$ex.log" | grep -A40 '^{'
    done ;;
  grpo)
    # `posttrain grpo` with the vLLM rollout and the FSDP2 actor in bf16: SIZE (posttrain model init --size), STEPS
    eval "$(bash /tmp/stash/unpack.sh)"
    d=/tmp/grpo-${SIZE:-small}; rm -rf "$d"
    python3 -m posttrain.trainers.cli model init --size "${SIZE:-small}" --out "$d/model" >/dev/null
    python3 -m posttrain.trainers.cli data synthetic --out "$d/data" --num-train 512 --num-test 64 >/dev/null
    timeout "${LIMIT:-400}" python3 -m posttrain.trainers.main_ppo --config grpo_tiny model.path="$d/model" \
      data.train_files="[$d/data/train.parquet]" data.val_files="[$d/data/test.parquet]" data.train_batch_size=32 \
      actor.ppo_mini_batch_size=32 rollout.name=vllm rollout.enforce_eager=false rollout.n=8 \
      rollout.dtype=bfloat16 actor.engine.dtype=bfloat16 ref.engine.dtype=bfloat16 actor.optim.lr=1e-5 \
      trainer.total_training_steps="${STEPS:-20}" trainer.test_freq=10 trainer.logger="[console,file]" \
      trainer.default_local_dir="$d/run" 2>&1 | tail -40 | tee "$out/grpo.log"
    cp "$d/run/metrics.jsonl" "$out/grpo_metrics.jsonl" 2>/dev/null || find "$d/run" -name metrics.jsonl -exec cp {} "$out/grpo_metrics.jsonl" \; ;;
  rl)
    # e.g. rl --work issue,bench --shapes 0.5b --rollouts vllm,hf --launchers torchrun (each run a subprocess)
    rl_env; shift
    timeout "${RL_TIMEOUT:-575}" python3 bench/rl_throughput.py --workdir /tmp/rl_bench --json /tmp/rl_bench/rl.jsonl \
      "$@" 2>&1 | tee "$out/rl.log" | grep -v '^{'
    rl_report ;;
  readme)
    # examples/grpo_fsdp.sh as the README runs it (grpo_gsm8k + vllm_gpu, torchrun) on the work of
    # `rl --work readme` (128 prompts x 5 responses up to 1,024 tokens, mini-batch 64) for the model shape SHAPE
    # (0.5b; 1.5b too): its random-init model and prompts are made under /tmp/rl_bench unless there already
    # (scripts/verl_grpo.sh runs verl on the same files afterwards)
    rl_env; shift
    shape="${SHAPE:-0.5b}"
    f=$(cd bench && python3 -c "from pathlib import Path; import rl_runs as r; w = Path('/tmp/rl_bench')
print(r.prepare_data(w, r.prepare_model(w, '$shape', None), r.WORKS['readme'], 640))" | tail -1) || exit 1
    d=/tmp/rl_bench/readme-data; mkdir -p "$d"
    ln -sf "$f" "$d/train.parquet"; ln -sf "$f" "$d/test.parquet"; rm -rf /tmp/rl_bench/readme-run
    MODEL_PATH="/tmp/rl_bench/models/$shape-vdefault" DATA_DIR="$d" SAVE_PATH=/tmp/rl_bench/readme-run ROLLOUT=vllm \
      timeout "${RL_TIMEOUT:-575}" bash examples/grpo_fsdp.sh data.train_batch_size=128 actor.ppo_mini_batch_size=64 \
      trainer.total_training_steps="${STEPS:-4}" trainer.val_before_train=false trainer.save_freq=-1 trainer.test_freq=-1 "$@" 2>&1 \
      | tee "$out/readme.log" | grep -E "posttrain\]|Error|error" | head -20
    cp /tmp/rl_bench/readme-run/metrics.jsonl "$out/readme_metrics.jsonl" 2>/dev/null
    python3 bench/rl_report.py /tmp/rl_bench/readme-run/metrics.jsonl | tee "$out/readme_steps.txt" ;;
  trl)
    # e.g. trl --work issue,bench --shapes 0.5b (vLLM colocate, torchrun with --gpus processes)
    rl_env; shift
    timeout "${RL_TIMEOUT:-575}" python3 bench/trl_grpo.py --workdir /tmp/rl_bench --json /tmp/rl_bench/trl.jsonl \
      "$@" 2>&1 | tee "$out/trl.log" | grep -v '^{'
    rl_report ;;
  agents)
    # bench/agent_throughput.py: the async agent loop, the episode stream (trainer.mode=stream's pool) and the
    # barrier loop on the same episodes (0.5B shape, 32 questions x 8, up to 4 turns, a 50 ms + [0, 50 ms] tool,
    # 3 batches a pass), on vLLM's default engine; each arm's itl_ms (time per decode step) and mean_in_flight
    # say whether a slow arm is starved or slow per step. --variant flags add engine variants, each on a fresh
    # engine (e.g. --variant 'default={}' --variant 'full_graphs={"compilation_config": {"cudagraph_mode":
    # "FULL"}}'). AGENT_TRL=1 adds TRL 1.16's environment_factory (bench/trl_agent.py, its own subprocess;
    # .trl-wheels carried). The model is made afresh in /tmp/agent_bench each call.
    rl_env; shift
    rm -rf /tmp/agent_bench
    variants=(--variant 'default={}')
    case " $* " in *" --variant"*) variants=() ;; esac
    trl=(); [ "${AGENT_TRL:-0}" = 1 ] && trl=(--trl)
    timeout "${RL_TIMEOUT:-590}" python3 bench/agent_throughput.py --device cuda "${trl[@]}" --workdir /tmp/agent_bench \
      "${variants[@]}" --out "$out/agents.json" "$@" 2>&1 | tee "$out/agents.log" | grep -E '^\[|Error|error' | tail -40
    cp /tmp/agent_bench/trl-run/log.txt "$out/agents_trl.log" 2>/dev/null || true ;;
  agentgrpo)
    # `posttrain grpo` with tools through the trainer: the calculator env (50 ms + [0, 50 ms] tools), agent.loop=async
    # over vLLM's server executor, the FSDP2 actor, for each of MODES (default "stream sync sync:batched": MODE
    # or MODE:LOOP for trainer.mode and agent.loop, async unless given), STEPS steps of
    # 32 tasks x 8 episodes up to 4 turns. The model is the agent bench's (run `agents` first in the same warm
    # machine), else the 0.5B shape with the bench's format fine-tuning. Logs and metrics.jsonl per mode. Arguments
    # after agentgrpo are overrides added to every mode's run; TAG (e.g. process) is added to their file names:
    #   MODES=stream TAG=process bash scripts/gpu_checks.sh agentgrpo trainer.rollout_placement=process \
    #     trainer.rollout_devices=[cuda:0]
    rl_env; shift
    m=/tmp/agent_bench/model; d=/tmp/agentgrpo; mkdir -p "$d"
    if [ ! -f "$m/config.json" ]; then
      m="$d/model"; rm -rf "$m"
      python3 -m posttrain.trainers.cli model init --size 0.5b --out "$m" >/dev/null
      python3 -c "import sys; sys.path.insert(0, 'bench'); import agent_throughput as a, trl_agent as t
t.add_tool_call_rendering('$m'); a.format_sft('$m', 'cuda', 200)" || exit 1
    fi
    python3 -m posttrain.trainers.cli data synthetic --task calculator --out "$d/data" --num-train 2048 --num-test 64 >/dev/null
    for spec in ${MODES:-stream sync sync:batched}; do  # MODE or MODE:LOOP (agent.loop, default async)
      mode=${spec%%:*}; loop=async; [ "$spec" != "$mode" ] && loop=${spec#*:}
      spec=${spec/:/_}${TAG:+_$TAG}; rm -rf "$d/run-$spec"
      timeout "${LIMIT:-280}" python3 -m posttrain.trainers.main_ppo --config grpo_gsm8k --config vllm_gpu model.path="$m" \
        data.train_files="[$d/data/train.parquet]" data.val_files="[$d/data/test.parquet]" data.train_batch_size=32 \
        rollout.n=8 actor.ppo_mini_batch_size=32 rollout.executor=server rollout.prompt_length=96 \
        rollout.response_length=512 agent.env=calculator agent.loop="$loop" agent.max_turns=4 agent.max_tokens_per_turn=128 \
        agent.env_kwargs.latency_s=0.05 agent.env_kwargs.jitter_s=0.05 trainer.mode="$mode" \
        trainer.total_training_steps="${STEPS:-6}" trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 \
        trainer.n_gpus_per_node=1 trainer.default_local_dir="$d/run-$spec" "$@" 2>&1 | tee "$out/agentgrpo_$spec.log" \
        | grep -E "posttrain\]|Error|error" | tail -15
      cp "$d/run-$spec/metrics.jsonl" "$out/agentgrpo_${spec}_metrics.jsonl" 2>/dev/null
      python3 bench/rl_report.py "$d/run-$spec/metrics.jsonl" 2>&1 | tee "$out/agentgrpo_${spec}_steps.txt"
    done ;;
  titan)
    # the TorchTitan engine on CUDA (.whl and .titan-whl carried: scripts/titan_wheels.sh): its tests, a 3-step
    # `posttrain sft` with model_engine=torchtitan on a tiny Qwen3, and bench/titan_throughput.py (1.7b, 1 GPU).
    # Expert parallelism needs 2+ ranks (EP all-to-all), so its check is not part of this one-GPU case.
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .titan-whl/*.whl
    timeout 220 python3 -m pytest -q -p no:cacheprovider packages/engine-torchtitan/tests 2>&1 | tail -25 \
      | tee "$out/titan_tests.log"
    d=/tmp/titan-sft; rm -rf "$d"
    python3 -m posttrain.trainers.cli model init --arch qwen3 --size tiny --out "$d/model" >/dev/null
    python3 -m posttrain.trainers.cli data synthetic --task arithmetic --digits 1 --num-train 64 --num-test 8 \
      --out "$d/data" >/dev/null
    timeout 120 python3 -m posttrain.trainers.cli sft --config sft_tiny model.path="$d/model" model_engine=torchtitan \
      data.train_files="[$d/data/train.parquet]" trainer.total_training_steps=3 trainer.default_local_dir="$d/run" \
      2>&1 | tail -20 | tee "$out/titan_sft.log"
    cp "$d/run/metrics.jsonl" "$out/titan_sft_metrics.jsonl" 2>/dev/null || echo "titan: no sft metrics" | tee -a "$out/titan_sft.log"
    timeout 220 python3 bench/titan_throughput.py --shape 1.7b --gpus 1 --rounds 2 --out "$out/titan.json" 2>&1 \
      | tail -20 | tee "$out/titan_bench.log" ;;
  titangrpo)
    # the README's command (examples/grpo_fsdp.sh, vLLM, README work) on a random Qwen3-0.6B-shaped model, with
    # STRATEGY=fsdp2 and then torchtitan in the same launch (.titan-whl carried): step times side by side
    rl_env; shift
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .titan-whl/*.whl
    m=/tmp/rl_bench/models/qwen3-0.6b; d=/tmp/rl_bench/qwen3-data; mkdir -p "$d"
    [ -f "$m/tokenizer.json" ] || python3 -m posttrain.trainers.cli model init --arch qwen3 --size 0.6b --out "$m"
    f=$(cd bench && python3 -c "from pathlib import Path; import rl_runs as r; print(r.prepare_data(Path('/tmp/rl_bench'), Path('$m'), r.WORKS['readme'], 640))")
    ln -sf "$f" "$d/train.parquet"; ln -sf "$f" "$d/test.parquet"
    for engine in ${ENGINES:-fsdp2 torchtitan}; do
      run=/tmp/rl_bench/qwen3-$engine; rm -rf "$run"
      MODEL_PATH=$m DATA_DIR="$d" SAVE_PATH=$run ROLLOUT=vllm STRATEGY=$engine timeout "${RL_TIMEOUT:-280}" \
        bash examples/grpo_fsdp.sh data.train_batch_size=128 actor.ppo_mini_batch_size=64 \
        trainer.total_training_steps="${STEPS:-3}" trainer.val_before_train=false trainer.save_freq=-1 \
        trainer.test_freq=-1 "$@" > "$out/qwen3_$engine.log" 2>&1
      echo "== $engine (rc $?)"; grep -E "Error|error" "$out/qwen3_$engine.log" | tail -5
      python3 bench/rl_report.py "$run/metrics.jsonl" | tee "$out/qwen3_${engine}_steps.txt"
    done ;;
  *) echo "usage: gpu_checks.sh tests|megatron|megatronrun|train|megathru|sync|push|ckpt|vllm|vllmsync|grpo|rl|readme|trl|agents|titan|titangrpo" >&2; exit 2 ;;
esac

"""TRL 1.16's multi-turn GRPO, ``GRPOTrainer(environment_factory=...)``, on bench/agent_throughput.py's
episodes.

The peer arm of ``bench/agent_throughput.py --trl``, which runs it as a subprocess in the same launch, on the
model it has just fine-tuned (:func:`run`, ``--worker`` is the subprocess). The work is posttrain's arms'
work:

- environment: posttrain's ``calculator`` (posttrain-envs) behind TRL's environment contract
  (:class:`CalculatorTask`): ``reset`` builds a fresh ``CalculatorEnv(latency_s, jitter_s)`` for every
  episode, as posttrain's agent loop does, and the class's one public method, ``calculator``, calls that env's
  tool (the same sleep of ``latency`` + uniform ``[0, jitter]`` from the same seed, the same evaluator, the
  same docstring). The reward is the env's: 1 when the last turn's ``####`` answer is the row's ground truth.
- tasks: the same ``calculator_rows(0, questions, seed=1, products=2)`` prompts, ``n`` generations each, all
  in one generation batch (``generation_batch_size`` = the episodes; one optimizer step per batch, beta 0).
- model and template: the same directory. Its chat template (:func:`add_tool_call_rendering`, applied by
  agent_throughput.py before the format fine-tune, so both arms use it) renders assistant ``tool_calls`` the
  way posttrain's traces write them, which TRL requires (``supports_tool_calling``); on every message
  posttrain renders it is posttrain's ChatML template byte for byte (checked). TRL has no response parser for
  a template it does not know; the tokenizer gets the one TRL picks for Qwen2.5's template (``qwen3_template``
  in ``trl.chat_template_utils``, Hermes ``<tool_call>{json}</tool_call>`` blocks), set on it as TRL's error
  asks.
- limits and sampling: up to ``max_turns`` assistant turns (``max_tool_calling_iterations = max_turns - 1``),
  128 new tokens a turn (``generation_kwargs``), 512 after the prompt (``max_completion_length``, posttrain's
  ``max_episode_tokens``), the same temperature, top-p 1, no top-k. vLLM's context is 736 tokens (TRL cuts an
  episode to its budget after a turn is sampled, so a turn may start at 96 + 512). The seeds differ (TRL seeds
  vLLM once, posttrain every request): the samples differ, their distribution does not.
- the ids: the first prompt's ids and a tool result's ids (TRL's ``_get_tool_suffix_ids``, posttrain's
  ``ChatRenderer.continuation``) were checked equal on the tiny model; both arms are token-in-token-out.

Generation: vLLM colocated in the trainer's process (``use_vllm=True, vllm_mode="colocate"``) with vLLM's
sleep mode off (with it on, TRL 1.16 re-pushes every weight and sleeps vLLM around each turn's generate;
posttrain's arms never sleep), or transformers' ``generate`` on a CPU (no vLLM), as bench/trl_grpo.py's CPU
check.

Measured per step, after ``warmup`` untimed steps (TRL's code unchanged; clocks are wrapped around methods of
the trainer instance):

- ``wall_s``: the time inside ``GRPOTrainer._generate`` (prompt rendering, every turn's generate, the tools,
  parsing) less weight sync. Scoring, log-probs and training are outside it, as posttrain's arms time
  ``run_episodes`` only. **Weight sync is out of the clock in both arms**: posttrain's arms sync nothing, and
  TRL's ``vllm_generation.sync_weights`` (first turn of every step) is clocked (``sync_s``) and subtracted.
- ``gpu_idle_s``: ``wall_s`` less the union of the intervals inside ``vllm_generation.generate`` (or the
  model's ``generate``): the seconds with no generation running, as posttrain's arms count those with no
  request in flight.
- ``model_tokens``: the sum of TRL's ``tool_mask`` (1 on sampled tokens, 0 on tool results; what its
  ``completions/mean_length`` averages), as posttrain sums its trajectories' loss masks: sampled tokens only.
- ``tool_calls``, ``malformed``, ``tool_errors``, ``turns_per_episode``, ``truncated``, ``reward_mean``: from
  the completions TRL hands its reward function. An assistant turn TRL returned without ``tool_calls`` in
  which posttrain's Hermes parser finds a ``<tool_call>`` block is a call TRL could not parse: each such block
  is a tool call and a malformed one, as posttrain counts them (TRL shows the model no error: the episode ends
  there).
  A tool message holding TRL's ``{'error': ...}`` (a tool that raised, an unknown tool) is an error; errors
  add to the malformed ones in ``tool_errors``, as posttrain's arms add theirs.
- ``tool_s``: the seconds spent in tool calls (TRL 1.16's tool loop calls each episode's tools in turn, so
  they add up) and ``step_s``, the whole optimizer step.

This arm alone, on a model bench/agent_throughput.py fine-tuned (``WORKDIR/model`` of its ``--workdir``; the
TRL run goes to ``WORKDIR/trl-run``), on a CPU::

    OMP_NUM_THREADS=1 uv run python bench/trl_agent.py --model-dir WORKDIR/model --device cpu \\
        --questions 4 --n 2 --repeats 1 --out /tmp/trl_agent.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

TURN_TOKENS, PROMPT_LEN, RESPONSE_LEN = 128, 96, 512
"""New tokens a turn, prompt tokens, tokens after the prompt (model and tools): both arms' limits."""

TOOL_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if 'function' in call else call -%}"
    "{{- '<tool_call>' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""posttrain's ChatML template plus assistant ``tool_calls`` rendered as Hermes blocks (what TRL requires)."""


def add_tool_call_rendering(model_dir: str) -> None:
    """Give the tokenizer in ``model_dir`` :data:`TOOL_CHATML`, after checking that it renders posttrain's
    calculator traces (user, assistant, tool messages) exactly as the template it had."""
    from transformers import AutoTokenizer

    from posttrain.trainers.data.synthetic import calculator_rows

    tok = AutoTokenizer.from_pretrained(model_dir)
    traces = [r["messages"] for r in calculator_rows(4, 0, products=2)["train"]]
    before = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in traces]
    old, tok.chat_template = tok.chat_template, TOOL_CHATML
    after = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in traces]
    if before != after:
        raise ValueError(
            f"{model_dir}'s chat template renders differently from TOOL_CHATML ({old[:60]!r}...): the bench "
            "expects posttrain's ChatML (posttrain model init)"
        )
    tok.save_pretrained(model_dir)


class CalculatorTask:
    """TRL's environment contract over posttrain's ``CalculatorEnv``; ``calculator`` is the only tool."""

    def __init__(self, latency_s: float, jitter_s: float, tool_seconds: list[float]) -> None:
        self._kwargs = {"latency_s": latency_s, "jitter_s": jitter_s}
        self._tool_seconds, self._env = tool_seconds, None

    def reset(self, **row: Any) -> None:
        """A fresh env per episode, as posttrain's loop builds one (the same jitter draws); the prompt is as
        is."""
        from posttrain.envs.calculator import CalculatorEnv

        self._env = CalculatorEnv(**self._kwargs)
        self._env.reset({"prompt": row["prompt"], "ground_truth": row["ground_truth"]})

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % and parentheses.

        Args:
            expression: The expression, e.g. "123 * 45".
        """
        start = time.perf_counter()
        try:
            return self._env.tools[0](expression)
        finally:
            self._tool_seconds.append(time.perf_counter() - start)


def episode_stats(completion: list[dict], last_id: int | None, eos: set[int], truth: str) -> dict[str, Any]:
    """One TRL episode's turns, tool calls, errors, truncation and reward (see the module docstring)."""
    from posttrain.envs.calculator import final_answer
    from posttrain.trainers.agents.parsers import HermesParser

    turns = [m for m in completion if m.get("role") == "assistant"]
    parsed = sum(len(m.get("tool_calls") or []) for m in turns)
    unread = 0
    for m in turns:
        if not m.get("tool_calls") and isinstance(m.get("content"), str):
            found = HermesParser().parse(m["content"])
            unread += len(found.calls) + len(found.malformed)
    errors = sum(
        1 for m in completion if m.get("role") == "tool" and str(m.get("content", "")).startswith("{'error'")
    )
    last = turns[-1] if turns else {}
    truncated = bool(last.get("tool_calls")) or last_id is None or last_id not in eos
    reward = float(not truncated and final_answer(str(last.get("content", ""))) == truth)
    return {
        "turns": len(turns),
        "tool_calls": parsed + unread,
        "malformed": unread,
        "tool_errors": unread + errors,
        "truncated": int(truncated),
        "reward": reward,
    }


def make_reward(log: list[dict[str, float]], eos: set[int]) -> Any:
    """The reward function TRL calls once per generation batch: scores each episode, appends the batch's
    stats."""

    def calculator_reward(completions, completion_ids, ground_truth, **_: Any) -> list[float]:
        rows = [
            episode_stats(c, ids[-1] if len(ids) else None, eos, str(t))
            for c, ids, t in zip(completions, completion_ids, ground_truth, strict=True)
        ]
        total = {k: sum(r[k] for r in rows) for k in rows[0]}
        total["turns_per_episode"] = total.pop("turns") / len(rows)
        total["reward_mean"] = total.pop("reward") / len(rows)
        log.append(total)
        return [r["reward"] for r in rows]

    return calculator_reward


def calculator_prompts(questions: int) -> list[dict[str, Any]]:
    """The bench's tasks, for both arms: ``questions`` two-product sums (``calculator_rows``' test split)."""
    from posttrain.trainers.data.synthetic import calculator_rows

    return calculator_rows(0, questions, seed=1, products=2)["test"]


class Clocks:
    """Intervals inside the trainer's generate calls and weight syncs; one row per ``_generate`` call."""

    def __init__(self, tool_seconds: list[float]) -> None:
        self.gen: list[tuple[float, float]] = []
        self.sync: list[tuple[float, float]] = []
        self.rollouts: list[dict[str, float]] = []
        self.tool_seconds = tool_seconds

    @staticmethod
    def wrap(obj: Any, name: str, into: list[tuple[float, float]]) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                into.append((start, time.perf_counter()))

        setattr(obj, name, timed)

    def attach(self, trainer: Any) -> None:
        """Clock the instance's generate (vLLM's or the model's), weight sync and ``_generate``."""
        vllm = getattr(trainer, "vllm_generation", None)
        if vllm is not None:
            self.wrap(vllm, "generate", self.gen)
            self.wrap(vllm, "sync_weights", self.sync)
        else:
            self.wrap(trainer.model, "generate", self.gen)
        rollout = trainer._generate

        @functools.wraps(rollout)
        def timed(prompts: list) -> Any:
            start, tools_before = time.perf_counter(), len(self.tool_seconds)
            out = rollout(prompts)
            self.record(start, time.perf_counter(), out, sum(self.tool_seconds[tools_before:]))
            return out

        trainer._generate = timed

    def record(self, start: float, end: float, out: tuple, tool_s: float) -> None:
        from agent_throughput import union_s

        completion_ids, tool_mask = out[1], out[2]
        sync = union_s(self.sync, start, end)
        wall = end - start - sync
        self.rollouts.append(
            {
                "wall_s": wall,
                "gpu_idle_s": wall - union_s(self.gen, start, end),
                "sync_s": sync,
                "tool_s": tool_s,
                "model_tokens": sum(map(sum, tool_mask)) if tool_mask else sum(map(len, completion_ids)),
            }
        )


def grpo_config(spec: dict[str, Any]) -> Any:
    """One generation batch of every episode per optimizer step; the limits and sampling of posttrain's
    arms."""
    from trl import GRPOConfig

    episodes = spec["questions"] * spec["n"]
    micro = max(d for d in range(1, 17) if episodes % d == 0)
    cuda = spec["device"] == "cuda"
    kwargs: dict[str, Any] = {"generation_kwargs": {"max_new_tokens": TURN_TOKENS}}
    if spec["vllm"]:
        kwargs = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=spec["vllm_mem"],
            vllm_enable_sleep_mode=False,
            vllm_max_model_length=PROMPT_LEN + RESPONSE_LEN + TURN_TOKENS,
            generation_kwargs={"max_tokens": TURN_TOKENS},
        )
    return GRPOConfig(
        output_dir=spec["run_dir"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=episodes // micro,
        generation_batch_size=episodes,
        num_generations=spec["n"],
        max_completion_length=RESPONSE_LEN,
        max_tool_calling_iterations=spec["max_turns"] - 1,
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=1e-6,
        beta=0.0,
        bf16=cuda,
        max_steps=spec["warmup"] + spec["steps"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        seed=1,
        use_cpu=not cuda,
        **kwargs,
    )


def tokenizer_for_trl(model_dir: str) -> Any:
    """The model's tokenizer with the Hermes response parser TRL uses for Qwen2.5's template, left padding."""
    import transformers
    from packaging.version import Version
    from trl.chat_template_utils import qwen3_schema, qwen3_template

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    if Version(transformers.__version__) >= Version("5.13.0.dev0"):
        tok.response_template = qwen3_template
    else:  # transformers before 5.13 parses with the legacy schema only
        tok.response_schema = qwen3_schema
    tok.padding_side = "left"
    return tok


def step_timer() -> Any:
    """A TrainerCallback recording each optimizer step's wall time."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.t0)

    return StepTimer()


def worker(spec_path: str) -> None:
    """Train ``warmup + steps`` GRPO steps with TRL and write this rank's per-step rows."""
    import os
    from importlib.metadata import version

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL's colocated vLLM lives in this process
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    tok = tokenizer_for_trl(spec["model"])
    rows = calculator_prompts(spec["questions"])
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )
    tool_seconds: list[float] = []
    batches: list[dict[str, float]] = []
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=make_reward(batches, {tok.eos_token_id, tok.pad_token_id}),
        args=grpo_config(spec),
        train_dataset=dataset,
        processing_class=tok,
        environment_factory=functools.partial(
            CalculatorTask, spec["tool_latency"], spec["tool_jitter"], tool_seconds
        ),
    )
    init_s = time.perf_counter() - start
    clocks, timer = Clocks(tool_seconds), step_timer()
    clocks.attach(trainer)
    trainer.add_callback(timer)
    trainer.train()
    steps = [{**r, **b, "step_s": s} for r, b, s in zip(clocks.rollouts, batches, timer.steps, strict=True)]
    rank = int(os.environ.get("RANK", "0"))
    result = {"rank": rank, "trl": version("trl"), "init_s": init_s, "all_steps": steps}
    Path(spec["result"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the launcher
def make_spec(args: argparse.Namespace, model_dir: str, run_dir: str) -> dict[str, Any]:
    """The worker's spec from this script's (or bench/agent_throughput.py's) arguments, checked."""
    vllm = args.device == "cuda" and getattr(args, "rollout", "vllm") == "vllm"
    checks = [
        (args.questions >= 1, f"--questions {args.questions}: use 1 or more"),
        (args.n >= 2, f"--n {args.n}: TRL's GRPO needs 2 or more generations per prompt; use --n 2 or more"),
        (args.max_turns >= 1, f"--max-turns {args.max_turns}: use 1 or more"),
        (args.repeats >= 1, f"--repeats {args.repeats}: TRL needs 1 or more timed steps"),
        (args.trl_warmup >= 0, f"--trl-warmup {args.trl_warmup}: use 0 or more"),
        (args.device != "cuda" or vllm, "--device cuda with --rollout hf: the TRL arm runs vLLM on a GPU"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return {
        "model": model_dir,
        "run_dir": run_dir,
        "device": args.device,
        "vllm": vllm,
        "vllm_mem": args.vllm_mem,
        "questions": args.questions,
        "n": args.n,
        "max_turns": args.max_turns,
        "tool_latency": args.tool_latency,
        "tool_jitter": args.tool_jitter,
        "temperature": args.temperature,
        "warmup": args.trl_warmup,
        "steps": args.repeats,
    }


def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Per timed step: the rows of :class:`Clocks` and the reward function, tokens/s/GPU; their means."""
    runs = []
    for step in result["all_steps"][warmup:]:
        row = dict(step)
        row["tokens_per_s_per_gpu"] = row["model_tokens"] / row["wall_s"]
        runs.append(row)
    if not runs:
        raise ValueError(
            f"TRL logged {len(result['all_steps'])} steps, none after the {warmup} warm-up steps"
        )
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    return {"trl": result["trl"], "init_s": result["init_s"], "runs": runs, "mean": mean}


def run(spec: dict[str, Any], timeout: int) -> dict[str, Any]:
    """The worker as a one-process torchrun subprocess (bench/rl_worker.py's launcher): its summary, or
    ``{"error": ...}`` with its log's tail."""
    from rl_worker import launch

    print(f"[trl-agent] TRL arm: {spec['questions'] * spec['n']} episodes ...", file=sys.stderr, flush=True)
    got = launch(spec, "torchrun", 1, Path(spec["run_dir"]), timeout, script=__file__)
    if isinstance(got, str):
        return {"error": got}
    return summarize(got[0], spec["warmup"])


def add_trl_args(p: argparse.ArgumentParser) -> None:
    """The TRL arm's own flags (bench/agent_throughput.py takes them too)."""
    p.add_argument("--trl-warmup", type=int, default=1, help="untimed TRL steps first (vLLM's first batch)")
    p.add_argument("--trl-timeout", type=int, default=900, help="seconds before the TRL subprocess is killed")
    p.add_argument("--vllm-mem", type=float, default=0.5, help="vLLM's gpu_memory_utilization (both arms)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="a model bench/agent_throughput.py fine-tuned (its --workdir's model)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--questions", type=int, default=32, help="prompts; episodes = questions x n")
    p.add_argument("--n", type=int, default=8, help="episodes per question (a GRPO group)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--tool-latency", type=float, default=0.05, help="seconds every tool call sleeps")
    p.add_argument("--tool-jitter", type=float, default=0.05, help="plus a uniform [0, this] draw")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2, help="timed TRL steps")
    add_trl_args(p)
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return None
    if not args.model_dir or not (Path(args.model_dir) / "config.json").is_file():
        raise ValueError(
            f"--model-dir {args.model_dir}: no model there; give the model bench/agent_throughput.py wrote "
            "(its --workdir/model)"
        )
    run_dir = str(Path(args.model_dir).resolve().parent / "trl-run")
    report = run(make_spec(args, str(Path(args.model_dir).resolve()), run_dir), args.trl_timeout)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()

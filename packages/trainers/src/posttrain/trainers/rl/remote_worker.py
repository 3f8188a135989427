"""The rollout worker process of ``trainer.rollout_placement=process`` (:mod:`.remote` is the trainer's side).

It leaves the trainer's torchrun world, builds the rollout (and, for
agents, :class:`.remote_agents.AgentHost`), then answers the trainer's calls over the pipe; weight pushes
arrive over the pair transport and are verified bucket by bucket (:class:`ReceivedWeights`).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.core.config import ModelConfig
from posttrain.core.dist_transport import PairBucketTransport, nccl_pair_group, pair_group, pair_store
from posttrain.core.rollout import BaseRollout, RolloutConfig, RolloutSample, serves_requests
from posttrain.core.weight_sync import BucketReceiver

_TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
)
"""torchrun's variables of the trainer's world; every ``TORCHELASTIC_*`` variable goes too
(:func:`leave_world`)."""


def leave_world(environ: dict[str, str]) -> list[str]:
    """Remove the trainer world's torchrun variables from ``environ`` (the worker's ``os.environ``); the names
    removed. ``TORCHELASTIC_USE_AGENT_STORE=True`` matters most: on torch 2.11 any ``tcp://`` rendezvous in a
    process that has it (vLLM's own world of one) connects as a client to a store nobody serves and hangs."""
    gone = [k for k in environ if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC_")]
    for key in gone:
        del environ[key]
    return gone


# ---------------------------------------------------------------------- the worker process
class ReceivedWeights:
    """The worker's weight stream: buckets received over the pair transport, verified by a
    :class:`BucketReceiver`, their tensors (copies) yielded a bucket at a time."""

    def __init__(self, transport: PairBucketTransport) -> None:
        self.transport, self.done, self.pending = transport, False, []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        receiver = BucketReceiver(lambda tensors: self.pending.extend((n, t.clone()) for n, t in tensors))
        while not self.done:
            bucket = self.transport.recv()
            self.done = bucket.is_last
            try:
                receiver(bucket)  # raises WeightSyncError on a bad checksum, a lost or reordered bucket
            finally:
                self.transport.release()  # the copies are taken: the trainer may pack the next bucket
            yield from self.pending
            self.pending.clear()
        receiver.finish()

    def drain(self) -> None:
        """Receive (and discard) the buckets left of this sync, so the trainer's send completes."""
        while not self.done:
            self.done = self.transport.recv().is_last
        self.transport.release()


class _Served:
    """What a worker serves: its rollout, the pair transport, and the agent loop when it hosts one."""

    def __init__(self, rollout: BaseRollout, transport: PairBucketTransport, agents: Any) -> None:
        self.rollout, self.transport, self.agents = rollout, transport, agents
        self.closed = False

    def close(self) -> None:
        """Stop the agent loop, release the rollout, close the transport (once)."""
        if self.closed:
            return
        self.closed = True
        if self.agents is not None:
            self.agents.close()
        self.rollout.release()
        self.transport.close()


def _update_weights(w: _Served, peft_config, base_sync_done, version) -> dict:
    stream = ReceivedWeights(w.transport)
    try:
        report = w.rollout.update_weights(
            iter(stream), peft_config=peft_config, base_sync_done=base_sync_done, version=version
        )
    finally:
        stream.drain()
    return {"version": w.rollout.weight_version(), "timings": report.timings}


def _generate(w: _Served, prompts, sampling) -> list[RolloutSample]:
    """The samples with their tensors in host memory (a GPU worker's would unpickle onto the trainer's
    GPUs)."""
    samples = w.rollout.generate(prompts, sampling)
    for s in samples:
        s.log_probs = s.log_probs.cpu()
        if s.routed_experts is not None:
            s.routed_experts = s.routed_experts.cpu()
    return samples


def _agents(w: _Served):
    if w.agents is None:
        raise ValueError(
            "this rollout process hosts no agent loop: start it with the run's agent config (agent.env set)"
        )
    return w.agents


_OPS = {
    "generate": _generate,
    "update_weights": _update_weights,
    "weight_version": lambda w: w.rollout.weight_version(),
    "sleep": lambda w, level: w.rollout.sleep(level),
    "wake_up": lambda w, tags: w.rollout.wake_up(tags),
    "play_episodes": lambda w, prompts, sampling: _agents(w).play(prompts, sampling),
    "stream": lambda w, method, args: _agents(w).stream_call(method, args),
}


def _error(exc: BaseException) -> tuple:
    return ("error", type(exc).__name__, str(exc), traceback.format_exc())


def _watch_parent(parent: int) -> None:
    """Kill this worker's process group (it, and whatever it started: vLLM's engine) once its trainer is gone
    (killed before it could close the pipe); polls once a second."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def worker_main(
    conn,
    config: RolloutConfig,
    model: ModelConfig | str,
    port: int,
    threads: int,
    timeout_s: float,
    deterministic: bool,
    gpu: str | None = None,
    nccl: bool = False,
    agent: tuple[Any, Any] | None = None,
    parent: int | None = None,
) -> None:
    """The worker process of trainer ``parent`` (pid): build the rollout (on the physical GPU ``gpu``, or the
    CPU) and, with ``agent`` (the agent config and the trainer's tokenizer), an agent loop over it; report
    ready, join the pair (bytes over NCCL with ``nccl``), then serve calls until ``close`` or until the
    trainer's end of the pipe closes. It leads a process group of its own, so the processes it starts (vLLM's
    engine core with ``rollout.executor=server``) go with it when its trainer dies."""
    os.setsid()  # its own group: a terminal's Ctrl-C reaches the trainer, which closes the worker
    threading.Thread(target=_watch_parent, args=(parent or os.getppid(),), daemon=True).start()
    leave_world(os.environ)
    device = "cpu"
    if gpu is not None:  # before anything starts CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"], device = gpu, "cuda:0"
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        if gpu is not None:
            torch.cuda.set_device(0)
        rollout = config.build(model, device=device, deterministic=deterministic)
        agents = None
        if agent is not None:
            from .remote_agents import AgentHost

            agents = AgentHost(agent[0], agent[1], config, rollout)
    except Exception as exc:  # reported to the trainer, which raises it
        conn.send_bytes(pickle.dumps(_error(exc)))
        return
    ready = {
        "supports_lora_adapters": bool(getattr(rollout, "supports_lora_adapters", False)),
        "serves_requests": serves_requests(rollout),
    }
    conn.send_bytes(pickle.dumps(("ok", ready)))
    store = pair_store(1, port, timeout_s=timeout_s)
    group = pair_group(store, 1, timeout_s)
    data = nccl_pair_group(store, 1, timeout_s) if nccl else None
    served = _Served(rollout, PairBucketTransport(group, 0, data, device, shared=not nccl), agents)
    try:
        _serve(conn, served)
    finally:
        served.close()


def _serve(conn, served: _Served) -> None:
    """Answer calls until ``close`` (answered once everything is released) or until the pipe closes."""
    while True:
        try:
            op, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if op == "close":
            served.close()
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            reply = pickle.dumps(("ok", _OPS[op](served, *args)))
        except Exception as exc:  # the op's error, or an answer that does not pickle
            reply = pickle.dumps(_error(exc))
        try:
            conn.send_bytes(reply)
        except (BrokenPipeError, ConnectionError, OSError):  # the trainer went away mid-call
            return

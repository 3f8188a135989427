"""``trainer.rollout_placement=process``: the rollout in a child process of each trainer rank.

:class:`RemoteRollout` is the trainer's side: a :class:`~posttrain.core.rollout.BaseRollout` whose every call
runs in a child process started with ``torch.multiprocessing`` (spawn), which builds the rollout by name
through the rollout registry, as the colocated trainer does, on its device (``trainer.rollout_devices``; the
CPU by default). A worker on a GPU sees only that GPU (its ``CUDA_VISIBLE_DEVICES`` is set to it before CUDA
starts), and the torchrun variables of the trainer's world are removed from its environment: it is not a
member. Calls and their results travel over a multiprocessing pipe, pickled (prompts and sampling in; samples,
with their log-probs as CPU tensors, out).

Weights go over a private pair of groups (:mod:`posttrain.core.dist_transport`: trainer rank 0 of the pair,
worker rank 1, rendezvous on a ``TCPStore`` on a free port; the trainer's own process group is not touched):
headers over gloo, and the bytes over NCCL, GPU to GPU, when the worker's GPU is not the trainer's. Otherwise
no bytes travel: the trainer packs each bucket into one buffer the worker maps
(:mod:`posttrain.core.shared_buffer`:
CUDA IPC on the trainer's GPU when the worker shares it, where NCCL cannot go; a shared-memory segment when
the worker is on the CPU), and the worker's release of each bucket lets the next one be packed. The push is
the bucketed, checksummed protocol of :mod:`posttrain.core.weight_sync`: the trainer's
:class:`~posttrain.core.weight_sync.BucketSender` packs the stream into buckets; the worker's
:class:`~posttrain.core.weight_sync.BucketReceiver` verifies every bucket's checksums and hands the tensors, a
bucket at a time, to the rollout's own ``update_weights`` (which loads them and, once the sync is complete,
serves the version). A refused bucket fails that sync in the worker; the worker still receives the remaining
buckets, so the trainer's send never blocks, and the trainer raises the worker's
:class:`~posttrain.core.weight_sync.WeightSyncError`.

Each trainer rank starts its own worker: a rank's rollout generates only that rank's prompts (seeded with its
data-parallel rank), so the worker is a drop-in for the colocated rollout and the trainer gathers nothing. A
worker that dies, does not answer within ``timeout_s`` or fails a call raises :class:`RolloutWorkerError`
naming it (with the worker's error and traceback).

With ``agent.env`` set, the worker also runs the agent loop (episodes, tools, ``env.step``; in stream mode the
episode pool), and the trainer gets finished episodes (:mod:`.remote_agents`). The worker is not a daemon, so
its rollout may start processes (vLLM's engine core, ``rollout.executor=server``); it leads its own process
group, which it kills when its trainer disappears, and the trainer ends it at exit
when :meth:`RemoteRollout.release` was not called. The worker's code is :mod:`.remote_worker`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.core.config import ModelConfig
from posttrain.core.dist_transport import PairBucketTransport, nccl_pair_group, pair_group, pair_store
from posttrain.core.dtypes import parse_dtype
from posttrain.core.rollout import BaseRollout, RolloutConfig, RolloutSample, SamplingConfig, SyncReport
from posttrain.core.shared_buffer import CudaIpcBuffer, SharedMemoryBuffer, shared_buffer
from posttrain.core.weight_sync import Bucket, BucketSender, WeightSyncError

from .remote_worker import worker_main


class RolloutWorkerError(RuntimeError):
    """The rollout worker process died, did not answer in time, or failed a call (its traceback included)."""


def physical_gpu(device: torch.device | str) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of CUDA ``device`` as this process numbers it (``cuda:1`` under
    ``CUDA_VISIBLE_DEVICES=4,5`` is ``5``), so a child process can be given that one GPU."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if index >= len(ids):
        raise ValueError(
            f"rollout device {device} is not among the {len(ids)} GPU(s) of "
            f"CUDA_VISIBLE_DEVICES={visible!r}: use cuda:0 to cuda:{len(ids) - 1}"
        )
    return ids[index]


# ---------------------------------------------------------------------- the trainer's side
def _placement(device: torch.device, trainer_device: torch.device) -> tuple[str | None, bool, torch.device]:
    """(the worker's physical GPU or None, whether the push goes over NCCL, where the trainer packs buckets)
    for a worker on ``device`` taking weights from ``trainer_device``: NCCL between two different GPUs; on one
    GPU a buffer there that the worker maps (CUDA IPC: NCCL refuses two members on one GPU); else host
    memory."""
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"rollout device {device}: this process sees {torch.cuda.device_count()} CUDA device(s); set "
            "trainer.rollout_devices to GPUs it sees (cuda:0 to cuda:N-1), or leave it empty for the CPU"
        )
    gpu = physical_gpu(device) if device.type == "cuda" else None
    trainer_gpu = physical_gpu(trainer_device) if trainer_device.type == "cuda" else None
    nccl = gpu is not None and trainer_gpu is not None and gpu != trainer_gpu
    same_gpu = gpu is not None and gpu == trainer_gpu
    return gpu, nccl, trainer_device if nccl or same_gpu else torch.device("cpu")


UNTIMED = ("play_episodes", "stream")
"""Calls without a deadline: a batch's episodes, and the episode pool's (a ``take`` waits for groups to
finish)."""


def _kill_group(process: Any) -> None:
    """SIGKILL the worker's process group (it leads one: :func:`.remote_worker.worker_main`), so nothing it
    started outlives it, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.join()


class RemoteRollout(BaseRollout):
    """The trainer's handle on a rollout worker process (see the module docstring). Calls are serialized by a
    lock, so the trainer's thread and the rollout thread of :mod:`.modes` may both use it."""

    def __init__(
        self,
        config: RolloutConfig,
        model: ModelConfig | str,
        *,
        threads: int = 0,
        rank: int = 0,
        timeout_s: float = 600.0,
        bucket_bytes: int | None = None,
        deterministic: bool = False,
        device: torch.device | str = "cpu",
        trainer_device: torch.device | str | None = None,
        agent: tuple[Any, Any] | None = None,
    ) -> None:
        """Start the worker and wait until its rollout is built and the gloo pair joined. ``threads``: the
        worker's torch intra-op threads (0: torch's default); ``rank`` names it; ``bucket_bytes``: the push's
        bucket size (default ``rollout.update_weights_bucket_megabytes``); ``deterministic``: passed to the
        rollout's constructor, with ``model`` (the trainer's model config or an HF directory); ``device``:
        where the worker builds its rollout (``cuda:N`` as this process numbers GPUs); ``trainer_device``:
        where the pushed weights live (a GPU other than ``device``'s: the bytes go over NCCL); ``agent``: (the
        agent config, the trainer's tokenizer) to run the agent loop in the worker (:mod:`.remote_agents`)."""
        gpu, nccl, self.send_device = _placement(torch.device(device), torch.device(trainer_device or "cpu"))
        self.config, self.timeout_s, self.lock = config, timeout_s, threading.Lock()
        self.broken: str | None = None
        """The call that was cut short (a timeout, an interrupt): the pipe is out of step from then on, and
        the worker is killed at release."""
        # the buffer the push packs into and the worker maps, made at the first push
        self.shared: SharedMemoryBuffer | CudaIpcBuffer | None = None
        self.store = pair_store(0, timeout_s=timeout_s)
        ready = self._start(
            rank, (config, model, self.store.port, threads, timeout_s, deterministic, gpu, nccl, agent)
        )
        self.supports_lora_adapters = ready["supports_lora_adapters"]
        self.serves_requests = ready["serves_requests"]
        """Whether the worker's rollout generates one request at a time (``agenerate``), as stream mode
        needs."""
        group = pair_group(self.store, 0, timeout_s)
        data = nccl_pair_group(self.store, 0, timeout_s) if nccl else None
        self.transport = PairBucketTransport(group, 1, data, self.send_device, shared=not nccl)
        self.bucket_bytes = bucket_bytes or config.update_weights_bucket_megabytes << 20
        self.dtype = parse_dtype(config.dtype, "rollout.dtype")

    def _start(self, rank: int, args: tuple) -> dict[str, Any]:
        """Spawn the worker (``worker_main(its end of the pipe, *args, this pid)``) and return its start-up
        report; a worker that fails to start is stopped and its error raised."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main,
            args=(child, *args, os.getpid()),
            name=f"posttrain-rollout-worker-{rank}",
            daemon=False,  # it may start processes of its own (vLLM's engine core); _at_exit ends it
        )
        self.process.start()
        atexit.register(self._at_exit)  # after multiprocessing's own exit hook, so it runs before that joins
        child.close()
        self.name = f"rollout worker of trainer rank {rank} (pid {self.process.pid})"
        try:
            return self._reply("start-up")
        except BaseException:
            self._stop()
            raise

    # ------------------------------------------------------------------ the pipe
    def _send(self, op: str, *args: Any) -> None:
        if self.broken is not None:
            raise RolloutWorkerError(
                f"{self.name} cannot {op}: it is out of step with the trainer since its {self.broken} was "
                "cut short; release it (it is killed) and start another"
            )
        if self.process is None or not self.process.is_alive():
            raise RolloutWorkerError(
                f"{self.name} is not running (exit code {self._exitcode()}): cannot {op}"
            )
        try:
            self.conn.send_bytes(pickle.dumps((op, args)))
        except (BrokenPipeError, ConnectionError, OSError) as exc:
            raise RolloutWorkerError(
                f"{self.name} closed its pipe (exit code {self._exitcode()}) at {op}"
            ) from exc

    def _reply(self, op: str) -> Any:
        """The worker's answer to ``op``; raises if it reports an error, dies, or exceeds the timeout (none
        for the agent calls of :data:`UNTIMED`, which wait as long as the worker lives, as the colocated loop
        does).
        Anything that stops the wait early leaves the worker :attr:`broken`."""
        try:
            reply = pickle.loads(self._wait(op, None if op in UNTIMED else self.timeout_s))
        except BaseException:
            self.broken = op  # an answer still to come would be read as the next call's
            raise
        if reply[0] == "ok":
            return reply[1]
        _, kind, message, worker_tb = reply
        if kind == "WeightSyncError":
            raise WeightSyncError(f"{self.name}: {message}")
        raise RolloutWorkerError(
            f"{self.name} failed in {op}: {kind}: {message}\n--- worker traceback ---\n{worker_tb}"
        )

    def _wait(self, op: str, limit: float | None) -> bytes:
        deadline = time.monotonic() + (limit if limit is not None else float("inf"))
        while True:
            if time.monotonic() >= deadline:
                raise RolloutWorkerError(f"{self.name} did not answer {op} within {limit:.0f} s")
            if self.conn.poll(0.2):
                break
            if not self.process.is_alive():
                raise self._died(op)
        try:
            return self.conn.recv_bytes()
        except (EOFError, OSError) as exc:  # its end closed: it exited, or is exiting
            raise self._died(op) from exc

    def _call(self, op: str, *args: Any) -> Any:
        with self.lock:
            self._send(op, *args)
            return self._reply(op)

    def _died(self, op: str) -> RolloutWorkerError:
        self.process.join(timeout=5)  # reap it, for its exit code
        _kill_group(self.process)  # what it started (vLLM's engine core) does not outlive it
        return RolloutWorkerError(f"{self.name} exited with code {self._exitcode()} during {op}")

    def _exitcode(self) -> int | None:
        return None if self.process is None else self.process.exitcode

    # ------------------------------------------------------------------ the rollout
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[RolloutSample]:
        return self._call("generate", [list(p) for p in prompts], sampling)

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        peft_config: dict[str, Any] | None = None,
        base_sync_done: bool = False,
        version: int | None = None,
    ) -> SyncReport:
        """Push the stream to the worker in checksummed buckets (each tensor cast to ``rollout.dtype`` as it
        is packed); returns what was sent. Raises unless the worker's rollout then serves ``version``."""
        with self.lock:
            self._send("update_weights", peft_config, base_sync_done, version)
            try:
                report = BucketSender(
                    self.transport,
                    self.bucket_bytes,
                    device=self.send_device,
                    dtype=self.dtype,
                    buffer=self._push_buffer(),
                ).send(weights)
            except Exception:
                self._abort_sync()
                raise
            except BaseException:  # interrupted mid-push: the worker waits for buckets that will not come
                self.broken = "update_weights"
                raise
            answer = self._reply("update_weights")
        if answer["version"] != version:
            raise WeightSyncError(
                f"{self.name} serves version {answer['version']} after the push of {version}"
            )
        report.timings.update(answer["timings"])
        return report

    def _push_buffer(self) -> torch.Tensor | None:
        """Where the push packs: a buffer the worker maps (made once), or None for NCCL (the sender's own)."""
        if not self.transport.shared:
            return None
        if self.shared is None:
            self.shared = shared_buffer(self.bucket_bytes, self.send_device)
        return self.transport.attach(self.shared)

    def _abort_sync(self) -> None:
        """After a failure on the trainer's side mid-push: end the worker's stream with an out-of-order bucket
        (the worker refuses it, so its rollout does not serve a partial sync) and consume its answer."""
        if not self.process.is_alive():
            raise self._died("update_weights")
        self.transport.send(Bucket(torch.empty(0, dtype=torch.uint8), [], -1, is_last=True))
        try:
            self._reply("update_weights")
        except WeightSyncError:
            pass

    def play_episodes(self, prompts: Sequence[Any], sampling: SamplingConfig) -> tuple[list, float, float]:
        """One batch's agent episodes played by the worker's agent loop: (episodes, detached; seconds
        generating; seconds in tools and the environment), as ``AgentLoop.run_episodes`` returns them."""
        return self._call("play_episodes", list(prompts), sampling)

    def episode_stream(self, **kwargs: Any):
        """Open the worker's episode pool (``trainer.mode=stream``); the trainer's handle on it."""
        from .remote_agents import RemoteEpisodeStream

        return RemoteEpisodeStream(self, **kwargs)

    def call_stream(self, method: str, *args: Any) -> Any:
        """One call of the worker's episode pool (:data:`.remote_agents.STREAM_CALLS`)."""
        return self._call("stream", method, args)

    @property
    def alive(self) -> bool:
        """Whether the worker process runs (not released, not dead)."""
        return self.process is not None and self.process.is_alive()

    def weight_version(self) -> int | None:
        """The version the worker's rollout serves (asked of the worker)."""
        return self._call("weight_version")

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake_up", list(tags) if tags is not None else None)

    def release(self) -> None:
        """Ask the worker to release its rollout and exit, and wait for it: raises unless it exited with code
        0 (a worker that does not exit within ``timeout_s`` is killed; one out of step, :attr:`broken`, is
        killed without being asked). Its process group goes with it. Does nothing once released."""
        process, closed = self.process, False
        if process is None:
            return
        try:
            if process.is_alive() and self.broken is None:
                self._call("close")
                closed = True
        finally:
            self._stop()
        if closed and process.exitcode != 0:
            raise RolloutWorkerError(f"{self.name} exited with code {process.exitcode} after close")

    def _at_exit(self) -> None:
        """At interpreter exit without :meth:`release`: close the pipe (the worker releases its rollout and
        exits), wait up to 30 s, then kill its process group."""
        process = self.process
        if process is None:
            return
        self.conn.close()
        process.join(timeout=0 if self.broken is not None else 30)
        _kill_group(process)

    def _stop(self) -> None:
        atexit.unregister(self._at_exit)
        process, self.process = self.process, None
        process.join(timeout=0 if self.broken is not None else self.timeout_s)
        hung = process.is_alive() and self.broken is None  # out of step: killed without being asked
        _kill_group(process)
        self.conn.close()
        if self.shared is not None:  # after the worker exited: it no longer maps the buffer
            self.shared.close()
            self.shared = None
        if hung:
            raise RolloutWorkerError(f"{self.name} did not exit within {self.timeout_s:.0f} s and was killed")

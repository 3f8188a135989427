"""``trainer.rollout_placement=process``: the rollout in a child process of each trainer rank.

:class:`RemoteRollout` is the trainer's side: a :class:`~posttrain.core.rollout.BaseRollout` whose every call
runs in a child process started with ``torch.multiprocessing`` (spawn), which builds the rollout by name through
the rollout registry, as the colocated trainer does, on its device (``trainer.rollout_devices``; the CPU by
default). A worker on a GPU sees only that GPU (its ``CUDA_VISIBLE_DEVICES`` is set to it before CUDA starts),
and the torchrun variables of the trainer's world are removed from its environment: it is not a member. Calls and
their results travel over a multiprocessing pipe, pickled (prompts and sampling in; samples, with their
log-probs as CPU tensors, out).

Weights go over a private pair of groups (:mod:`posttrain.core.dist_transport`: trainer rank 0 of the pair,
worker rank 1, rendezvous on a ``TCPStore`` on a free port; the trainer's own process group is not touched):
headers over gloo, and the bytes over NCCL, GPU to GPU, when the worker's GPU is not the trainer's. Otherwise no
bytes travel: the trainer packs each bucket into one buffer the worker maps (:mod:`posttrain.core.shared_buffer`:
CUDA IPC on the trainer's GPU when the worker shares it, where NCCL cannot go; a shared-memory segment when the
worker is on the CPU), and the worker's release of each bucket lets the next one be packed. The push is the
bucketed, checksummed protocol of :mod:`posttrain.core.weight_sync`: the trainer's
:class:`~posttrain.core.weight_sync.BucketSender` packs the stream into buckets; the worker's
:class:`~posttrain.core.weight_sync.BucketReceiver` verifies every bucket's checksums and hands the tensors, a
bucket at a time, to the rollout's own ``update_weights`` (which loads them and, once the sync is complete,
serves the version). A refused bucket fails that sync in the worker; the worker still receives the remaining
buckets, so the trainer's send never blocks, and the trainer raises the worker's
:class:`~posttrain.core.weight_sync.WeightSyncError`.

Each trainer rank starts its own worker: a rank's rollout generates only that rank's prompts (seeded with its
data-parallel rank), so the worker is a drop-in for the colocated rollout and the trainer gathers nothing. A
worker that dies, or does not answer within ``timeout_s``, raises :class:`RolloutWorkerError` naming it.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

from posttrain.core.config import ModelConfig
from posttrain.core.dist_transport import PairBucketTransport, nccl_pair_group, pair_group, pair_store
from posttrain.core.dtypes import parse_dtype
from posttrain.core.rollout import BaseRollout, RolloutConfig, RolloutSample, SamplingConfig, SyncReport
from posttrain.core.shared_buffer import CudaIpcBuffer, SharedMemoryBuffer, shared_buffer
from posttrain.core.weight_sync import Bucket, BucketReceiver, BucketSender, WeightSyncError


class RolloutWorkerError(RuntimeError):
    """The rollout worker process died, did not answer in time, or failed a call (its traceback included)."""


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
"""torchrun's variables of the trainer's world; every ``TORCHELASTIC_*`` variable goes too (:func:`leave_world`)."""


def leave_world(environ: dict[str, str]) -> list[str]:
    """Remove the trainer world's torchrun variables from ``environ`` (the worker's ``os.environ``); the names
    removed. ``TORCHELASTIC_USE_AGENT_STORE=True`` matters most: on torch 2.11 any ``tcp://`` rendezvous in a
    process that has it (vLLM's own world of one) connects as a client to a store nobody serves and hangs."""
    gone = [k for k in environ if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC_")]
    for key in gone:
        del environ[key]
    return gone


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
            f"rollout device {device} is not among the {len(ids)} GPU(s) of CUDA_VISIBLE_DEVICES={visible!r}: "
            f"use cuda:0 to cuda:{len(ids) - 1}"
        )
    return ids[index]


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


def _update_weights(rollout: BaseRollout, transport, peft_config, base_sync_done, version) -> dict:
    stream = ReceivedWeights(transport)
    try:
        report = rollout.update_weights(
            iter(stream), peft_config=peft_config, base_sync_done=base_sync_done, version=version
        )
    finally:
        stream.drain()
    return {"version": rollout.weight_version(), "timings": report.timings}


def _generate(rollout: BaseRollout, transport, prompts, sampling) -> list[RolloutSample]:
    """The samples with their tensors in host memory (a GPU worker's would unpickle onto the trainer's GPUs)."""
    samples = rollout.generate(prompts, sampling)
    for s in samples:
        s.log_probs = s.log_probs.cpu()
        if s.routed_experts is not None:
            s.routed_experts = s.routed_experts.cpu()
    return samples


_OPS = {
    "generate": _generate,
    "update_weights": _update_weights,
    "weight_version": lambda rollout, transport: rollout.weight_version(),
    "sleep": lambda rollout, transport, level: rollout.sleep(level),
    "wake_up": lambda rollout, transport, tags: rollout.wake_up(tags),
}


def _error(exc: BaseException) -> tuple:
    return ("error", type(exc).__name__, str(exc), traceback.format_exc())


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
) -> None:
    """The worker process: build the rollout (on the physical GPU ``gpu``, or the CPU), report ready, join the
    pair (bytes over NCCL with ``nccl``), then serve calls until ``close`` (or the trainer's end of the pipe
    closes)."""
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
    except Exception as exc:  # reported to the trainer, which raises it
        if isinstance(exc, AssertionError) and "daemonic" in str(exc):  # multiprocessing's refusal
            exc = ValueError(
                f"the rollout worker is a daemon process (it dies with its trainer), and the {config.name} "
                "rollout tried to start processes of its own: with trainer.rollout_placement=process use an "
                "in-process engine (vLLM: rollout.executor=inprocess)"
            )
        conn.send_bytes(pickle.dumps(_error(exc)))
        return
    ready = {"supports_lora_adapters": bool(getattr(rollout, "supports_lora_adapters", False))}
    conn.send_bytes(pickle.dumps(("ok", ready)))
    store = pair_store(1, port, timeout_s=timeout_s)
    group = pair_group(store, 1, timeout_s)
    data = nccl_pair_group(store, 1, timeout_s) if nccl else None
    transport = PairBucketTransport(group, 0, data, device, shared=not nccl)
    while True:
        try:
            op, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if op == "close":
            rollout.release()
            transport.close()
            conn.send_bytes(pickle.dumps(("ok", None)))
            break
        try:
            reply = ("ok", _OPS[op](rollout, transport, *args))
        except Exception as exc:
            reply = _error(exc)
        conn.send_bytes(pickle.dumps(reply))


# ---------------------------------------------------------------------- the trainer's side
def _placement(device: torch.device, trainer_device: torch.device) -> tuple[str | None, bool, torch.device]:
    """(the worker's physical GPU or None, whether the push goes over NCCL, where the trainer packs buckets) for
    a worker on ``device`` taking weights from ``trainer_device``: NCCL between two different GPUs; on one GPU a
    buffer there that the worker maps (CUDA IPC: NCCL refuses two members on one GPU); else host memory."""
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
    ) -> None:
        """Start the worker and wait until its rollout is built and the gloo pair joined. ``threads``: the
        worker's torch intra-op threads (0: torch's default); ``rank`` names it; ``bucket_bytes``: the push's
        bucket size (default ``rollout.update_weights_bucket_megabytes``); ``deterministic``: passed to
        the rollout's constructor, with ``model`` (the trainer's model config or an HF directory); ``device``: where the worker builds its
        rollout (``cuda:N`` as this process numbers GPUs); ``trainer_device``: where the pushed weights live (a
        GPU other than ``device``'s: the bytes go over NCCL)."""
        gpu, nccl, self.send_device = _placement(torch.device(device), torch.device(trainer_device or "cpu"))
        ctx = mp.get_context("spawn")
        self.config, self.timeout_s, self.lock = config, timeout_s, threading.Lock()
        # the buffer the push packs into and the worker maps, made at the first push
        self.shared: SharedMemoryBuffer | CudaIpcBuffer | None = None
        self.store = pair_store(0, timeout_s=timeout_s)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=worker_main,
            args=(
                child,
                config,
                model,
                self.store.port,
                threads,
                timeout_s,
                deterministic,
                gpu,
                nccl,
            ),
            name=f"posttrain-rollout-worker-{rank}",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.name = f"rollout worker of trainer rank {rank} (pid {self.process.pid})"
        try:
            ready = self._reply("start-up")
        except BaseException:
            self._stop()
            raise
        self.supports_lora_adapters = ready["supports_lora_adapters"]
        group = pair_group(self.store, 0, timeout_s)
        data = nccl_pair_group(self.store, 0, timeout_s) if nccl else None
        self.transport = PairBucketTransport(group, 1, data, self.send_device, shared=not nccl)
        self.bucket_bytes = bucket_bytes or config.update_weights_bucket_megabytes << 20
        self.dtype = parse_dtype(config.dtype, "rollout.dtype")

    # ------------------------------------------------------------------ the pipe
    def _send(self, op: str, *args: Any) -> None:
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
        """The worker's answer to ``op``; raises if it reports an error, dies, or exceeds the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise self._died(op)
            if time.monotonic() > deadline:
                raise RolloutWorkerError(f"{self.name} did not answer {op} within {self.timeout_s:.0f} s")
        try:
            reply = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:  # its end closed: it exited, or is exiting
            raise self._died(op) from exc
        if reply[0] == "ok":
            return reply[1]
        _, kind, message, worker_tb = reply
        if kind == "WeightSyncError":
            raise WeightSyncError(f"{self.name}: {message}")
        raise RolloutWorkerError(
            f"{self.name} failed in {op}: {kind}: {message}\n--- worker traceback ---\n{worker_tb}"
        )

    def _call(self, op: str, *args: Any) -> Any:
        with self.lock:
            self._send(op, *args)
            return self._reply(op)

    def _died(self, op: str) -> RolloutWorkerError:
        self.process.join(timeout=5)  # reap it, for its exit code
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
        """Push the stream to the worker in checksummed buckets (each tensor cast to ``rollout.dtype`` as it is
        packed); returns what was sent. Raises unless the worker's rollout then serves ``version``."""
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

    def weight_version(self) -> int | None:
        """The version the worker's rollout serves (asked of the worker)."""
        return self._call("weight_version")

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake_up", list(tags) if tags is not None else None)

    def release(self) -> None:
        """Ask the worker to release its rollout and exit, and wait for it: raises unless it exited with code
        0 (a worker that does not exit within ``timeout_s`` is killed). Does nothing once released."""
        process, closed = self.process, False
        if process is None:
            return
        try:
            if process.is_alive():
                self._call("close")
                closed = True
        finally:
            self._stop()
        if closed and process.exitcode != 0:
            raise RolloutWorkerError(f"{self.name} exited with code {process.exitcode} after close")

    def _stop(self) -> None:
        process, self.process = self.process, None
        process.join(timeout=self.timeout_s)
        self.conn.close()
        if self.shared is not None:  # after the worker exited: it no longer maps the buffer
            self.shared.close()
            self.shared = None
        if process.is_alive():
            process.kill()
            process.join()
            raise RolloutWorkerError(f"{self.name} did not exit within {self.timeout_s:.0f} s and was killed")

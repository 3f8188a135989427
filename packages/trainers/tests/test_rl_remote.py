"""trainer.rollout_placement=process, below the trainer: a real rollout worker process (the HF rollout on the
tiny model) takes weights through a shared-memory bucket (headers over the gloo pair) and generates what the
colocated rollout generates, refuses a bucket whose bytes were corrupted in the transport, reports its own
errors, exits with code 0 at release, and a killed worker raises an error naming it instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sft_fixtures import make_tiny_model

from posttrain.core.rollout import SamplingConfig
from posttrain.core.weight_sync import WeightSyncError
from posttrain.rollout_hf.config import HFRolloutConfig
from posttrain.trainers.rl.remote import RemoteRollout, RolloutWorkerError

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CONFIG = HFRolloutConfig(response_length=8, update_weights_bucket_megabytes=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("remote")))


@pytest.fixture(scope="module")
def worker(model_path):
    remote = RemoteRollout(CONFIG, model_path, threads=1, timeout_s=120, bucket_bytes=1 << 18)
    yield remote
    remote.release()


def _trained_weights(model_path) -> dict[str, torch.Tensor]:
    """The tiny model's weights, moved off their initial values (so a push visibly changes the rollout)."""
    local = CONFIG.build(model_path, device="cpu")
    gen = torch.Generator().manual_seed(0)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        for k, v in local.model.state_dict().items()
    }


class CorruptingTransport:
    """Flips one byte of each bucket after the sender computed its checksums, then sends it on."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def send(self, bucket) -> None:
        bucket.buffer[bucket.metas[0].offset] ^= 0xFF
        self.inner.send(bucket)

    def __getattr__(self, name):  # the rest (shared, attach) is the wrapped transport's
        return getattr(self.inner, name)


def _sampling(seed: int):
    sampling = CONFIG.sampling()
    sampling.seed = seed
    return sampling


def test_pushed_weights_are_served_and_generate_like_the_colocated_rollout(worker, model_path):
    weights = _trained_weights(model_path)
    report = worker.update_weights(iter(weights.items()), version=7)
    assert worker.weight_version() == 7
    assert report.num_buckets > 1 and report.num_tensors == len(weights)  # 256 KiB buckets: several
    assert worker.shared.kind == "shm" and worker.transport.shared  # packed where the worker reads it
    local = CONFIG.build(model_path, device="cpu")
    local.update_weights(iter(weights.items()), version=7)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    torch.set_num_threads(1)  # the worker's thread count: the same ops on the same threads are bitwise equal
    ours, theirs = local.generate(prompts, _sampling(11)), worker.generate(prompts, _sampling(11))
    assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    assert all(torch.equal(a.log_probs, b.log_probs) for a, b in zip(ours, theirs))


def test_a_bucket_corrupted_in_the_transport_is_refused(worker, model_path):
    weights = _trained_weights(model_path)
    worker.update_weights(iter(weights.items()), version=1)
    clean, worker.transport = worker.transport, CorruptingTransport(worker.transport)
    try:
        with pytest.raises(WeightSyncError, match=r"rollout worker .*pid .*checksum mismatch"):
            worker.update_weights(iter(weights.items()), version=2)
    finally:
        worker.transport = clean
    assert worker.weight_version() is None, "a refused sync leaves no version served"
    with pytest.raises(RolloutWorkerError, match="the HF rollout has no valid weights"):
        worker.generate([[1, 2, 3]], _sampling(0))
    worker.update_weights(iter(weights.items()), version=3)  # the pair is still in step: a clean push works
    assert worker.weight_version() == 3


def test_an_error_in_the_worker_names_it_and_the_worker_serves_on(worker):
    with pytest.raises(
        RolloutWorkerError, match=r"rollout worker of trainer rank 0 .*ValueError.*at least one"
    ):
        worker.generate([[]], _sampling(0))
    assert worker.weight_version() is not None


def test_a_killed_worker_raises_an_error_naming_it(model_path):
    remote = RemoteRollout(CONFIG, model_path, threads=1, timeout_s=60)
    pid = remote.process.pid
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=rf"rollout worker .*pid {pid}.* -9"):
        remote.generate([[1, 2, 3]], _sampling(0))
    assert time.monotonic() - start < 10
    remote.release()  # nothing left to close: returns


def test_a_call_cut_short_leaves_the_worker_out_of_step_and_release_kills_it(model_path):
    """A timed-out call's answer would be read as the next call's: later calls are refused, naming the call
    cut short, and release kills the worker at once instead of asking it to close."""
    remote = RemoteRollout(CONFIG, model_path, threads=1, timeout_s=60)
    process = remote.process
    remote.timeout_s = 0.0
    with pytest.raises(RolloutWorkerError, match=r"did not answer generate within 0 s"):
        remote.generate([[1, 2, 3]], _sampling(0))
    with pytest.raises(
        RolloutWorkerError, match=r"cannot weight_version: .*since its generate was cut short"
    ):
        remote.weight_version()
    start = time.monotonic()
    remote.release()
    assert time.monotonic() - start < 10 and process.exitcode == -signal.SIGKILL


def test_release_exits_the_worker_with_code_zero(worker):
    process = worker.process
    worker.release()
    assert process.exitcode == 0 and worker.process is None
    worker.release()  # idempotent


def _remote_code_copy(model_path: str, root) -> str:
    """The tiny model as a custom architecture whose code lives in the model folder (``auto_map``), as models
    that need ``trust_remote_code`` are shipped."""
    import json
    import shutil

    out = root / "remote-code-model"
    shutil.copytree(model_path, out)
    (out / "configuration_tiny.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass TinyConfig(Qwen2Config):\n"
        "    model_type = 'tiny_remote'\n"
    )
    (out / "modeling_tiny.py").write_text(
        "from transformers import Qwen2ForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(Qwen2ForCausalLM):\n    config_class = TinyConfig\n"
    )
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        architectures=["TinyForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        },
    )
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_the_rollout_trusts_remote_code_when_model_trust_remote_code_says_so(model_path, tmp_path):
    """``model.trust_remote_code=true`` reaches the rollout the trainer builds, colocated and in its worker
    process; without it the same folder is refused by transformers."""
    from posttrain.trainers.config import load_config
    from posttrain.trainers.rl.modes import build_rollout

    path = _remote_code_copy(model_path, tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code"):
        CONFIG.build(path, device="cpu")
    for placement in ("colocated", "process"):
        cfg = load_config(
            [
                f"model.path={path}",
                "model.trust_remote_code=true",
                "trainer.mode=one_step_off",
                f"trainer.rollout_placement={placement}",
                "rollout.response_length=4",
            ],
            presets=["grpo_tiny"],
        )
        rollout = build_rollout(cfg, device="cpu")
        try:
            samples = rollout.generate([[1, 2, 3]], SamplingConfig(temperature=0.0, max_new_tokens=4))
            assert len(samples) == 1 and 1 <= len(samples[0].response_ids) <= 4, placement
        finally:
            rollout.release()


def test_rollout_devices_pick_this_ranks_device_and_name_the_gpu_for_the_child(monkeypatch):
    """One entry per trainer process on the node, by local rank (none: the trainer's device); a GPU is handed
    to the worker as the CUDA_VISIBLE_DEVICES entry the trainer's numbering points at."""
    from posttrain.trainers.rl.modes import rollout_device
    from posttrain.trainers.rl.remote import physical_gpu

    assert rollout_device([]) == "cpu"
    assert rollout_device([], "cuda:0") == "cuda:0"  # empty: the trainer rank's own device
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rollout_device(["cuda:2", "cuda:3"]) == "cuda:3"
    with pytest.raises(
        ValueError, match=r"has 1 entries for 2 trainer process\(es\).*one device per process"
    ):
        rollout_device(["cuda:2"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert physical_gpu("cuda:3") == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert physical_gpu("cuda:1") == "5"
    with pytest.raises(ValueError, match=r"cuda:2 is not among the 2 GPU\(s\).*use cuda:0 to cuda:1"):
        physical_gpu("cuda:2")


def test_a_rollout_device_this_process_cannot_see_is_refused_before_the_worker_starts(model_path):
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"rollout device cuda:{count}: this process sees {count} CUDA"):
        RemoteRollout(CONFIG, model_path, device=f"cuda:{count}")


def _gpu_push_and_generate(model_path, rollout_device: str, trainer_device: str, nccl: bool) -> None:
    """A worker whose HF rollout runs on ``rollout_device`` takes weights pushed from ``trainer_device`` and
    generates the greedy tokens of a rollout in this process that loaded the same weights."""
    weights = {k: v.to(trainer_device) for k, v in _trained_weights(model_path).items()}
    remote = RemoteRollout(
        CONFIG,
        model_path,
        timeout_s=300,
        bucket_bytes=1 << 18,
        device=rollout_device,
        trainer_device=trainer_device,
    )
    try:
        assert (remote.transport.data is not None) is nccl and remote.transport.shared is not nccl
        assert remote.send_device == torch.device(trainer_device)
        remote.update_weights(iter(weights.items()), version=1)
        assert remote.weight_version() == 1
        if not nccl:  # the push packed into a CUDA buffer of the trainer's GPU that the worker mapped
            assert remote.shared.kind == "cuda_ipc" and remote.shared.tensor.device == torch.device(
                trainer_device
            )
        local = CONFIG.build(model_path, device=trainer_device)
        local.update_weights(iter(weights.items()), version=1)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
        prompts = [[1, 2, 3], [4, 5, 6, 7]]
        theirs = remote.generate(prompts, greedy)
        assert all(s.log_probs.device.type == "cpu" for s in theirs)
        assert [s.response_ids for s in local.generate(prompts, greedy)] == [s.response_ids for s in theirs]
    finally:
        remote.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_worker_on_the_trainers_gpu_takes_weights_over_cuda_ipc(model_path):
    _gpu_push_and_generate(model_path, "cuda:0", "cuda:0", nccl=False)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_worker_on_another_gpu_takes_weights_over_nccl(model_path):
    _gpu_push_and_generate(model_path, "cuda:1", "cuda:0", nccl=True)


def test_the_worker_leaves_the_trainers_torchrun_world():
    """What torchrun exports for the trainer's ranks is gone from the worker's environment, the elastic
    agent's store flag included (with it, torch 2.11's tcp:// rendezvous in the worker, vLLM's world of one,
    waits for a store nobody serves); the rest stays."""
    from posttrain.trainers.rl.remote_worker import leave_world

    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "PATH": "/usr/bin",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    gone = leave_world(env)
    assert env == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}
    assert "TORCHELASTIC_USE_AGENT_STORE" in gone and len(gone) == 7


TRAINER = """
import sys, time
from posttrain.rollout_hf.config import HFRolloutConfig
from posttrain.trainers.rl.remote import RemoteRollout
if __name__ == "__main__":  # the spawned worker imports this file too
    remote = RemoteRollout(HFRolloutConfig(response_length=8), sys.argv[1], threads=1, timeout_s=120)
    print(remote.process.pid, flush=True)
    if sys.argv[2] == "killed":
        time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """The process exited (a zombie nobody reaped counts: the container's init may not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_worker_ends_with_a_trainer_that_exits_without_release_or_is_killed(model_path, tmp_path):
    """The worker is not a daemon (its rollout may start processes: vLLM's engine core), so nothing in
    multiprocessing ends it: a trainer that exits without release still exits (its exit hook closes the pipe),
    and a SIGKILLed trainer's worker exits too."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    trainers = {
        how: subprocess.Popen(
            [sys.executable, str(script), model_path, how], stdout=subprocess.PIPE, text=True
        )
        for how in ("exits", "killed")
    }
    try:
        workers = {how: int(p.stdout.readline()) for how, p in trainers.items()}
        trainers["killed"].kill()
        assert trainers["exits"].wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert {how: _gone(pid) for how, pid in workers.items()} == {"exits": True, "killed": True}
    finally:
        for p in trainers.values():
            p.kill()
            p.wait()


BUSY_TRAINER = """
import sys
from transformers import AutoTokenizer
from posttrain.rollout_hf.config import HFRolloutConfig
from posttrain.trainers.agents.config import AgentConfig
from posttrain.trainers.rl.dataset import Prompt
from posttrain.trainers.rl.remote import RemoteRollout
if __name__ == "__main__":
    config = HFRolloutConfig(response_length=8)
    agent = AgentConfig(env="remote_fixtures:RunsAProgram", env_kwargs={"pidfile": sys.argv[2]})
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    remote = RemoteRollout(config, sys.argv[1], threads=1, timeout_s=120, agent=(agent, tokenizer))
    print(remote.process.pid, flush=True)
    prompt = Prompt([1, 2], "calc", "3", {}, [{"role": "user", "content": "1+2?"}])
    remote.play_episodes([prompt], config.sampling())  # its reset runs `sleep 300`
"""


def test_a_killed_trainers_busy_worker_dies_with_the_process_it_started(model_path, tmp_path):
    """The worker is in a call (an episode's reset running a program) when its trainer is SIGKILLed: it cannot
    see the pipe close, so its watchdog kills its process group, the program included, within seconds."""
    script, pidfile = tmp_path / "trainer.py", tmp_path / "program.pid"
    script.write_text(BUSY_TRAINER)
    paths = [str(Path(__file__).parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    trainer = subprocess.Popen(
        [sys.executable, str(script), model_path, str(pidfile)], stdout=subprocess.PIPE, text=True, env=env
    )
    worker = program = None
    try:
        worker = int(trainer.stdout.readline())
        deadline = time.monotonic() + 60
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        program = int(pidfile.read_text())
        assert not _gone(program) and not _gone(worker)
        trainer.kill()
        trainer.wait()
        start = time.monotonic()
        while not (_gone(worker) and _gone(program)) and time.monotonic() - start < 15:
            time.sleep(0.2)
        assert {"worker": _gone(worker), "program": _gone(program)} == {"worker": True, "program": True}
    finally:
        trainer.kill()
        trainer.wait()
        for pid, group in ((worker, True), (program, False)):  # left over only when the test failed
            if pid is not None and not _gone(pid):
                (os.killpg if group else os.kill)(pid, signal.SIGKILL)

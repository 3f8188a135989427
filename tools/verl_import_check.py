"""Check the verl bundle (scripts/verl_parts.sh) imports with only the GPU image's packages beside it, here.

The GPU machine cannot download, so a module the bundle lacks shows up there as a lost device call. This runs the
imports verl's GRPO launch makes (the trainer, its FSDP workers, the vLLM server rollout, the agent loop) in a
child interpreter that sees the unpacked bundle first and then only those packages of this workspace's venv that
the image also has (tools/device_image_packages.txt); packages the image has but the venv lacks are installed into
a scratch folder first (with the base interpreter's pip: a uv venv has none). The venv's versions stand in for the image's, so a version check can still differ there.

    uv run python tools/verl_import_check.py [DIR]   # unpacks .verl-parts into DIR (/tmp/verlsite-check) once
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "verl.trainer.main_ppo",
    "verl.trainer.ppo.ray_trainer",
    "transfer_queue",
    "verl.trainer.ppo.v1.trainer_sync",
    "verl.trainer.ppo.v1.trainer_colocate_async",
    "verl.workers.engine_workers",
    "verl.experimental.agent_loop",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
    "vllm.entrypoints.serve.instrumentator.metrics",  # imported when verl launches the vLLM HTTP server
    "verl.utils.reward_score",
]
# on the image, absent from the workspace venv, imported by ray or verl at start
IMAGE_ONLY = ["msgpack", "click", "filelock", "protobuf", "pyyaml", "requests"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_site(dest: Path) -> None:
    """Link every top-level entry of this venv's distributions that the image also has into ``dest``."""
    listed = (ROOT / "tools" / "device_image_packages.txt").read_text().split("\n")
    image = {norm(n) for n in listed if n and not n.startswith("#")}
    site = Path(sysconfig.get_paths()["purelib"])
    for dist in md.distributions(path=[str(site)]):
        if norm(dist.metadata["Name"]) not in image:
            continue
        for top in {f.parts[0] for f in dist.files or []}:
            src, dst = site / top, dest / top
            if top != ".." and src.exists() and not dst.exists():
                dst.symlink_to(src)


def unpack(bundle: Path) -> None:
    """The base layer into ``bundle/base`` and the extra layer into ``bundle/extra``, as the parts' unpack.sh does."""
    parts = sorted((ROOT / ".verl-parts").glob("p*/part.*"), key=lambda p: int(p.suffix[1:]))
    extra = list((ROOT / ".verl-parts").glob("p*/extra.tgz"))
    if not parts or len(extra) != 1:
        raise SystemExit("no complete .verl-parts: run `bash scripts/verl_parts.sh` first")
    (bundle / "base").mkdir(parents=True)
    (bundle / "extra").mkdir()
    cat = subprocess.Popen(["cat", *map(str, parts)], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-xJf", "-", "-C", str(bundle / "base")], stdin=cat.stdout, check=True)
    subprocess.run(["tar", "-xzf", str(extra[0]), "-C", str(bundle / "extra")], check=True)


def main() -> int:
    bundle = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/verlsite-check")
    if not (bundle / "base" / "verl").is_dir():
        unpack(bundle)
    scratch = Path(tempfile.mkdtemp(prefix="verl-imports-"))
    (scratch / "image").mkdir()
    image_site(scratch / "image")
    pip = [
        sys._base_executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--target",
        str(scratch / "extra"),
    ]
    subprocess.run([*pip, *IMAGE_ONLY], check=True)
    layers = [bundle / "extra", bundle / "base", scratch / "image", scratch / "extra"]
    path = os.pathsep.join(map(str, layers))
    code = (
        "import importlib, sys\nbad = 0\n"
        f"for m in {MODULES!r}:\n"
        "    try:\n        importlib.import_module(m); print('ok  ', m)\n"
        "    except Exception as e:\n        bad += 1; print('FAIL', m, type(e).__name__, str(e)[:300])\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-S", "-c", code], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())

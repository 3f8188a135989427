"""The record a run leaves of what it trained with: ``<trainer.default_local_dir>/config.yaml``.

The file is the resolved config tree as YAML (every key, defaults included), under a comment header that names
the installed versions of posttrain's packages, Python, torch, transformers and the backend packages present
(vllm, megatron-core, megatron-bridge) and the command that reruns it. YAML comments are not keys, so
``posttrain sft|ppo|grpo --config <that file>`` loads the same tree (a resumed run rewrites the file).
"""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path
from typing import Any

from posttrain.core.config.loader import to_yaml

CONFIG_FILE = "config.yaml"
THIRD_PARTY = ("torch", "transformers", "vllm", "megatron-core", "megatron-bridge")
"""Packages whose versions are recorded when installed, besides every ``posttrain-*`` distribution."""


def installed_versions() -> dict[str, str]:
    """{distribution: version} of posttrain's packages and of :data:`THIRD_PARTY` (those installed)."""
    found = {
        d.metadata["Name"]: d.version
        for d in distributions()
        if (d.metadata["Name"] or "").lower().startswith("posttrain")
    }
    for name in THIRD_PARTY:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return {"python": platform.python_version(), **dict(sorted(found.items()))}


def write_run_record(cfg: Any, directory: str | Path, command: str) -> Path:
    """Write ``cfg`` (a dataclass config tree) to ``directory/config.yaml`` with the versions header;
    ``command`` is the ``posttrain`` subcommand that reruns it. Returns the file's path."""
    path = Path(directory) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    header = [
        f"# The resolved config of a posttrain run (written {stamp}).",
        f"# Rerun: posttrain {command} --config {path}",
        "# Installed versions:",
        *(f"#   {name}: {ver}" for name, ver in installed_versions().items()),
    ]
    path.write_text("\n".join(header) + "\n" + to_yaml(cfg))
    return path

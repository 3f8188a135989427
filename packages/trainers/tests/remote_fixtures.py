"""An environment for the rollout-process tests: its ``reset`` runs a program (as a code-running tool would)
and waits for it, so the worker is busy in a call, with a process of its own, when its trainer is killed."""

from __future__ import annotations

import subprocess
from pathlib import Path

from posttrain.core.env import Environment


class RunsAProgram(Environment):
    def __init__(self, pidfile: str) -> None:
        self.pidfile = Path(pidfile)

    def reset(self, row):
        child = subprocess.Popen(["sleep", "300"])
        partial = self.pidfile.with_suffix(".partial")
        partial.write_text(str(child.pid))
        partial.rename(self.pidfile)  # whole, or not there
        child.wait()
        return super().reset(row)

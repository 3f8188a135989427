"""The ``posttrain`` command: ``--help`` imports no torch, ``--timing`` reports the start-up time."""

from __future__ import annotations

import subprocess
import sys


def test_help_imports_no_torch():
    code = (
        "import sys\n"
        "from posttrain.trainers.cli import main\n"
        "assert main(['--help']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: posttrain [--timing] <command>" in out and out.strip().endswith("False"), out


def test_timing_reports_imports_and_run(capsys):
    from posttrain.trainers.cli import main

    assert main(["--timing", "config", "show", "model_engine=fsdp2"]) == 0
    captured = capsys.readouterr()
    assert "strategy: fsdp2" in captured.out
    assert "[posttrain] config: imports " in captured.err and " s, run " in captured.err

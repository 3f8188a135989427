"""Metrics tracking: every backend writes something readable, offline; resume trims metrics.jsonl; the PNG."""

from __future__ import annotations

import json

import pytest

from posttrain.trainers.logging import Tracker, plot_metrics, read_metrics
from posttrain.trainers.logging.backends import import_backend

STEPS = [
    {
        "train/loss": 3.0 - 0.5 * s,
        "train/grad_norm": 1.0 / (s + 1),
        "train/lr": 1e-3,
        "perf/tokens_per_s": 100.0 + s,
    }
    for s in range(4)
]


def _log_run(tmp_path, backends, resume_step=0, steps=range(1, 5)):
    tracker = Tracker(
        backends,
        local_dir=tmp_path,
        project="proj",
        experiment="exp",
        config={"a": {"b": 1}},
        total_steps=4,
        resume_step=resume_step,
    )
    for step in steps:
        metrics = dict(STEPS[step - 1])
        if step == 4:
            metrics["val/loss"] = 1.25
        tracker.log(metrics, step)
    return tracker.finish()


def test_console_and_file_write_jsonl_and_png(tmp_path, capsys):
    png = _log_run(tmp_path, ["console", "file"])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["train/loss"] == 3.0 and rows[3]["val/loss"] == 1.25 and "val/loss" not in rows[0]
    assert png == tmp_path / "metrics.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    err = capsys.readouterr().err
    assert "step 4: val/loss=1.25" in err and "4/4" in err and "loss=1.5" in err


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    _log_run(tmp_path, ["file"])
    _log_run(tmp_path, ["file"], resume_step=2, steps=range(3, 5))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_tensorboard_scalars_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_run(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "exp"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [3.0, 2.5, 2.0, 1.5]


@pytest.mark.slow
def test_wandb_offline_and_mlflow_local_store(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _log_run(tmp_path, ["wandb", "mlflow"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("proj").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 3.0), (2, 2.5), (3, 2.0), (4, 1.5)]
    assert list((tmp_path / "mlruns").rglob("config.json"))


def test_disabled_tracker_writes_nothing_and_missing_backend_hint(tmp_path):
    tracker = Tracker(["file", "console"], local_dir=tmp_path, enabled=False)
    tracker.log({"train/loss": 1.0}, 1)
    assert tracker.finish() is None and not (tmp_path / "metrics.jsonl").exists()
    with pytest.raises(ImportError, match="pip install nope_pkg, or remove nope from trainer.logger"):
        import_backend("posttrain_no_such_module", "nope", "nope_pkg")
    with pytest.raises(ValueError, match="unknown backend 'stdout'"):
        Tracker(["stdout"], local_dir=tmp_path)


def test_plot_skips_nonfinite_and_empty(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "other": 2.0}) + "\n")
    assert plot_metrics(path) is None
    path.write_text("".join(json.dumps({"step": s, "actor/loss": 1.0 / s}) + "\n" for s in range(1, 4)))
    assert plot_metrics(path, tmp_path / "x.png") == tmp_path / "x.png"

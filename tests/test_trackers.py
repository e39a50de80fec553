"""Experiment trackers with the real libraries, offline: what a training run logs is read back and
matches metrics.jsonl; a resume logs each step once; a broken tracker does not stop training."""

import json
import struct
from pathlib import Path

import pytest

from dflash_ray import storage
from dflash_ray.errors import DFlashError
from dflash_ray.train import trackers
from dflash_ray.train.trackers import Trackers
from test_train import SETTINGS, data, target  # noqa: F401  (the tiny training run's fixtures)

CONFIG = {"train": {"lr": 0.003, "layer_types": ["full_attention"], "node_resource": ""}, "seed": 0}


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_history(path) -> list[dict]:
    """The history rows of a `.wandb` file: LevelDB-log records (32 KiB blocks, 7-byte headers)
    holding `Record` protobufs, after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, part, rows = Path(path).read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        part += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_a_tracker_that_is_not_installed_is_refused_naming_the_extra(monkeypatch):
    trackers.check_installed(["tensorboard", "wandb", "mlflow"])
    monkeypatch.setitem(trackers.MODULES, "wandb", "no_such_module_for_wandb")
    with pytest.raises(DFlashError) as e:
        trackers.check_installed(["tensorboard", "wandb"])
    assert e.value.field == "train.trackers" and "['wandb']" in str(e.value)
    assert "pip install 'dflash-ray[track]'" in str(e.value)


def test_mlflow_logs_params_and_each_step_once_across_a_resume(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    out = str(tmp_path / "out")
    first = Trackers(["mlflow"], out, {})
    where = first.start("run-a", CONFIG)
    assert where["mlflow"].startswith(str(tmp_path / "out" / "tracking" / "mlruns"))
    for step in (1, 2, 3):
        first.log(step, {"step": step, "loss": 1.0 / step, "heldout_tau": None, "lr": 1e-3})
    first.finish()
    second = Trackers(["mlflow"], out, {})  # resumed from step 2: step 3 is replayed
    assert second.start("run-b", CONFIG)["mlflow"] == where["mlflow"]  # the same run
    for step in (3, 4):
        second.log(step, {"step": step, "loss": 1.0 / step, "lr": 1e-3})
    second.finish()

    client = MlflowClient((tmp_path / "out" / "tracking" / "mlruns").as_uri())
    run = client.search_runs([client.get_experiment_by_name("dflash-ray").experiment_id])
    assert len(run) == 1 and run[0].info.status == "FINISHED"
    params = run[0].data.params
    assert params["train.lr"] == "0.003" and params["train.layer_types"] == '["full_attention"]'
    history = client.get_metric_history(run[0].info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in (1, 2, 3, 4)]
    assert "heldout_tau" not in run[0].data.metrics  # None: not a number

    # a store that goes away mid-run: one warning, the tracker dropped, the run goes on
    third = Trackers(["mlflow"], str(tmp_path / "gone"), {})
    third.start("run-c", CONFIG)
    storage.delete_tree(str(tmp_path / "gone" / "tracking"))
    third.log(1, {"loss": 1.0})
    third.log(2, {"loss": 1.0})
    third.finish()
    assert capsys.readouterr().err.count("the mlflow tracker failed to log") == 1 and not third.active


def test_tensorboard_on_s3_resumes_in_the_same_folder_without_duplicate_steps(s3_bucket, tmp_path):
    out = f"{s3_bucket}/run"
    first = Trackers(["tensorboard"], out, {})
    assert first.start("a", CONFIG) == {"tensorboard": f"{out}/tracking/tensorboard"}
    for step in range(1, 6):
        first.log(step, {"step": step, "loss": float(step)})
        if step == 3:
            first.sync()  # a checkpoint at step 3; steps 4 and 5 are lost with the attempt
    first.finish()
    second = Trackers(["tensorboard"], out, {})
    second.start("b", CONFIG)
    for step in range(4, 7):
        second.log(step, {"step": step, "loss": 10.0 * step})
    second.finish()
    storage.download_tree(f"{out}/tracking", tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_a_training_run_logs_every_metric_of_every_step_once(ray_cluster, target, data, tmp_path, monkeypatch, capsys):
    """TensorBoard and W&B (offline) on a run trained in two slices by the `train` command, with
    held-out evaluations: every numeric field of metrics.jsonl, at its step, once. Between the
    slices the command refuses to overwrite the run, and a resume under settings that change what
    is trained, naming the field."""
    from dflash_ray.cli import main

    monkeypatch.setenv("WANDB_MODE", "offline")  # passed to the coordinator by the driver
    monkeypatch.setenv("WANDB_PROJECT", "dflash-test")
    out = tmp_path / "out"
    settings = SETTINGS + ["train.trackers=[tensorboard,wandb]", "train.heldout=4", "train.eval_every=2"]
    settings += ["train.colocate=true"]  # the trackers are the coordinator's: one actor a stream will do
    args = ["train", "--data", data, "--target", target, "--output", str(out), "--json"]
    args += [x for s in settings for x in ("--set", s)]
    assert main(args + ["--stop-after-step", "4"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["ok"] and first["step"] == 4
    assert main(args + ["--stop-after-step", "4"]) == 2 and "--resume" in capsys.readouterr().err
    assert main(args + ["--resume", "--set", "train.heldout=6"]) == 2
    assert "train.heldout" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["step"] == second["total_steps"] == 6  # 12 training samples over 2 streams
    assert second["trackers"]["tensorboard"] == str(out / "tracking" / "tensorboard")
    assert first["trackers"]["wandb"] != second["trackers"]["wandb"]  # an offline folder per attempt
    assert Path(second["trackers"]["wandb"]).parent == out / "tracking" / "wandb" / "wandb"

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    expected = {
        k: [(m["step"], float(m[k])) for m in metrics if m.get(k) is not None]
        for m in metrics
        for k in m
        if k != "step"
    }
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "wait_seconds", "heldout_tau"} <= set(expected)
    scalars = tensorboard_scalars(out / "tracking" / "tensorboard")
    assert set(scalars) == set(expected)
    for key, points in expected.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in points], key
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in points], rel=1e-6), key

    rows = [
        row
        for attempt in (first, second)
        for row in wandb_history(next(Path(attempt["trackers"]["wandb"]).glob("run-*.wandb")))
    ]
    assert rows[0].keys() >= {"loss", "lr", "grad_norm", "tokens_per_s"}
    assert [r["_step"] for r in rows] == [m["step"] for m in metrics]
    assert [r["loss"] for r in rows] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert [r["_step"] for r in rows if "heldout_tau" in r] == [2, 4, 6]
    assert [m["step"] for m in metrics if "heldout_tau" in m] == [2, 4, 6]
    assert second["heldout_tau"] == metrics[-1]["heldout_tau"] >= 1


def test_a_tracker_that_cannot_start_is_an_error(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tracking").write_text("a file where the folder goes")
    with pytest.raises(DFlashError) as e:
        Trackers(["tensorboard"], str(tmp_path / "out"), {}).start("a", CONFIG)
    assert e.value.field == "train.trackers" and "tensorboard tracker did not start" in str(e.value)

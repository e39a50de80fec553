"""`dflash-ray plan`: GPUs counted from the cluster file, measured rates used as given, the FLOP
model said to be one, and the offline-storage figure."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_ray.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_counts_the_cluster_gpus_and_projects_the_seed_workload(capsys):
    out = _plan(capsys, "--cluster", str(ROOT / "cluster.yaml"))
    # gen_b200 + gen_h200: 4 nodes x 8 GPUs each; train_h200: 2 nodes x 8 GPUs
    assert out["generation"]["gpus"] == 64 and out["training"]["gpus"] == 16
    # 1.64B tokens at 400 tok/s per GPU: 1,139 GPU-hours, over 64 GPUs
    assert abs(out["generation"]["gpu_hours"] - 1.64e9 / 400 / 3600) < 0.1
    assert abs(out["generation"]["wall_hours"] - out["generation"]["gpu_hours"] / 64) < 0.01
    assert out["training"]["rate_source"].startswith("FLOP model")
    # 1.87B tokens x 5 layers x 5120 x 2 bytes
    assert out["offline_storage_avoided_tb"] == round(1.87e9 * 5 * 5120 * 2 / 1e12, 1)


def test_a_measured_training_rate_replaces_the_flop_model(capsys):
    out = _plan(capsys, "--set", "plan.training_tokens_per_s_per_gpu=5000", "--set", "plan.training_gpus=8")
    assert out["training"]["rate_source"].startswith("measured")
    assert abs(out["training"]["gpu_hours"] - 1.87e9 * 6 / 5000 / 3600) < 0.1
    assert out["training"]["gpus"] == 8


def test_a_cluster_file_without_stage_node_types_is_refused(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("available_node_types: {head: {resources: {CPU: 0}}}\n")
    assert main(["plan", "--cluster", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err

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


def _refused(capsys, *args: str) -> str:
    assert main(["plan", "--json", *args]) == 2
    return json.loads(capsys.readouterr().out)["error"]


def test_plan_runs_every_preflight_a_run_makes(capsys):
    """The preset itself passes; a bucket that gives its compiled attention more graphs than it may
    hold is refused naming both fields, and so is generation's length rule (which `pipeline` runs)."""
    preset = ["--config", str(ROOT / "configs" / "qwen3.6-27b.yaml")]
    assert _plan(capsys, *preset)["warnings"] == []
    error = _refused(capsys, *preset, "--set", "train.length_bucket=64")
    assert "train.length_bucket=64" in error and "tokenize.max_seq_len=12288" in error and "192 padded" in error
    error = _refused(capsys, *preset, "--set", "generate.max_tokens=16384")
    assert "generate.max_tokens" in error and "tokenize.max_seq_len" in error


def test_train_refuses_a_bucket_past_the_compile_limit_before_any_actor(tmp_path):
    import pytest

    from dflash_ray.config import load_config
    from dflash_ray.errors import DFlashError
    from dflash_ray.stages.train import run_train

    cfg = load_config(str(ROOT / "configs" / "qwen3.6-27b.yaml"), ["train.length_bucket=64"])
    with pytest.raises(DFlashError) as e:  # before Ray is even reached: no cluster in this test
        run_train("no-such-target", str(tmp_path / "data"), str(tmp_path / "out"), cfg, progress=False)
    assert e.value.field == "train.length_bucket" and "tokenize.max_seq_len" in str(e.value)


def test_a_hybrid_target_on_cuda_without_its_fast_kernels_is_refused(tmp_path, monkeypatch):
    """The check a target actor makes at its start, on a CUDA placement: the Gated-DeltaNet kernel
    lookup resolving to transformers' torch fallback is refused naming the package and the setting;
    allowed, it reports what is missing; on the CPU (the fallback is all there is) nothing."""
    import pytest
    from transformers import AutoModelForCausalLM

    from dflash_ray.errors import DFlashError
    from dflash_ray.target import fastpath
    from dflash_ray.tiny_models import tiny_qwen3, tiny_qwen35

    hybrid = AutoModelForCausalLM.from_pretrained(tiny_qwen35(tmp_path / "h", vocab_size=512))
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen3(tmp_path / "p", vocab_size=512))
    assert fastpath.linear_attention_layers(hybrid) == 3 and fastpath.linear_attention_layers(plain) == 0
    monkeypatch.setattr(fastpath, "missing_kernels", lambda: ["flash-linear-attention"])
    with pytest.raises(DFlashError) as e:
        fastpath.check(hybrid, "cuda:0", allow_slow=False)
    assert "flash-linear-attention" in str(e.value) and e.value.field == "train.allow_slow_target"
    assert fastpath.check(hybrid, "cuda:0", allow_slow=True) == ["flash-linear-attention"]
    assert fastpath.check(hybrid, "cpu", allow_slow=False) == []
    assert fastpath.check(plain, "cuda:0", allow_slow=False) == []
    monkeypatch.setattr(fastpath, "missing_kernels", lambda: [])
    assert fastpath.check(hybrid, "cuda:0", allow_slow=False) == []

"""`make gpu-check`'s script at toy sizes on the CPU, so it cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_every_check_on_cpu_tiny():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    checks = {x["check"]: x for x in lines}
    assert list(checks) == [
        "setup",
        "fused_ce",
        "flex_attention",
        "train_step",
        "hybrid_target",
        "speculative",
        "ray_free",
    ], done.stderr[-3000:]
    assert all(x["ok"] for x in lines), lines
    assert done.returncode == 0
    assert checks["train_step"]["tokens_per_s"] > 0 and checks["train_step"]["attention"] == "sdpa"
    assert checks["speculative"]["equal_outputs"] == checks["speculative"]["prompts"]
    hybrid = checks["hybrid_target"]
    assert hybrid["layers"].count("linear_attention") == 3 and hybrid["tokens_per_s"] > 0
    assert hybrid["gated_deltanet"] == "torch fallback" and hybrid["batch_row_rel_err"] < 1e-4  # no fla on the CPU
    assert checks["fused_ce"]["loss_rel_err"] < 1e-5
    flex, train = checks["flex_attention"], checks["train_step"]
    assert flex["lengths"] == 10 and flex["compiled_graphs"] == flex["shapes"] == 2 and flex["graph_breaks"] == 0
    assert train["lengths"] == 10 and train["attention_shapes"] == train["buckets"] == 2

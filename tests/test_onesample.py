"""The one-sample gate: each family, overfit on one answer of the packaged SmolLM2's, is accepted
whole by this project's speculative decoding after export and reload (DFlash: by vLLM's too, with
the same acceptance), and a convention broken on one side of the chain fails it."""

import json

import pytest

from dflash_ray.config import load_config
from dflash_ray.errors import GateFailed
from dflash_ray.registry import SMOLLM2
from dflash_ray.stages.onesample import run_onesample

TINY = ["train.num_layers=1", "train.block_size=4"]  # three or four drafts a block: seconds on a CPU


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "family, settings", [("dspark", ["train.family={markov_rank: 16}", "onesample.blocks=2"]), ("dflash2", [])]
)
def test_a_memorized_sample_is_accepted_whole(family, settings):
    summary = run_onesample(SMOLLM2, load_config(None, TINY + [f"train.drafter={family}", *settings]))
    drafts = 4 if family == "dspark" else 3  # DSpark's anchor is its first prediction
    assert summary["passed"] and summary["lossless"] and summary["accuracy"] == 1.0
    assert summary["drafts_per_block"] == drafts and summary["accepted_per_block"] >= 0.9 * drafts
    assert summary["feature_drift"] < 1e-3


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_dflash_is_accepted_whole_here_and_by_vllm_alike(capsys):
    """Through the command, with vLLM serving the export on the same prompt: the same acceptance."""
    pytest.importorskip("vllm")
    from dflash_ray.cli import main

    assert (
        main(["onesample", "--target", SMOLLM2, "--engine", "vllm", "--json", *[a for s in TINY for a in ("--set", s)]])
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["passed"] and summary["lossless"] and summary["vllm_outputs_equal"]
    assert summary["accepted_per_block"] >= 2.7
    assert abs(summary["tau_vllm"] - summary["tau"]) <= 0.05 * summary["tau"], summary


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_convention_broken_on_one_side_fails_the_gate(monkeypatch):
    """Training concatenates the captured layers in another order than serving reads them: the loss
    still falls to a memorized sample, and the served drafter is not accepted whole."""
    from dflash_ray.target_model import capture

    captured = capture.target_outputs
    monkeypatch.setattr(
        capture, "target_outputs", lambda model, ids, layer_ids, **kw: captured(model, ids, layer_ids[::-1], **kw)
    )
    with pytest.raises(GateFailed, match="drafts accepted per block, below 2.7") as e:
        run_onesample(SMOLLM2, load_config(None, TINY))
    assert e.value.summary["accuracy"] == 1.0 and e.value.summary["lossless"]  # memorized, and still lossless


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["dflash", "dflash2", "dspark"])
def test_a_captured_layer_shifted_by_one_in_training_fails_each_familys_gate(monkeypatch, family):
    """Training captures the layer after each one serving reads: on one sample the drafter can still
    be accepted on a neighbouring layer's features (bench/RESULTS.md), so the gate holds the features
    themselves against each other. One step of training is enough to see them differ."""
    from dflash_ray.target_model import capture

    captured = capture.target_outputs
    monkeypatch.setattr(
        capture,
        "target_outputs",
        lambda model, ids, layer_ids, **kw: captured(model, ids, [i + 1 for i in layer_ids], **kw),
    )
    cfg = load_config(None, TINY + [f"train.drafter={family}", "onesample.steps=1", "onesample.blocks=2"])
    with pytest.raises(GateFailed, match="features served to the drafter differ from those it was trained on") as e:
        run_onesample(SMOLLM2, cfg)
    assert e.value.summary["feature_drift"] > 0.01

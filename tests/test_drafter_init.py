"""The drafter's start from the target's own layers."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_ray.config import load_config
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.init import init_from_target, init_mode, initial_drafter
from dflash_ray.errors import DFlashError
from dflash_ray.target_model.capture import target_features


def _drafter(path, layer_ids, num_layers, mode="target"):
    cfg = from_target(
        AutoConfig.from_pretrained(path), mask_token_id=5, num_layers=num_layers, target_layer_ids=layer_ids
    )
    return initial_drafter(cfg, path, mode, seed=0)


def test_the_drafter_starts_as_the_target_layer_after_the_deepest_captured(tiny_qwen3_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    drafter = _drafter(tiny_qwen3_dir, [0, 2], num_layers=2)
    source = target.model.layers[3]
    copied = dict(source.named_parameters())
    for name, param in drafter.layers[0].named_parameters():
        assert torch.equal(param, copied[name]), name
    assert torch.equal(drafter.layers[1].self_attn.q_proj.weight, target.model.layers[4].self_attn.q_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)

    # the context keys and values are the ones the target's layer 3 computes from layer 2's output
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        feats = target_features(target, ids, [0, 2])
        hidden = target(ids, output_hidden_states=True).hidden_states[3]
        want = source.self_attn.k_proj(source.input_layernorm(hidden))
        got = drafter.layers[0].self_attn.k_proj(drafter.context(feats))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_random_start_and_layers_past_the_target_stay_random(tiny_qwen3_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    last = target.model.layers[-1].self_attn.q_proj.weight
    random = _drafter(tiny_qwen3_dir, [0, 4], num_layers=2, mode="random")
    again = _drafter(tiny_qwen3_dir, [0, 4], num_layers=2, mode="random")
    assert all(torch.equal(a, b) for a, b in zip(random.parameters(), again.parameters()))  # seeded
    start = _drafter(tiny_qwen3_dir, [0, 4], num_layers=2)  # layer 5 is the target's last
    assert torch.equal(start.layers[0].self_attn.q_proj.weight, last)
    assert torch.equal(start.layers[1].self_attn.q_proj.weight, random.layers[1].self_attn.q_proj.weight)


def test_a_llama_target_keeps_unit_qk_norms(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    drafter = _drafter(tmp_path, [0, 1], num_layers=1)
    target = LlamaForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, target.model.layers[2].mlp.down_proj.weight)
    assert torch.equal(drafter.layers[0].self_attn.q_norm.weight, torch.ones(8))


def test_auto_copies_only_layers_the_drafter_can_hold_and_forcing_it_fails_before_training(
    tiny_qwen3_dir, tiny_qwen35_dir
):
    from dflash_ray.stages.train import run_train

    qwen3, hybrid = AutoConfig.from_pretrained(tiny_qwen3_dir), AutoConfig.from_pretrained(tiny_qwen35_dir)
    assert init_mode(qwen3, "auto") == "target" and init_mode(qwen3, "random") == "random"
    assert init_mode(hybrid, "auto") == "random"
    with pytest.raises(DFlashError, match="qwen3_5") as err:
        run_train(tiny_qwen35_dir, "file:///nowhere", "file:///nowhere-out", load_config(None, ["train.init=target"]))
    assert err.value.field == "train.init"


def test_a_layer_of_another_shape_is_refused(tiny_qwen3_dir):
    cfg = from_target(
        AutoConfig.from_pretrained(tiny_qwen3_dir),
        mask_token_id=5,
        num_layers=1,
        target_layer_ids=[0, 2],
        intermediate_size=16,
    )
    from dflash_ray.drafter.model import DFlashDrafter

    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        init_from_target(DFlashDrafter(cfg), tiny_qwen3_dir)

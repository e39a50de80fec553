import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_ray.drafter.blocks import FULL, SLIDING, dense_mask, flex_block_mask, make_blocks, sample_anchors
from dflash_ray.drafter.config import default_layer_ids, from_target
from dflash_ray.drafter.loss import acceptance_lengths, naive_loss
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.forward import attention_masks, forward_loss
from dflash_ray.kernels.fused_ce import fused_linear_weighted_ce
from dflash_ray.target_model.capture import load_embed_and_head, target_features
from dflash_ray.tiny_models import tiny_qwen3


def test_default_layer_ids_match_the_seed_formula():
    assert default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_anchors_are_valid_unique_sorted_and_replayable():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    a1, k1 = sample_anchors(mask, 4, torch.Generator().manual_seed(3))
    a2, k2 = sample_anchors(mask, 4, torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and torch.equal(k1, k2)
    valid = {2, 3, 6, 7, 8}  # mask[i] = mask[i+1] = 1
    row = a1[0][k1[0]].tolist()
    assert set(row) <= valid and len(set(row)) == 4 and row == sorted(row)
    assert a1[1][k1[1]].tolist() == [1] and k1[1].sum() == 1


def test_labels_are_not_shifted_and_weights_decay():
    ids = torch.arange(100, 120)[None]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    anchors, keep = torch.tensor([[4, 12]]), torch.tensor([[True, True]])
    b = make_blocks(ids, mask, anchors, keep, mask_token_id=7, block_size=16)
    assert b.token_ids[0, :16].tolist() == [104] + [7] * 15
    assert b.labels[0, 1:16].tolist() == list(range(105, 120))  # block position k predicts x[a + k]
    assert b.positions[0, :16].tolist() == list(range(4, 20))
    w = b.weights[0, :16]
    assert w[0] == 0 and w[1] == 1 and math.isclose(w[8].item(), math.exp(-7 / 7), rel_tol=1e-6)
    assert (b.weights[0, 16 + 8 :] == 0).all()  # anchor 12: a + k >= S = 20 from k = 8 on


def test_dense_mask_rule():
    anchors, S, K = torch.tensor([[3, 6]]), 9, 4
    full = dense_mask(anchors, S, K, FULL)[0, 0]
    # block 0 (anchor 3): context 0..2 and its own block, bidirectional; nothing of block 1
    assert full[0, :S].tolist() == [True] * 3 + [False] * 6
    assert full[2, S:].tolist() == [True] * 4 + [False] * 4
    assert full[5, :S].tolist() == [True] * 6 + [False] * 3 and full[5, S:].tolist() == [False] * 4 + [True] * 4
    sliding = dense_mask(anchors, S, K, SLIDING, sliding_window=3)[0, 0]
    assert sliding[1, S:].tolist() == [True, True, False, False] + [False] * 4  # causal within the block
    # query at position a + k = 4 sees context p with 4 - p < 3 and p < 3: only p = 2
    assert sliding[1, :S].tolist() == [False, False, True] + [False] * 6
    # block query k = 3 (position 6) sees its block's positions 4..6 only: the window holds in the block too
    assert sliding[3, S:].tolist() == [False, True, True, True] + [False] * 4 and not sliding[3, :S].any()


def _tiny_drafter(layer_types=(FULL,), mask_token_id=5):
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    return DFlashDrafter(
        from_target(
            cfg,
            mask_token_id=mask_token_id,
            num_layers=len(layer_types),
            num_target_features=3,
            layer_types=list(layer_types),
            sliding_window=8,
        )
    )


def test_flex_and_sdpa_paths_agree_forward():
    drafter = _tiny_drafter((SLIDING, FULL))
    B, S = 2, 40
    g = torch.Generator().manual_seed(1)
    features = torch.randn(B, S, 3 * 64, generator=g)
    anchors, keep = sample_anchors(torch.ones(B, S, dtype=torch.long), 3, g)
    blocks = make_blocks(
        torch.randint(0, 256, (B, S), generator=g), torch.ones(B, S), anchors, keep, mask_token_id=5, block_size=16
    )
    embeds = torch.randn(B, blocks.token_ids.shape[1], 64, generator=g)
    with torch.no_grad():
        sdpa = drafter(features, embeds, blocks.positions, attention_masks(drafter, anchors, S, "sdpa"))
        flex = drafter(features, embeds, blocks.positions, attention_masks(drafter, anchors, S, "flex"))
    torch.testing.assert_close(flex, sdpa, atol=2e-5, rtol=2e-5)


def test_flex_block_mask_equals_dense_mask():
    anchors = torch.tensor([[3, 20, 33], [0, 9, 40]])
    for layer_type in (FULL, SLIDING):
        mask = flex_block_mask(anchors, 48, 16, layer_type, 8)
        dense = dense_mask(anchors, 48, 16, layer_type, 8)
        for b in range(2):
            q = torch.arange(48)[:, None]
            kv = torch.arange(48 + 48)[None, :]
            got = mask.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
            assert torch.equal(got, dense[b, 0])


def _soft_targets(labels, V, g, k=5, share=0.6):
    """The label with 1 - share and `share` spread over k ids (the label may be among them)."""
    ids = torch.cat([labels[:, None], torch.randint(0, V, (labels.numel(), k), generator=g)], 1)
    ids[::7, 1] = labels[::7]  # duplicates of the label must add up
    probs = torch.rand(labels.numel(), k, generator=g)
    probs = torch.cat([torch.full((labels.numel(), 1), 1 - share), probs / probs.sum(1, keepdim=True) * share], 1)
    return ids, probs


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_loss_matches_reference(dtype, tol, soft):
    g = torch.Generator().manual_seed(0)
    N, H, V = 257, 48, 3001
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    head = (torch.randn(V, H, generator=g) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    weights = torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.3)
    targets = _soft_targets(labels, V, g) if soft else ()
    ref_loss, ref_hit = naive_loss(hidden, head, labels, weights, *targets)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, head))
    loss, hit = fused_linear_weighted_ce(hidden, head, labels, weights, *targets, max_chunk_bytes=4 * V * 50)
    grads = torch.autograd.grad(loss, (hidden, head))
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    for got, ref in zip(grads, ref_grads):
        assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    assert torch.equal(hit[weights > 0], ref_hit[weights > 0])


def test_simulated_acceptance_length():
    correct = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1]], dtype=torch.bool)
    weights = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.float)
    tau = acceptance_lengths(correct, weights, torch.tensor([[True, True]]), 4)
    assert tau.tolist() == [3.0, 1.0]  # block 0: k=1,2 hit then miss; block 1: k=1 has no label


def test_mask_token_validation():
    cfg = AutoConfig.for_model(
        "qwen3", vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    )
    with pytest.raises(ValueError, match="not a row"):
        from_target(cfg, mask_token_id=256)
    with pytest.raises(ValueError, match="pad/eos/bos"):
        from_target(cfg, mask_token_id=2, special_token_ids=(2,))
    with pytest.raises(ValueError, match="outside the target"):
        from_target(cfg, mask_token_id=3, target_layer_ids=[6])


def test_hooks_equal_hidden_states_and_padding(tiny_qwen3_dir, tiny_qwen35_dir):
    for path in (tiny_qwen3_dir, tiny_qwen35_dir):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        L = model.config.num_hidden_layers
        ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        layer_ids = [0, 1, L - 2]
        feats = target_features(model, ids, layer_ids)
        want = torch.cat([hs[i + 1] for i in layer_ids], -1)
        torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)
        # a batch with right padding gives each sequence the features it gets alone
        short = ids[1, :7]
        padded = torch.stack([ids[0], torch.cat([short, torch.zeros(4, dtype=torch.long)])])
        attn = torch.ones_like(padded)
        attn[1, 7:] = 0
        batch = target_features(model, padded, layer_ids, attention_mask=attn)
        alone = target_features(model, short[None], layer_ids)
        torch.testing.assert_close(batch[1, :7], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_drafter_can_learn_and_untrained_stays_near_one(tmp_path):
    """The 'it can learn at all' gate: overfit a few sequences of a tiny target to tau >= 8."""
    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(target.config, mask_token_id=500, num_layers=1, target_layer_ids=[0, 1, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    g = torch.Generator().manual_seed(0)
    seqs = torch.stack([torch.randint(0, 490, (12,), generator=g).repeat(8) for _ in range(4)])
    mask = torch.zeros_like(seqs)
    mask[:, 12:] = 1
    feats = target_features(target, seqs, cfg.target_layer_ids)
    with torch.no_grad():
        untrained = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=16, generator=g)
    assert untrained.tau.mean() < 1.5
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(200):
        out = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=16, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    with torch.no_grad():
        trained = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=16, generator=g)
    assert trained.tau.mean() >= 8, trained.tau


def test_export_round_trip_is_bit_exact(tmp_path):
    import json

    from safetensors import safe_open

    from dflash_ray.drafter.export import load_drafter, save_drafter

    drafter = _tiny_drafter((SLIDING, FULL))
    save_drafter(drafter, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": drafter.cfg.target_layer_ids}
    assert config["block_size"] == 16 and config["num_target_layers"] == 6
    assert config["layer_types"] == [SLIDING, FULL] and config["num_hidden_layers"] == 2
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= names
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = load_drafter(tmp_path / "out")
    assert loaded.cfg == drafter.cfg
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


def test_drafter_from_a_hybrid_qwen35_target(tiny_qwen35_dir):
    cfg = AutoConfig.from_pretrained(tiny_qwen35_dir)
    drafter_cfg = from_target(cfg, mask_token_id=248070, num_layers=2, layer_types=[SLIDING, FULL])
    assert drafter_cfg.hidden_size == cfg.hidden_size and drafter_cfg.vocab_size == 248320
    assert drafter_cfg.num_target_layers == cfg.num_hidden_layers == 4
    embed, head = load_embed_and_head(tiny_qwen35_dir)
    assert embed.shape == head.shape == (248320, cfg.hidden_size) and not torch.equal(embed, head)


def test_target_outputs_give_the_targets_own_next_token_distribution(tmp_path):
    """Position p holds the target's top-k for token p + 1, at the wanted positions only, computed
    in chunks of the head; the features are the same as without it."""
    from dflash_ray.target_model.capture import target_outputs

    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    want = torch.zeros(2, 20, dtype=torch.long)
    want[:, 5:19] = 1
    feats, top_ids, top_probs, _ = target_outputs(
        model, ids, [0, 2], top_k=8, want_BS=want, max_chunk_bytes=4 * 512 * 3
    )
    torch.testing.assert_close(feats, target_features(model, ids, [0, 2]), rtol=0, atol=0)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=ids).logits.float(), -1)
    ref = probs.topk(8, -1)
    on = want.bool()
    torch.testing.assert_close(top_probs[on], ref.values[on], rtol=1e-5, atol=1e-6)
    assert torch.equal(top_ids[on], ref.indices[on])
    assert not top_probs[~on].any()


def test_distillation_targets_mix_the_label_with_the_targets_distribution():
    from dflash_ray.drafter.blocks import make_blocks, sample_anchors

    ids = torch.arange(10, 30)[None]
    mask = torch.ones_like(ids)
    mask[:, :5] = 0
    teacher_ids = torch.arange(20 * 3).view(1, 20, 3)  # position p: ids 3p, 3p+1, 3p+2
    teacher_probs = torch.tensor([0.5, 0.25, 0.05]).expand(1, 20, 3)
    anchors, keep = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    blocks = make_blocks(
        ids, mask, anchors, keep, mask_token_id=0, block_size=4, teacher=(teacher_ids, teacher_probs), distill=0.75
    )
    a = int(anchors[0, 0])
    # block position k = 2 predicts x[a + 2] = label; the target's distribution for it sits at a + 1
    row = 2
    assert blocks.soft_ids[0, row, 0] == ids[0, a + 2]
    assert blocks.soft_ids[0, row, 1:].tolist() == [3 * (a + 1), 3 * (a + 1) + 1, 3 * (a + 1) + 2]
    torch.testing.assert_close(
        blocks.soft_probs[0, row], torch.tensor([0.25, 0.75 * 0.5 / 0.8, 0.75 * 0.25 / 0.8, 0.75 * 0.05 / 0.8])
    )
    torch.testing.assert_close(blocks.soft_probs.sum(-1), torch.ones(1, 16))

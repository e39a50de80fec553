"""Bounded attention shapes: training pads the context to `train.length_bucket` multiples and keeps
the anchor count fixed, so compiled flex attention builds one graph per bucket however many sequence
lengths a run meets, and the padding leaves the loss as it was. CPU, no Ray."""

import json

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig

from dflash_ray.config import load_config
from dflash_ray.drafter import model as drafter_model
from dflash_ray.drafter.blocks import FULL, SLIDING, bucket_length, dense_mask, flex_block_mask, sample_anchors
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.model import DFlashDrafter, compile_static, compiled_flex_attention
from dflash_ray.drafter.forward import forward_loss
from dflash_ray.tiny_models import tiny_qwen3

# 24 distinct lengths over three buckets of 32 (32, 64, 96)
LENGTHS = list(range(20, 96, 3))


def _batch(S: int, g: torch.Generator, features: int) -> dict:
    mask = torch.zeros(1, S, dtype=torch.long)
    mask[:, S // 4 :] = 1
    return {
        "input_ids": torch.randint(0, 500, (1, S), generator=g),
        "loss_mask": mask,
        "features": torch.randn(1, S, features, generator=g),
        "seconds": 0.0,
    }


def test_training_over_many_lengths_meets_one_attention_shape_per_bucket(tmp_path):
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.train.workers import DrafterWorker

    target = tiny_qwen3(tmp_path / "target", num_layers=4, hidden_size=64, vocab_size=512)
    cfg = load_config(
        None,
        [
            "train.num_layers=2",
            "train.layer_types=[sliding_attention,full_attention]",
            "train.sliding_window=8",
            "train.target_layer_ids=[0,1,2]",
            "train.num_anchors=4",
            "train.block_size=4",
            "train.length_bucket=32",
        ],
    )
    worker = DrafterWorker(target, json.dumps(drafter_config(target, cfg)), "random", cfg.train, 0, 1)
    worker.set_total_steps(30)
    shapes = set()  # (context length, query count) as each attention layer receives them
    for layer in worker.drafter.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, args: shapes.add((args[1].shape[1], args[0].shape[1])))
    g = torch.Generator().manual_seed(0)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(30)]
    losses = [worker.train_step(step, _batch(S, g, 3 * 64))["loss"] for step, S in enumerate(lengths)]
    buckets = {bucket_length(S, 32) for S in lengths}
    assert len(set(lengths)) >= 20 and buckets == {32, 64, 96}
    assert shapes == {(b, 4 * 4) for b in buckets}, shapes
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.slow
def test_compiled_flex_attention_compiles_one_graph_per_bucket_for_every_layer_type():
    """Forward only: compiled flex attention has no backward on the CPU (torch 2.13)."""
    torch._dynamo.reset()
    K, A, h, g_heads, d = 4, 4, 4, 2, 16
    lengths = [S for S in LENGTHS if S > 32]  # 21 lengths, two buckets: 64 and 96
    buckets = {bucket_length(S, 32) for S in lengths}
    graphs_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    g = torch.Generator().manual_seed(0)
    seen = set()
    for S in lengths:
        padded = bucket_length(S, 32)
        mask = torch.zeros(2, padded, dtype=torch.long)
        mask[:, S // 4 : S] = 1
        anchors, _ = sample_anchors(mask, A, g)
        q = torch.randn(2, h, A * K, d, generator=g)
        k, v = (torch.randn(2, g_heads, padded + A * K, d, generator=g) for _ in range(2))
        for layer_type in (FULL, SLIDING):
            out = compiled_flex_attention()(
                q, k, v, block_mask=flex_block_mask(anchors, padded, K, layer_type, 8), enable_gqa=True
            )
            if (padded, layer_type) not in seen:  # once per shape and rule: against the dense mask
                seen.add((padded, layer_type))
                dense = dense_mask(anchors, padded, K, layer_type, 8)
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(lengths) >= 20 and len(buckets) == 2
    assert counters["stats"]["unique_graphs"] - graphs_before == len(buckets)  # both layer types share each
    assert sum(counters["graph_break"].values()) == breaks_before  # nothing ran outside the graphs


def test_the_block_mask_traces_to_one_graph_per_bucket_for_every_layer_type():
    """The GPU compiles `create_block_mask` over `flex_block_mask`'s mask_mod; inductor cannot compile
    it on the CPU (torch 2.13), so this traces the same call with the aot_eager backend."""
    from torch.nn.attention.flex_attention import create_block_mask

    torch._dynamo.reset()
    traced = torch.compile(create_block_mask, backend="aot_eager", dynamic=False)
    graphs_before = counters["stats"]["unique_graphs"]
    lengths = [S for S in LENGTHS if S > 32]
    for S in lengths:
        padded = bucket_length(S, 32)
        mask = torch.zeros(2, padded, dtype=torch.long)
        mask[:, S // 4 : S] = 1
        anchors, _ = sample_anchors(mask, 4, torch.Generator().manual_seed(S))
        for layer_type in (FULL, SLIDING):
            eager = flex_block_mask(anchors, padded, 4, layer_type, 8)
            got = traced(eager.mask_mod, 2, None, 16, padded + 16, device="cpu")
            assert torch.equal(got.to_dense(), eager.to_dense())
    assert counters["stats"]["unique_graphs"] - graphs_before == 2  # buckets 64 and 96


@pytest.mark.slow
def test_a_compiled_function_past_its_shape_limit_raises_instead_of_running_eagerly(monkeypatch):
    monkeypatch.setattr(drafter_model, "MAX_SHAPES", 1)
    double = compile_static(lambda x: x * 2)
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        double(torch.ones(5))


def _drafter():
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
            mask_token_id=5,
            num_layers=2,
            num_target_features=3,
            block_size=4,
            layer_types=[SLIDING, FULL],
            sliding_window=8,
        )
    )


@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_bucket_padding_leaves_the_loss_and_gradients_unchanged(distill):
    drafter = _drafter()
    g = torch.Generator().manual_seed(0)
    B, S, V = 2, 37, 256
    ids = torch.randint(0, V - 6, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, :9] = 0
    mask[1, 30:] = 0  # the second row ends early, as a batch's shorter rows do
    feats = torch.randn(B, S, 3 * 64, generator=g)
    embed, head = torch.randn(V, 64, generator=g) * 0.1, torch.randn(V, 64, generator=g) * 0.1
    top = torch.rand(B, S, 3, generator=g)
    teacher = (torch.randint(0, V, (B, S, 3), generator=g), top / top.sum(-1, keepdim=True))

    def run(bucket: int, attention: str = "sdpa"):
        drafter.zero_grad()
        out = forward_loss(
            drafter,
            embed,
            head,
            feats,
            ids,
            mask,
            num_anchors=12,
            attention=attention,
            generator=torch.Generator().manual_seed(1),
            teacher=teacher,
            distill=distill,
            length_bucket=bucket,
        )
        if attention == "sdpa":
            out.loss.loss.backward()
        return out, [p.grad.clone() for p in drafter.parameters()] if attention == "sdpa" else []

    plain, plain_grads = run(1)
    padded, padded_grads = run(32)  # 37 -> 64 positions
    assert padded.blocks.anchors.max() < S and torch.equal(plain.blocks.anchors, padded.blocks.anchors)
    torch.testing.assert_close(padded.loss.loss, plain.loss.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(padded.tau, plain.tau)
    for a, b in zip(padded_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # flex attention (eager on the CPU, forward only) over the padded context
        flex, _ = run(32, "flex")
    torch.testing.assert_close(flex.loss.loss, plain.loss.loss, atol=1e-5, rtol=1e-5)

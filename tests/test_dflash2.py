"""The DFlash2 family: its convolutions, selector, loss, export and speculative decoding (CPU, tiny sizes)."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_ray.drafter import dflash2, families
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.dflash2 import DFlash2Drafter, GroupedConv, forward_loss
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.speculative import Sampling, speculative_decode, target_decode, warp
from dflash_ray.drafter.forward import attention_masks
from dflash_ray.target_model.capture import load_embed_and_head, target_outputs
from dflash_ray.tiny_models import tiny_qwen3

V, H = 96, 32


def _cfg(family="dflash2", block_size=5, **settings):
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    if family == "dflash2":
        settings = {"selector_rank": 8, "selector_top_k": 6, "conv_group_size": 8, **settings}
    return from_target(
        cfg,
        mask_token_id=V - 1,
        num_layers=2,
        num_target_features=2,
        block_size=block_size,
        family=family,
        settings=settings,
    )


def _drafter(seed=0, **kw) -> DFlash2Drafter:
    torch.manual_seed(seed)
    return families.get("dflash2").build(_cfg(**kw))


def _batch(B=2, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 2, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, :6] = 0
    feats = torch.randn(B, S, 2 * H, generator=g)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    return embed, head, feats, ids, mask


def _perturb(drafter: DFlash2Drafter, std=0.3):
    """Convolutions and selector away from their identity start, so every weight matters."""
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn_like(conv.base_kernel) * std)
                conv.kernel_projection.weight.normal_(std=std)
        drafter.candidate_selector.hidden_projection.weight.normal_(std=std)


def test_family_registry_and_config_fields():
    from dflash_ray.config import RunConfig, TrainConfig
    from dflash_ray.errors import DFlashError

    assert {"dflash", "dspark", "dflash2"} <= set(families.names())
    family = families.get("dflash2")
    assert family.first_prediction == 1 and families.of_architecture(["DFlash2DraftModel"]) is family
    run = RunConfig(train=TrainConfig(drafter="dflash2", family={"selector_top_k": 8}))
    own = families.settings("dflash2", run.train.family)
    assert (own.conv_kernel_size, own.conv_group_size, own.selector_rank, own.selector_top_k, own.selector_weight) == (
        2,
        16,
        256,
        8,
        1.0,
    )
    with pytest.raises(ValueError, match="conv_group_size 12 does not divide hidden_size 32"):
        _cfg(conv_group_size=12)
    with pytest.raises(DFlashError, match="settings.conv_group_size.*unknown setting of drafter family 'dflash'"):
        _cfg(family="dflash", conv_group_size=8)  # another family's setting


def test_grouped_conv_is_the_formula_and_stays_in_its_block():
    """out[i, c] = Σ_t (base[t, c] + δ[i, t, c // g])·x[i - t, c], taps that would reach into the
    previous block left out; at its start the pair is the identity."""
    K, T, g = 4, 3, 8
    conv = GroupedConv(H, taps=T, group_size=g, block_size=K)
    x = torch.randn(2, 3 * K, H)
    delta = conv.deltas(x)
    assert delta.shape == (2, 3 * K, 2, T, H // g)
    assert torch.equal(conv.around(lambda u: 2 * u, x), 2 * x)
    torch.nn.init.normal_(conv.base_kernel)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    delta = conv.deltas(x)
    out = conv.convolve(x, delta[:, :, 1], 1)
    ref = torch.zeros_like(x)
    for b in range(2):
        for i in range(3 * K):
            for t in range(T):
                if i % K - t < 0:
                    continue
                for c in range(H):
                    ref[b, i, c] += (conv.base_kernel[1, t, c] + delta[b, i, 1, t, c // g]) * x[b, i - t, c]
    torch.testing.assert_close(out, ref)


def test_untrained_dflash2_equals_dflash():
    """With DFlash's backbone weights, the identity convolutions and the zero hidden projection make
    DFlash2's hidden states, loss and greedy drafts DFlash's own."""
    torch.manual_seed(0)
    base = DFlashDrafter(_cfg(family="dflash")).eval()
    drafter = _drafter(seed=1).eval()
    missing, unexpected = drafter.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(
        ".attention_conv." in k or ".mlp_conv." in k or k.startswith("candidate_selector.") for k in missing
    )
    embed, head, feats, ids, mask = _batch()
    anchors = torch.tensor([[8, 20], [10, 25]])
    masks = attention_masks(base, anchors, 32, "sdpa")
    blocks = torch.randint(0, V, (2, 10))
    positions = (anchors[:, :, None] + torch.arange(5)).view(2, -1)
    with torch.no_grad():
        h0 = base(feats, F.embedding(blocks, embed), positions, masks)
        h1 = drafter(feats, F.embedding(blocks, embed), positions, masks)
    torch.testing.assert_close(h1, h0)
    context = feats[:1, :9]
    want, _ = families.get("dflash").propose(base, context, 17, embed, head, Sampling())
    got, q = families.get("dflash2").propose(drafter, context, 17, embed, head, Sampling())
    assert q is None and torch.equal(got, want)


def test_selector_scores_follow_the_formula():
    drafter = _drafter()
    _perturb(drafter)
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(0)
    hidden, cand = torch.randn(4, H, generator=g), torch.randint(0, V, (4, 6), generator=g)
    unary = torch.randn(4, 6, generator=g)
    edges = sel.edge_scores(hidden, 17, cand, unary)
    A, B, W = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    for pos in range(4):
        for p in range(6):
            pred = 17 if pos == 0 else int(cand[pos - 1, p])
            for c in range(6):
                ref = unary[pos, c] + (A[pred] * (W @ hidden[pos]) * B[cand[pos, c]]).sum()
                torch.testing.assert_close(edges[pos, p, c], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rule", ["drop", "swap"])
def test_selector_loss_by_hand(rule):
    """The selector CE uses the TRUE previous token as predecessor; a label outside the top-C is
    dropped or swapped in for the weakest candidate; the total is DFlash's CE plus it."""
    drafter = _drafter()
    _perturb(drafter)
    embed, head, feats, ids, mask = _batch()
    out = forward_loss(
        drafter,
        embed,
        head,
        feats,
        ids,
        mask,
        num_anchors=4,
        fused=False,
        rule=rule,
        generator=torch.Generator().manual_seed(3),
    )
    blk = out.blocks
    with torch.no_grad():
        h = drafter(
            feats, F.embedding(blk.token_ids, embed), blk.positions, attention_masks(drafter, blk.anchors, 32, "sdpa")
        ).reshape(-1, H)
    logits = h @ head.t()
    labels, w = blk.labels.reshape(-1), blk.weights.reshape(-1)
    prev = torch.gather(ids, 1, (blk.positions - 1).clamp(0, 31)).reshape(-1)
    sel = drafter.candidate_selector
    total, wsum, dropped, hits = 0.0, 0.0, 0, []
    for n in range(h.shape[0]):
        cand = logits[n].topk(6).indices
        found = bool((cand == labels[n]).any())
        hit = False
        if not found and rule == "drop":
            dropped += w[n] > 0
        else:
            if not found:
                cand = torch.cat([cand[:-1], labels[n : n + 1]])
            score = logits[n, cand] + (
                sel.predecessor_codebook[prev[n]] * sel.hidden_projection(h[n]) * sel.successor_codebook[cand]
            ).sum(-1)
            target = int((cand == labels[n]).nonzero())
            total = total + w[n] * F.cross_entropy(score[None], torch.tensor([target]))
            wsum = wsum + w[n]
            hit = found and int(score.argmax()) == target
        hits.append(hit)
    backbone = (F.cross_entropy(logits, labels, reduction="none") * w).sum() / w.sum()
    torch.testing.assert_close(out.loss.loss.detach(), backbone + total / wsum, atol=1e-4, rtol=1e-4)
    assert out.loss.correct.reshape(-1).tolist() == hits
    assert rule == "swap" or dropped > 0  # random labels: some fall outside the top 6


def test_loss_decreases_and_every_part_learns():
    drafter = _drafter()
    embed, head, feats, ids, mask = _batch()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        out = forward_loss(
            drafter, embed, head, feats, ids, mask, num_anchors=6, generator=torch.Generator().manual_seed(0)
        )
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
        losses.append(float(out.loss.loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses[::5]
    layer = drafter.layers[0]
    assert layer.attention_conv.kernel_projection.weight.abs().sum() > 0
    assert (layer.mlp_conv.base_kernel[:, 1] != 0).any()  # the second tap moved off zero
    assert drafter.candidate_selector.hidden_projection.weight.abs().sum() > 0
    assert out.tau.min() >= 1 and out.tau.max() <= 5


def test_export_round_trip_in_vllm_dflash2_format(tmp_path):
    from safetensors import safe_open

    from dflash_ray.drafter.export import load_drafter, save_drafter

    drafter = _drafter()
    _perturb(drafter)
    save_drafter(drafter, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "mask_token_id": V - 1,
        "target_layer_ids": drafter.cfg.target_layer_ids,
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 8,
        "selector_top_k": 6,
    }
    assert config["drafter_settings"]["selector_weight"] == 1.0  # training's own, beside what vLLM reads
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 2, H)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * H // 8, H)
    assert (
        shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (V, 8)
    )
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, H)
    loaded = load_drafter(tmp_path / "out")
    assert isinstance(loaded, DFlash2Drafter) and loaded.cfg == drafter.cfg
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


def test_sampled_drafts_come_from_the_walks_q():
    """Each sampled draft's q is the warped scores of the candidates given the draft before it (the
    anchor first), zero off the candidates: the q the verification divides by."""
    drafter = _drafter().eval()
    _perturb(drafter, std=1.0)
    g = torch.Generator().manual_seed(0)
    embed, head, context = (
        torch.randn(V, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randn(1, 9, 2 * H, generator=g),
    )
    sampling = Sampling(0.7, 0.95, torch.Generator().manual_seed(1), greedy_drafts=False)
    drafts, q = families.get("dflash2").propose(drafter, context, 17, embed, head, sampling)
    assert drafts.shape == (4,) and q.shape == (4, V)
    with torch.no_grad():
        ids = torch.full((1, 5), V - 1)
        ids[0, 0] = 17
        h = drafter(
            context,
            F.embedding(ids, embed),
            torch.arange(9, 14)[None],
            attention_masks(drafter, torch.tensor([[9]]), 9, "sdpa"),
        )[0, 1:]
        unary, cand = (h @ head.t()).topk(6)
        sel = drafter.candidate_selector
        prev = torch.cat([torch.tensor([17]), drafts[:-1]])
        scores = unary + sel.pair_scores(h, prev[:, None], cand)[:, 0]
        want = torch.zeros(4, V).scatter_(1, cand, warp(scores, 0.7, 0.95))
    torch.testing.assert_close(q, want)
    assert (q[torch.arange(4), drafts] > 0).all() and ((q > 0).sum(-1) <= 6).all()
    greedy, none = families.get("dflash2").propose(drafter, context, 17, embed, head, Sampling())
    assert none is None
    with torch.no_grad():
        prev = torch.cat([torch.tensor([17]), greedy[:-1]])
        scores = unary + sel.pair_scores(h, prev[:, None], cand)[:, 0]
        assert torch.equal(cand.gather(1, scores.argmax(-1, keepdim=True))[:, 0], greedy)


def _trained_dflash2(tmp_path, steps=150):
    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512, seed=3)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(
        target.config,
        mask_token_id=511,
        num_layers=1,
        target_layer_ids=[0, 1, 2],
        block_size=8,
        family="dflash2",
        settings={"selector_rank": 32, "selector_top_k": 8},
    )
    torch.manual_seed(0)
    drafter = DFlash2Drafter(cfg).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (8,), generator=g).tolist() for _ in range(3)]
    refs = [target_decode(target, p, 48, eos_ids=set()) for p in prompts]
    untrained = [speculative_decode(target, drafter, embed, head, p, 48, set()) for p in prompts]
    seqs = torch.tensor([p + r.token_ids for p, r in zip(prompts, refs)])
    mask = torch.zeros_like(seqs)
    mask[:, 8:] = 1
    feats = target_outputs(target, seqs, cfg.target_layer_ids)[0]
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        out = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=24, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    return target, drafter.eval(), embed, head, prompts, refs, untrained


@pytest.mark.slow
def test_speculative_output_equals_target_decode(tmp_path):
    target, drafter, embed, head, prompts, refs, untrained = _trained_dflash2(tmp_path)
    assert [u.token_ids for u in untrained] == [r.token_ids for r in refs]
    trained = [speculative_decode(target, drafter, embed, head, p, 48, set()) for p in prompts]
    assert [t.token_ids for t in trained] == [r.token_ids for r in refs]
    tau = sum(sum(t.acceptance) for t in trained) / sum(len(t.acceptance) for t in trained)
    assert tau > 2, [t.acceptance for t in trained]
    assert max(max(t.acceptance) for t in trained) <= 8  # K - 1 = 7 drafts plus the bonus token


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_speculative_sampling_reproduces_the_targets_distribution(tmp_path):
    """Sampled drafts walked over the top-C candidates (q zero elsewhere): the first two tokens of
    1,500 seeded one-step runs against the target's exact joint distribution (chi-square at a 0.1%
    false-alarm rate), as the DFlash and DSpark tests do."""
    from test_speculative import sampled_pairs_match_the_target  # tests/ is on the path (prepend import mode)

    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=24, seed=5)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(
        target.config,
        mask_token_id=23,
        num_layers=1,
        target_layer_ids=[0, 1, 2],
        block_size=4,
        family="dflash2",
        settings={"selector_rank": 8, "selector_top_k": 4},
    )
    torch.manual_seed(1)
    drafter = DFlash2Drafter(cfg).eval()
    torch.nn.init.normal_(drafter.candidate_selector.hidden_projection.weight, std=0.5)  # a pair term that matters
    sampled_pairs_match_the_target(target, drafter, embed, head, new_tokens=3)


def _tiny_run_inputs(tmp_path, num_rows=4):
    from test_dspark import _tiny_run_inputs as inputs  # tests/ is on the path (prepend import mode)

    return inputs(tmp_path, num_rows)


def test_train_drafter_dflash2_reaches_the_workers(tmp_path):
    """`train.drafter=dflash2` through the training roles (as plain classes), starting from the
    target's layers: the drafter config is DFlash2's, its convolutions start at identity (the target
    has none to copy), and steps learn."""
    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    target, data = _tiny_run_inputs(tmp_path)
    cfg = load_config(
        None,
        [
            "train.drafter=dflash2",
            "train.family.selector_rank=16",
            "train.family.selector_top_k=8",
            "train.block_size=6",
            "train.num_layers=1",
            "train.target_layer_ids=[0,1,2]",
            "train.num_anchors=16",
            "train.lr=3e-3",
        ],
    )
    drafter_json = drafter_config(target, cfg)
    assert drafter_json["architectures"] == ["DFlash2DraftModel"]
    assert (
        drafter_json["dflash_config"]["selector_top_k"] == 8 and drafter_json["dflash_config"]["conv_group_size"] == 16
    )
    batch = TargetWorker(target, [0, 1, 2], cfg.train).features([(f"{data}/part-0.parquet", 0)])
    worker = DrafterWorker(target, json.dumps(drafter_json), "target", cfg.train, 0, 1)
    assert isinstance(worker.drafter, DFlash2Drafter)
    conv = worker.drafter.layers[0].attention_conv
    assert conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1].eq(0).all()
    worker.set_total_steps(25)
    stats = [worker.train_step(step, batch) for step in range(25)]
    assert stats[-1]["loss"] < 0.8 * stats[0]["loss"], [s["loss"] for s in stats]
    assert 1 <= stats[-1]["tau"] <= 6 and 0 <= stats[-1]["acc_k1"] <= 1
    assert max(worker.evaluate(batch)) >= 1


def test_missing_token_rule_is_checked():
    with pytest.raises(ValueError, match="valid: drop, swap"):
        dflash2.place_labels(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long), "keep")

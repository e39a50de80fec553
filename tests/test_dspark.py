"""The DSpark family: its blocks, loss, heads, export and speculative decoding (CPU, tiny sizes)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_ray.drafter import families
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.dspark import DSparkDrafter, forward_loss
from dflash_ray.drafter.speculative import Sampling, speculative_decode, target_decode, warp
from dflash_ray.drafter.forward import attention_masks
from dflash_ray.target_model.capture import load_embed_and_head, target_outputs
from dflash_ray.tiny_models import tiny_qwen3

V, H = 96, 32


def _drafter(block_size=5, markov_rank=8, seed=0, **kw) -> DSparkDrafter:
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
    torch.manual_seed(seed)
    dcfg = from_target(
        cfg,
        mask_token_id=V - 1,
        num_layers=1,
        num_target_features=2,
        block_size=block_size,
        family="dspark",
        settings={"markov_rank": markov_rank},
    )
    return families.get("dspark").build(dcfg.replace(**kw))


def _batch(B=2, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 2, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, :6] = 0
    feats = torch.randn(B, S, 2 * H, generator=g)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    target_hidden = torch.randn(B, S, H, generator=g) * 6  # the target's last hidden states (a peaked p)
    return embed, head, feats, ids, mask, target_hidden


def test_family_registry_and_config_choice():
    from dflash_ray.config import RunConfig, TrainConfig
    from dflash_ray.errors import DFlashError

    assert {"dflash", "dspark", "dflash2"} <= set(families.names())
    assert families.get("dspark").first_prediction == 0 and families.get("dflash").first_prediction == 1
    assert families.of_architecture(["DSparkDraftModel"]).name == "dspark"
    with pytest.raises(DFlashError, match=r"train.drafter.*'eagle' is not one of \[.*'dspark'.*\]"):
        RunConfig(train=TrainConfig(drafter="eagle"))
    assert RunConfig(train=TrainConfig(drafter="dspark")).train.drafter == "dspark"
    with pytest.raises(ValueError, match="'medusa' is unknown; valid: .*dspark"):
        _drafter(family="medusa")


def test_anchor_is_the_first_prediction_and_weights_decay():
    drafter = _drafter()
    embed, head, feats, ids, mask, teacher = _batch()
    out = forward_loss(
        drafter, embed, head, feats, ids, mask, num_anchors=4, generator=torch.Generator().manual_seed(0)
    )
    b, K = out.blocks, 5
    for row in range(2):
        for j in range(4):
            a = int(b.anchors[row, j])
            q = slice(j * K, (j + 1) * K)
            assert b.token_ids[row, q].tolist() == [int(ids[row, a])] + [V - 1] * (K - 1)
            assert b.positions[row, q].tolist() == list(range(a, a + K))
            for k in range(K):  # position k predicts x[a + k + 1], weight exp(-k/4) inside the sequence
                inside = a + k + 1 < 32
                assert int(b.labels[row, j * K + k]) == (int(ids[row, a + k + 1]) if inside else 0)
                expected = torch.exp(torch.tensor(-k / 4)) if inside else torch.tensor(0.0)
                torch.testing.assert_close(b.weights[row, j * K + k], expected)
    assert out.tau.min() >= 1 and out.tau.max() <= K + 1


def test_markov_head_reads_the_previous_token():
    drafter = _drafter()
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight)
    embed, head, feats, ids, mask, _ = _batch()
    hidden = torch.randn(3, H)
    a, b = torch.tensor([1, 2, 3]), torch.tensor([1, 7, 3])
    la, lb = drafter.logits(hidden, head, a), drafter.logits(hidden, head, b)
    torch.testing.assert_close(la[[0, 2]], lb[[0, 2]])
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    torch.testing.assert_close(la[1] - lb[1], w2 @ (w1[2] - w1[7]), atol=1e-4, rtol=1e-4)
    # the training loss uses the TRUE token before each label (the anchor first): recomputed by hand
    g = torch.Generator().manual_seed(3)
    out = forward_loss(drafter, embed, head, feats, ids, mask, num_anchors=4, generator=g)
    blk = out.blocks
    with torch.no_grad():
        h = drafter(
            feats, F.embedding(blk.token_ids, embed), blk.positions, attention_masks(drafter, blk.anchors, 32, "sdpa")
        )
        prev = torch.gather(ids, 1, blk.positions.clamp(max=31))
        logits = drafter.logits(h.reshape(-1, H), head, prev.reshape(-1))
        conf = drafter.confidence_head(h.reshape(-1, H), drafter.markov_head.embed(prev.reshape(-1)))
        hits = logits.argmax(-1) == blk.labels.reshape(-1)
        per = F.cross_entropy(logits, blk.labels.reshape(-1), reduction="none") + F.binary_cross_entropy_with_logits(
            conf, hits.float(), reduction="none"
        )  # no target: the fallback
        w = blk.weights.reshape(-1)
        torch.testing.assert_close(out.loss.loss.detach(), (per * w).sum() / w.sum())
        # the previous token matters: a wrong one changes the loss
        wrong = drafter.logits(h.reshape(-1, H), head, (prev.reshape(-1) + 1) % (V - 1))
        assert not torch.allclose(wrong, logits)


def test_tv_and_confidence_label_are_against_the_targets_whole_distribution():
    """The TV term and the confidence label are computed against softmax(target hidden @ head) over
    the whole vocabulary (no top-k truncation): recomputed here by hand, term by term."""
    drafter = _drafter()
    own = drafter.cfg.settings
    assert (own.ce_weight, own.tv_weight, own.bce_weight) == (0.1, 0.9, 1.0)
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.1)
    embed, head, feats, ids, mask, target_hidden = _batch()
    out = forward_loss(
        drafter,
        embed,
        head,
        feats,
        ids,
        mask,
        num_anchors=4,
        generator=torch.Generator().manual_seed(2),
        teacher=target_hidden,
    )
    blk = out.blocks
    with torch.no_grad():
        h = drafter(
            feats, F.embedding(blk.token_ids, embed), blk.positions, attention_masks(drafter, blk.anchors, 32, "sdpa")
        )
        pos = blk.positions.clamp(max=31)
        prev = torch.gather(ids, 1, pos).reshape(-1)
        q = torch.softmax(drafter.logits(h.reshape(-1, H), head, prev), -1)
        p = torch.softmax(
            torch.gather(target_hidden, 1, pos[..., None].expand(-1, -1, H)).reshape(-1, H) @ head.t(), -1
        )
        tv = 0.5 * (q - p).abs().sum(-1)
        conf = drafter.confidence_head(h.reshape(-1, H), drafter.markov_head.embed(prev))
        ce = F.cross_entropy(drafter.logits(h.reshape(-1, H), head, prev), blk.labels.reshape(-1), reduction="none")
        per = (
            own.ce_weight * ce
            + own.tv_weight * tv
            + own.bce_weight * F.binary_cross_entropy_with_logits(conf, 1 - tv, reduction="none")
        )
        w = blk.weights.reshape(-1)
        torch.testing.assert_close(out.loss.loss.detach(), (per * w).sum() / w.sum(), rtol=1e-4, atol=1e-5)


def test_loss_decreases_on_a_fixed_batch_and_confidence_is_a_probability():
    drafter = _drafter()
    embed, head, feats, ids, mask, teacher = _batch()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = forward_loss(
            drafter,
            embed,
            head,
            feats,
            ids,
            mask,
            num_anchors=6,
            generator=torch.Generator().manual_seed(0),
            teacher=teacher,
        )
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
        losses.append(float(out.loss.loss.detach()))
    # the BCE against a soft label cannot reach 0 (its floor is the label's entropy)
    assert losses[-1] < 0.7 * losses[0], losses[::10]
    assert drafter.markov_head.markov_w2.weight.abs().sum() > 0  # the Markov head learned
    blk = out.blocks
    with torch.no_grad():
        h = drafter(
            feats, F.embedding(blk.token_ids, embed), blk.positions, attention_masks(drafter, blk.anchors, 32, "sdpa")
        )
        prev = torch.gather(ids, 1, blk.positions.clamp(max=31))
        conf = drafter.confidence(h.reshape(-1, H), prev.reshape(-1))
    assert ((conf > 0) & (conf < 1)).all() and conf.std() > 0
    # without the target's distribution: the fallback loss also learns
    drafter = _drafter(seed=1)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first = last = None
    for _ in range(60):
        out = forward_loss(
            drafter, embed, head, feats, ids, mask, num_anchors=6, generator=torch.Generator().manual_seed(0)
        )
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
        first, last = first or float(out.loss.loss.detach()), float(out.loss.loss.detach())
    assert last < 0.6 * first, (first, last)


def test_loss_terms_and_chunking():
    """The TV term is ½ L1 against the target's whole distribution (its last hidden states through the
    head), and a loss computed in many small chunks equals the loss in one, gradients included."""
    from dflash_ray.drafter import dspark

    drafter = _drafter()
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.1)
    torch.nn.init.normal_(drafter.confidence_head.proj.weight, std=0.1)
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(2, 6, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g) * 0.2
    prev, labels = torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (2, 6), generator=g)
    weights = torch.rand(2, 6, generator=g)
    target = torch.randn(2, 6, H, generator=g) * 3
    out = dspark.dspark_loss(drafter, hidden, head, prev, labels, weights, target)
    grad = torch.autograd.grad(out.loss, hidden)[0]

    h, p, y = hidden.reshape(-1, H), prev.reshape(-1), labels.reshape(-1)
    logits = drafter.logits(h, head, p)
    pd = torch.softmax(logits, -1)
    pt = torch.softmax(target.reshape(-1, H) @ head.t(), -1)
    tv = 0.5 * (pd - pt).abs().sum(-1)
    conf = drafter.confidence_head(h, drafter.markov_head.embed(p))
    per = (
        0.1 * F.cross_entropy(logits, y, reduction="none")
        + 0.9 * tv
        + F.binary_cross_entropy_with_logits(conf, (1 - tv).detach(), reduction="none")
    )
    ref = (per * weights.reshape(-1)).sum() / weights.sum()
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, hidden)[0])

    old = dspark.MAX_CHUNK_LOGITS
    dspark.MAX_CHUNK_LOGITS = 2 * V  # chunks of two rows
    try:
        chunked = dspark.dspark_loss(drafter, hidden, head, prev, labels, weights, target)
        torch.testing.assert_close(torch.autograd.grad(chunked.loss, hidden)[0], grad)
    finally:
        dspark.MAX_CHUNK_LOGITS = old
    torch.testing.assert_close(chunked.loss, out.loss)
    assert torch.equal(chunked.correct, out.correct)


def test_hard_labels_alone_skip_the_targets_distribution_and_label_the_confidence_with_hits():
    """With tv_weight 0 the loss is ce_weight x CE + BCE(confidence, [argmax = label]) whatever
    target states come with the batch: the target's distribution is neither computed nor read."""
    import dataclasses

    from dflash_ray.drafter import dspark

    drafter = _drafter()
    drafter.cfg = drafter.cfg.replace(settings=dataclasses.replace(drafter.cfg.settings, ce_weight=0.5, tv_weight=0))
    torch.nn.init.normal_(drafter.confidence_head.proj.weight, std=0.1)
    g = torch.Generator().manual_seed(0)
    hidden, head = torch.randn(2, 6, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    prev, labels = torch.randint(0, V, (2, 6), generator=g), torch.randint(0, V, (2, 6), generator=g)
    labels[0, :3] = drafter.logits(hidden[0, :3], head, prev[0, :3]).argmax(-1)  # some hits
    weights = torch.rand(2, 6, generator=g)
    losses = [
        dspark.dspark_loss(drafter, hidden, head, prev, labels, weights, target).loss
        for target in (torch.randn(2, 6, H, generator=g) * 3, torch.full((2, 6, H), float("nan")))
    ]
    h, p, y = hidden.reshape(-1, H), prev.reshape(-1), labels.reshape(-1)
    logits = drafter.logits(h, head, p)
    hit = (logits.argmax(-1) == y).float()
    conf = drafter.confidence_head(h, drafter.markov_head.embed(p))
    per = 0.5 * F.cross_entropy(logits, y, reduction="none") + F.binary_cross_entropy_with_logits(
        conf, hit, reduction="none"
    )
    ref = (per * weights.reshape(-1)).sum() / weights.sum()
    assert hit.sum() >= 3
    torch.testing.assert_close(losses[0], ref)
    torch.testing.assert_close(losses[1], ref)  # NaN target states: never read


def test_export_round_trip_in_vllm_dspark_format(tmp_path):
    from safetensors import safe_open

    from dflash_ray.drafter.export import load_drafter, save_drafter

    drafter = _drafter()
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight)
    save_drafter(drafter, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["model_type"] == "qwen3"
    assert "dflash_config" not in config
    assert {
        k: config[k]
        for k in (
            "block_size",
            "mask_token_id",
            "target_layer_ids",
            "markov_rank",
            "enable_confidence_head",
            "confidence_head_with_markov",
            "sample_from_anchor",
        )
    } == {
        "block_size": 5,
        "mask_token_id": V - 1,
        "target_layer_ids": drafter.cfg.target_layer_ids,
        "markov_rank": 8,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": True,
    }
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
    } <= names
    loaded = load_drafter(tmp_path / "out")
    assert isinstance(loaded, DSparkDrafter) and loaded.cfg == drafter.cfg
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


def _trained_dspark(tmp_path, steps=150):
    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512, seed=3)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(
        target.config,
        mask_token_id=511,
        num_layers=1,
        target_layer_ids=[0, 1, 2],
        block_size=7,
        family="dspark",
        settings={"markov_rank": 32},
    )
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (8,), generator=g).tolist() for _ in range(3)]
    refs = [target_decode(target, p, 48, eos_ids=set()) for p in prompts]
    untrained = [speculative_decode(target, drafter, embed, head, p, 48, set()) for p in prompts]
    seqs = torch.tensor([p + r.token_ids for p, r in zip(prompts, refs)])
    mask = torch.zeros_like(seqs)
    mask[:, 8:] = 1
    want = torch.zeros_like(mask)
    want[:, :-1] = mask[:, 1:]
    feats, _, _, last = target_outputs(target, seqs, cfg.target_layer_ids, want_BS=want, last_hidden=True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        out = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=24, generator=g, teacher=last)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    return target, drafter.eval(), embed, head, prompts, refs, untrained


def test_speculative_output_equals_target_decode(tmp_path):
    target, drafter, embed, head, prompts, refs, untrained = _trained_dspark(tmp_path)
    assert [u.token_ids for u in untrained] == [r.token_ids for r in refs]
    trained = [speculative_decode(target, drafter, embed, head, p, 48, set()) for p in prompts]
    assert [t.token_ids for t in trained] == [r.token_ids for r in refs]
    tau = sum(sum(t.acceptance) for t in trained) / sum(len(t.acceptance) for t in trained)
    assert tau > 2, [t.acceptance for t in trained]
    assert max(max(t.acceptance) for t in trained) <= 8  # K = 7 drafts plus the bonus token


def test_sampled_drafts_come_from_the_markov_conditioned_q():
    """Each sampled draft's q is the warped base logits plus the Markov bias of the draft before it
    (the anchor first): the q the verification divides by is the one the draft was drawn from."""
    drafter = _drafter(markov_rank=8).eval()
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight)
    g = torch.Generator().manual_seed(0)
    embed, head, context = (
        torch.randn(V, H, generator=g),
        torch.randn(V, H, generator=g),
        torch.randn(1, 9, 2 * H, generator=g),
    )
    sampling = Sampling(0.7, 0.95, torch.Generator().manual_seed(1), greedy_drafts=False)
    drafts, q = families.get("dspark").propose(drafter, context, 17, embed, head, sampling)
    assert drafts.shape == (5,) and q.shape == (5, V)
    with torch.no_grad():
        ids = torch.full((1, 5), V - 1)
        ids[0, 0] = 17
        h = drafter(
            context,
            F.embedding(ids, embed),
            torch.arange(9, 14)[None],
            attention_masks(drafter, torch.tensor([[9]]), 9, "sdpa"),
        )[0]
        prev = torch.cat([torch.tensor([17]), drafts[:-1]])
        torch.testing.assert_close(q, warp(drafter.logits(h, head, prev), 0.7, 0.95))
    assert (q[torch.arange(5), drafts] > 0).all()
    greedy, none = families.get("dspark").propose(drafter, context, 17, embed, head, Sampling())
    assert none is None
    with torch.no_grad():
        prev = torch.cat([torch.tensor([17]), greedy[:-1]])
        assert torch.equal(drafter.logits(h, head, prev).argmax(-1), greedy)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_speculative_sampling_reproduces_the_targets_distribution(tmp_path):
    """Sampled drafts, the first drawn from q conditioned on the anchor through the Markov head: the
    first two tokens of 1,500 seeded one-step runs against the target's exact joint distribution
    (chi-square at a 0.1% false-alarm rate), as the DFlash test does."""
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
        family="dspark",
        settings={"markov_rank": 8},
    )
    torch.manual_seed(1)
    drafter = DSparkDrafter(cfg).eval()
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)  # a Markov bias that matters
    sampled_pairs_match_the_target(target, drafter, embed, head, new_tokens=3)


def _tiny_run_inputs(tmp_path, num_rows=4):
    """A tiny target and a tokenized dataset of repeated random sequences."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ray import manifest, storage

    target = tiny_qwen3(tmp_path / "target", num_layers=4, hidden_size=64, vocab_size=512)
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "id": f"s{i}",
            "source": "x",
            "input_ids": torch.randint(0, 490, (12,), generator=g).repeat(4).tolist(),
            "loss_mask": [0] * 12 + [1] * 36,
            "seq_len": 48,
            "truncated": False,
        }
        for i in range(num_rows)
    ]
    data = str(tmp_path / "data")
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes(storage.join(data, "part-0.parquet"), buf.getvalue())
    manifest.write_manifest(data, kind="tokenized", files=[{"name": "part-0.parquet", "rows": num_rows}], summary={})
    return target, data


def test_train_drafter_dspark_reaches_the_workers(tmp_path):
    """`train.drafter=dspark` through the training roles (as plain classes): the drafter config is
    DSpark's, the target sends its last hidden states without `train.distill`, and steps learn."""
    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    target, data = _tiny_run_inputs(tmp_path)
    cfg = load_config(
        None,
        [
            "train.drafter=dspark",
            "train.family.markov_rank=16",
            "train.block_size=6",
            "train.num_layers=1",
            "train.target_layer_ids=[0,1,2]",
            "train.num_anchors=16",
            "train.lr=3e-3",
            "train.distill_top_k=8",
        ],
    )
    drafter_json = drafter_config(target, cfg)
    assert drafter_json["architectures"] == ["DSparkDraftModel"] and drafter_json["markov_rank"] == 16
    batch = TargetWorker(target, [0, 1, 2], cfg.train).features([(f"{data}/part-0.parquet", 0)])
    # the TV term's target distribution: the target's last hidden states (its head is the drafter's), no top-k
    assert batch["target_hidden"].shape == (1, 48, 64) and "teacher_ids" not in batch
    worker = DrafterWorker(target, json.dumps(drafter_json), "random", cfg.train, 0, 1)
    assert isinstance(worker.drafter, DSparkDrafter)
    worker.set_total_steps(25)
    stats = [worker.train_step(step, batch) for step in range(25)]
    assert stats[-1]["loss"] < 0.8 * stats[0]["loss"], [s["loss"] for s in stats]
    assert 1 <= stats[-1]["tau"] <= 7 and 0 <= stats[-1]["acc_k1"] <= 1
    assert max(worker.evaluate(batch)) >= 1


def test_hard_labels_alone_leave_the_targets_last_hidden_states_uncaptured(tmp_path):
    """With `tv_weight` 0 no loss of the run reads the target's distribution: the target sends only
    the features (nothing to capture, send or cache beyond them) and the drafter steps on them. A
    second drafter with the TV term (`train.drafters`) makes the target send them again."""
    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    target, data = _tiny_run_inputs(tmp_path)
    settings = [
        "train.drafter=dspark",
        "train.family.markov_rank=16",
        "train.family.tv_weight=0",
        "train.family.ce_weight=1",
        "train.block_size=4",
        "train.num_layers=1",
        "train.target_layer_ids=[0,1,2]",
        "train.num_anchors=8",
    ]
    cfg = load_config(None, settings)
    sample = [(f"{data}/part-0.parquet", 0)]
    batch = TargetWorker(target, [0, 1, 2], cfg.train).features(sample)
    assert sorted(k for k in batch if k not in ("seconds", "read_bytes")) == ["features", "input_ids", "loss_mask"]
    worker = DrafterWorker(target, json.dumps(drafter_config(target, cfg)), "random", cfg.train, 0, 1)
    worker.set_total_steps(2)
    assert math.isfinite(worker.train_step(0, batch)["loss"])

    soft = load_config(
        None, [*settings, 'train.drafters=[{"name": "hard"}, {"name": "soft", "family": {"tv_weight": 0.9}}]']
    )
    batch = TargetWorker(target, [0, 1, 2], soft.train).features(sample)
    assert batch["target_hidden"].shape == (1, 48, 64)


def test_a_dspark_run_trains_checkpoints_and_exports(ray_cluster, tmp_path):
    """`train.drafter=dspark` end to end on a local Ray cluster (two streams); its checkpoint's drafter
    (the serving format) loads as DSpark and decodes losslessly."""
    from dflash_ray.config import load_config
    from dflash_ray.train import checkpoint_files
    from dflash_ray.train import checkpoint
    from dflash_ray.stages.train import run_train

    target, data = _tiny_run_inputs(tmp_path, num_rows=8)
    cfg = load_config(
        None,
        [
            "train.drafter=dspark",
            "train.family.markov_rank=16",
            "train.block_size=6",
            "train.actor_cpus=0.5",
            "train.num_layers=1",
            "train.target_layer_ids=[0,1,2]",
            "train.num_anchors=16",
            "train.lr=3e-3",
            "train.checkpoint_every=2",
            "train.epochs=1",
            "train.distill_top_k=8",
            "train.colocate=true",  # the paired path trains DSpark in test_train.py
        ],
    )
    out = run_train(target, data, str(tmp_path / "run"), cfg, progress=False)
    assert out["step"] == out["total_steps"] == 4
    assert checkpoint.complete_steps(str(tmp_path / "run"))[-1] == 4
    drafter = checkpoint_files.assemble(checkpoint.step_dir(str(tmp_path / "run"), 4))[0].eval()
    assert isinstance(drafter, DSparkDrafter) and drafter.cfg.block_size == 6
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    embed, head = load_embed_and_head(target)
    prompt = [5, 9, 31, 2, 77]
    assert (
        speculative_decode(model, drafter, embed, head, prompt, 24, set()).token_ids
        == target_decode(model, prompt, 24, set()).token_ids
    )


def test_teacher_forced_blocks_accept_what_decoding_accepts(tmp_path):
    """Every block real greedy decoding drafted accepts as many drafts as the same block read off one
    training forward over the target's own answer (`teacher_forced`): the bench that scores recipes
    that way scores what serving would accept."""
    from dflash_ray.drafter.teacher_forced import blocks_accepted

    target, drafter, embed, head, prompts, refs, _ = _trained_dspark(tmp_path, steps=60)
    K = drafter.cfg.block_size
    compared, partial = 0, 0
    for prompt, ref in zip(prompts, refs):
        seq = torch.tensor([prompt + ref.token_ids])
        mask = torch.zeros_like(seq)
        mask[:, len(prompt) :] = 1
        feats = target_outputs(target, seq, drafter.cfg.target_layer_ids)[0]
        forced = {a: (d, n) for a, d, n in blocks_accepted(drafter, embed, head, feats, seq, mask)}
        real = speculative_decode(target, drafter, embed, head, prompt, 48, set())
        anchor = len(prompt)
        for (_, accepted), committed in zip(real.verified, real.acceptance):
            if anchor in forced and forced[anchor][0] == K:  # the whole block lies inside the answer
                assert forced[anchor][1] == accepted, (anchor, forced[anchor], accepted)
                compared += 1
                partial += 0 < accepted < K
            anchor += committed
    assert compared >= 10 and partial >= 2, (compared, partial)

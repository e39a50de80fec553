"""Scoring a drafter by one teacher-forced forward and a walk (`teacher_forced.walks`) gives what real
greedy speculative decoding verifies, block for block, for every family (CPU, tiny sizes)."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from conftest import small_qwen3_config
from dflash_ray.drafter import families
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.speculative import acceptance_by_position, speculative_decode, target_decode
from dflash_ray.drafter.teacher_forced import Walk, answers, position_counts, summary, walk, walks
from dflash_ray.target_model.capture import target_features

PROMPT, NEW, K = 8, 32, 6  # prompt tokens, max_new_tokens, block size
SETTINGS = {"dflash": {}, "dspark": {"markov_rank": 16}, "dflash2": {"selector_rank": 8, "selector_top_k": 6}}


@pytest.fixture(scope="module")
def target():
    """A tiny target (untied head: its greedy answers vary rather than repeat one token), its
    embedding and head, prompts, and its greedy answers run a block past the cap (what decoding's
    target verifies beyond max_new_tokens)."""
    torch.manual_seed(3)
    config = small_qwen3_config(tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    embed, head = model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (PROMPT,), generator=g).tolist() for _ in range(3)]
    answers = [target_decode(model, p, NEW + K, eos_ids=set()).token_ids for p in prompts]
    return model, embed, head, prompts, answers


def _trained(family: str, target, steps: int = 40):
    """A drafter trained a few dozen steps on the target's own answers, so blocks accept drafts."""
    model, embed, head, prompts, answers = target
    cfg = from_target(
        model.config,
        mask_token_id=511,
        num_layers=1,
        target_layer_ids=[0, 1, 2],
        block_size=K,
        family=family,
        settings=SETTINGS[family],
    )
    torch.manual_seed(0)
    drafter = families.get(family).build(cfg)
    seqs, mask = _batch(prompts, answers)
    feats = target_features(model, seqs, cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        out = families.get(family).forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=24, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    return drafter.eval()


def _batch(prompts, answers):
    seqs = torch.tensor([p + a for p, a in zip(prompts, answers)])
    mask = torch.zeros_like(seqs)
    mask[:, PROMPT:] = 1
    return seqs, mask


@pytest.mark.parametrize("family", list(SETTINGS))
def test_walk_verifies_what_greedy_speculative_decoding_verifies(target, family):
    """With the answer known a block past where decoding stops, every verified block's (drafts,
    accepted) and committed tokens are decoding's exactly, at the cap and at an end-of-sequence token;
    with the answer cut where decoding stopped, the committed tokens still are, and a block reaching
    past the answer reports the drafts it could check."""
    model, embed, head, prompts, long_answers = target
    drafter = _trained(family, target)
    # an end-of-sequence token that first appears mid-answer: decoding stops there, and the blocks
    # before it verify drafts past it
    eos = next(t for a in long_answers for i, t in enumerate(a) if i >= 12 and t not in a[:i])
    seqs, mask = _batch(prompts, long_answers)
    feats = target_features(model, seqs, drafter.cfg.target_layer_ids)
    accepted_some = partial = 0
    for eos_ids in (set(), {eos}):
        scored = walks(drafter, embed, head, feats, seqs, mask, max_new_tokens=NEW, eos_ids=eos_ids)
        real = [speculative_decode(model, drafter, embed, head, p, NEW, eos_ids) for p in prompts]
        for r, w, a in zip(real, scored, long_answers):
            assert r.token_ids == a[: len(r.token_ids)]  # decoding's output is the target's greedy answer
            assert w.verified == r.verified, (family, eos_ids, w.verified, r.verified)
            assert w.acceptance == r.acceptance and w.tau == r.tau
            accepted_some += sum(n >= 1 for _, n in r.verified)
            partial += sum(0 < n < d for d, n in r.verified)
        # the answers as decoding left them: nothing known past its end
        cut_seqs = [p + r.token_ids for p, r in zip(prompts, real)]
        for p, r, s in zip(prompts, real, cut_seqs):
            one = torch.tensor([s])
            m = torch.zeros_like(one)
            m[:, PROMPT:] = 1
            w = walks(drafter, embed, head, target_features(model, one, drafter.cfg.target_layer_ids), one, m)[0]
            assert w.acceptance == r.acceptance
            for (d, n), (rd, rn) in zip(w.verified, r.verified):  # a run reaching the end may go on past it
                assert (d, n) == (rd, rn) or (d < rd and (n == rn if n < d else n <= rn)), (w.verified, r.verified)
            assert len(w.verified) == len(r.verified)
    assert accepted_some >= 10 and partial >= 3, (accepted_some, partial)  # not all zeros, not all whole


def test_walk_anchors_each_block_where_the_last_one_ended():
    # anchors 10..: a block at 10 accepts 2 (commits 3), at 13 none (commits 1), at 14 runs past the cap
    blocks = {10: (5, 2), 11: (5, 5), 12: (5, 5), 13: (5, 0), 14: (5, 5), 15: (5, 1), 16: (4, 4)}
    assert walk(blocks, start=10, length=8) == Walk([(5, 2), (5, 0), (5, 5)], [3, 1, 3])
    assert walk(blocks, start=10, length=1) == Walk()  # the prefill's token alone: no block
    assert walk(blocks, start=10, length=8).tau == 7 / 3


def test_answers_are_the_runs_of_the_loss_mask():
    assert answers([0, 0, 1, 1, 1, 0, 1, 1]) == [(2, 5), (6, 8)]
    assert answers([0, 0]) == []


def test_position_counts_and_summary_pool_by_sums():
    verified = [(3, 0), (3, 1), (3, 3), (3, 2), (2, 2)]
    counts = position_counts(verified)
    assert counts == [(5, 4), (4, 3), (2, 1)]
    assert [round(a / r, 4) for r, a in counts] == acceptance_by_position(verified)
    short, long = Walk([(3, 3)], [4]), Walk([(3, 0)] * 3, [1, 1, 1])
    s = summary([short, long])
    assert s["tau_per_prompt"] == [4.0, 1.0] and s["tau"] == 7 / 4 and s["blocks"] == 4

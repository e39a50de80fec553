import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.speculative import acceptance_by_position, speculative_decode, target_decode
from dflash_ray.drafter.forward import forward_loss
from dflash_ray.target_model.capture import load_embed_and_head, target_features
from dflash_ray.tiny_models import tiny_qwen3, tiny_qwen35


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen35-gated-deltanet"])
def test_speculative_output_equals_target_decode(tmp_path, hybrid):
    """Lossless, untrained and trained; a hybrid target's recurrent state is rolled back to the
    accepted tokens (its cache cannot be cropped)."""
    build = tiny_qwen35 if hybrid else tiny_qwen3
    path = build(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512, seed=3)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(target.config, mask_token_id=511, num_layers=1, target_layer_ids=[0, 1, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (8,), generator=g).tolist() for _ in range(3)]
    refs = [target_decode(target, p, 48, eos_ids=set()) for p in prompts]

    untrained = [speculative_decode(target, drafter, embed, head, p, 48, set()) for p in prompts]
    assert [u.token_ids for u in untrained] == [r.token_ids for r in refs]
    assert all(sum(u.acceptance) + 1 == 48 for u in untrained)

    # train on the target's own continuations: the drafter now accepts, the output stays the same
    seqs = torch.tensor([p + r.token_ids for p, r in zip(prompts, refs)])
    mask = torch.zeros_like(seqs)
    mask[:, 8:] = 1
    feats = target_features(target, seqs, cfg.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(150):
        out = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=24, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    drafter.eval()
    trained = [speculative_decode(target, drafter, embed, head, p, 48, set()) for p in prompts]
    assert [t.token_ids for t in trained] == [r.token_ids for r in refs]
    tau = sum(sum(t.acceptance) for t in trained) / sum(len(t.acceptance) for t in trained)
    assert tau > 2, [t.acceptance for t in trained]
    # the rates by position multiply back to the mean accepted drafts: nothing lost between them
    verified = [v for t in trained for v in t.verified]
    rates = acceptance_by_position(verified)
    assert len(rates) == cfg.block_size - 1 and rates[0] > 0.5
    reach, expected = 1.0, 0.0
    for rate in rates:
        reach *= rate or 0.0
        expected += reach
    assert abs(expected - sum(a for _, a in verified) / len(verified)) < 2e-3


def test_acceptance_by_position_is_conditional_on_the_positions_before():
    verified = [(3, 0), (3, 1), (3, 3), (3, 2), (2, 2)]  # (drafted, accepted) per verify step
    # position 1: 4 of 5; position 2: 3 of the 4 that reached it; position 3: 1 of the 2 that drafted it
    assert acceptance_by_position(verified) == [0.8, 0.75, 0.5]
    assert acceptance_by_position([]) == []


def _chi_square_p_value(counts: dict, expected: dict, n: int) -> float:
    """Pearson's goodness of fit of sample `counts` to the exact `expected` probabilities; cells
    expected below 5 are pooled into one."""
    big = [c for c, p in expected.items() if p * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [expected[c] * n for c in big] + [n * (1 - sum(expected[c] for c in big))]
    cells = [(o, e) for o, e in zip(observed, exp) if e > 1e-9]
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def sampled_pairs_match_the_target(
    target,
    drafter,
    embed,
    head,
    *,
    new_tokens: int,
    greedy_drafts: bool = False,
    prompt=(3, 7, 1, 9, 4),
    T: float = 0.3,
    top_p: float = 0.9,
    n: int = 1500,
) -> dict:
    """The first two tokens of `n` seeded one-verify-step speculative runs against the target's exact
    joint distribution of them (chi-square at a 0.1% false-alarm rate); both the accept and the
    reject paths must be taken. Every drafter family's sampled path is held to this. Returns the
    exact distribution."""
    from dflash_ray.drafter.speculative import Sampling, warp

    prompt, vocab = list(prompt), embed.shape[0]
    with torch.no_grad():  # the exact joint distribution of the first two tokens
        p1 = warp(target(input_ids=torch.tensor([prompt])).logits[0, -1], T, top_p)
        firsts = p1.nonzero().flatten().tolist()
        seconds = warp(target(input_ids=torch.tensor([prompt + [x] for x in firsts])).logits[:, -1], T, top_p)
    expected = {
        (a, b): float(p1[a] * seconds[i, b]) for i, a in enumerate(firsts) for b in range(vocab) if seconds[i, b] > 0
    }
    sampling = Sampling(T, top_p, torch.Generator().manual_seed(0), greedy_drafts=greedy_drafts)
    counts: dict = {}
    steps = []
    for _ in range(n):
        out = speculative_decode(target, drafter, embed, head, prompt, new_tokens, set(), sampling)
        key = tuple(out.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        steps.append(out.acceptance[0])
    assert 1 in steps and max(steps) > 1, "both the accept and the reject paths must be exercised"
    assert _chi_square_p_value(counts, expected, n) > 1e-3
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("greedy_drafts", [True, False])
def test_speculative_sampling_reproduces_the_targets_distribution(tmp_path, greedy_drafts):
    """The first two sampled tokens (temperature 0.3, top-p 0.9) of 1,500 seeded speculative runs
    against the target's exact joint distribution of them: a chi-square test at a 0.1% false-alarm
    rate. The same test on the drafter's own proposals (no verification) must fail: it has power."""
    from dflash_ray.drafter.speculative import warp

    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=24, seed=5)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(target.config, mask_token_id=23, num_layers=1, target_layer_ids=[0, 1, 2])
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).eval()
    expected = sampled_pairs_match_the_target(target, drafter, embed, head, new_tokens=4, greedy_drafts=greedy_drafts)
    prompt, T, top_p, n = [3, 7, 1, 9, 4], 0.3, 0.9, 1500

    # the drafter's own proposals for the same two positions are a different distribution
    with torch.no_grad():
        feats = target_features(target, torch.tensor([prompt]), cfg.target_layer_ids)
        from dflash_ray.drafter.forward import attention_masks

        block = torch.full((1, 16), 23)
        block[0, 0] = prompt[-1]
        positions = torch.arange(len(prompt) - 1, len(prompt) + 15)[None]
        hidden = drafter(
            feats[:, :-1],
            torch.nn.functional.embedding(block, embed),
            positions,
            attention_masks(drafter, torch.tensor([[len(prompt) - 1]]), len(prompt) - 1, "sdpa"),
        )
        q = warp(hidden[0, 1:3] @ head.t(), T, top_p)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, n, replacement=True, generator=g).t().tolist()
    proposals: dict = {}
    for a, b in draws:
        proposals[(a, b)] = proposals.get((a, b), 0) + 1
    assert _chi_square_p_value(proposals, expected, n) < 1e-3

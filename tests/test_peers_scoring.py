"""The peers bench's scoring and statistics (`dflash_ray.drafter.answer_scoring`, `bench.peers`): a
drafter scored on cached greedy answers gives what greedy speculative decoding commits, prompt lookup
is scored as `evaluate` scores it, counts add over seeds, each pair gets its interval and verdict,
and the scoring sets hold none of the training prompts (CPU, tiny models, no Ray)."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from bench import peers
from dflash_ray.drafter import families, ngram
from dflash_ray.drafter.answer_scoring import (
    Answer,
    answer_features,
    cached_answers,
    counts,
    drafter_walks,
    greedy_answers,
    lookup_walks,
    pooled_positions,
    record,
)
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.speculative import speculative_decode
from dflash_ray.drafter.teacher_forced import Walk, walk


def test_help_lists_quick_and_seeds(capsys):
    with pytest.raises(SystemExit) as done:
        peers.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--quick" in out and "--seeds" in out, out


def test_drafter_scored_on_cached_answers_commits_what_speculative_decoding_does(tmp_path):
    """A tiny target's answers, decoded once and read back, then a drafter's walks over them: the
    tokens committed a block equal real greedy speculative decoding's, prompt by prompt."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(config).eval()
    embed, head = target.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    cfg = from_target(config, mask_token_id=255, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    drafter = families.get(cfg.family).build(cfg).eval()
    g = torch.Generator().manual_seed(1)
    encoded = [({"id": i, "source": "s"}, torch.randint(0, 250, (6,), generator=g).tolist()) for i in range(3)]
    eos = {7}
    path, key = tmp_path / "answers.json", {"prompts": "three"}
    answers = cached_answers(path, key, lambda: greedy_answers(target, encoded, 12, eos))
    assert cached_answers(path, key, lambda: pytest.fail("decoded again")) == answers
    feats = answer_features(target, answers, list(cfg.target_layer_ids))
    scored = drafter_walks(drafter, embed, head, feats, answers, 12, eos)
    for (_, ids), a, w in zip(encoded, answers, scored):
        real = speculative_decode(target, drafter, embed, head, ids, 12, eos)
        assert real.token_ids == a.answer and w.acceptance == real.acceptance, (w, real)
    kept = record(answers, scored)
    assert [p["tokens"] for p in kept["prompts"]] == [len(a.answer) - 1 for a in answers]  # all but the prefill's
    assert kept["tau"] == sum(len(a.answer) - 1 for a in answers) / sum(len(w.acceptance) for w in scored)


def test_lookup_walk_is_walk_over_accepted_at():
    """Prompt lookup scored as `evaluate` scores it commits what `walk` commits over `accepted_at`'s
    blocks, the unit the drafters are scored in."""
    prompt = [1, 2, 3, 4, 5, 1, 2]
    answer = [3, 4, 5, 9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 5, 6]
    tokens, start = prompt + answer, len(prompt)
    blocks = {a: (4, ngram.accepted_at(tokens, a, 4, 2, 4)) for a in range(start, len(tokens))}
    [mine] = lookup_walks([Answer("p", "s", prompt, answer)], 4, 2, 4)
    assert mine.acceptance == walk(blocks, start, len(answer)).acceptance
    assert sum(mine.acceptance) == len(answer) - 1 and max(mine.acceptance) > 1


def _records(per_prompt: list[list[int]]) -> dict:
    """A record from each prompt's committed tokens a block."""
    answers = [Answer(str(i), "s", [0], [0] * (sum(a) + 1)) for i, a in enumerate(per_prompt)]
    return record(answers, [Walk([(3, c - 1) for c in a], a) for a in per_prompt])


def test_counts_add_over_seeds_and_positions():
    seeds = [_records([[1, 2], [3]]), _records([[2, 2], [1, 1]])]
    arm = counts(seeds)
    assert arm.tokens_PS.tolist() == [[3, 4], [3, 2]] and arm.blocks_PS.tolist() == [[2, 2], [1, 2]]
    assert arm.tau == pytest.approx(12 / 7)
    # position 1: every block reached it; accepted by those that committed 2 or more
    assert pooled_positions(seeds)[0] == (7, 4)
    with pytest.raises(AssertionError):
        counts([_records([[1]]), _records([[1], [1]])])


def test_intervals_pair_each_of_ours_with_the_peers_random_init_and_lookup():
    """A clear gain is `above` with its interval over 1.0; equal arms are within the noise; prompt
    lookup (one record, the same every seed) pairs with each seed of ours."""
    many = [[2, 2, 1]] * 8
    better = [_records([[3, 3, 2]] * 8), _records([[3, 2, 3]] * 8)]
    scores = {
        "specforge": [{"kept": _records(many)}, {"kept": _records(many)}],
        "target": [{"kept": r} for r in better],
        "random": [{"kept": _records(many)}, {"kept": _records(many)}],
        "lookup": [{"kept": _records(many)}],
    }
    found = peers.intervals(scores, seeds=2)
    assert set(found) == {f"{p}_kept" for p in ("target_over_specforge", "random_over_specforge")} | {
        "target_over_random_kept",
        "target_over_lookup_kept",
        "random_over_lookup_kept",
    }
    gain = found["target_over_specforge_kept"]
    assert gain["verdict"] == "above" and gain["low"] > 1 and gain["ratio"] == pytest.approx((8 / 3) / (5 / 3), 1e-3)
    assert found["random_over_specforge_kept"]["verdict"] == "within noise"
    assert found["target_over_lookup_kept"] == found["target_over_random_kept"]
    row = peers.arm_row("dflash-ray", scores["target"], [])
    assert row["seeds"] == 2 and row["tau_kept"] == pytest.approx(8 / 3, 1e-3) and row["sd_kept"] == 0.0
    json.dumps(found)  # the summary line


def test_scoring_sets_hold_none_of_the_training_prompts(tmp_path):
    """The bundled sets the bench makes: 8 unseen kinds and 32 copy tasks over the unseen prompts'
    texts, none of them a prompt of the demo's training inputs (word for word)."""
    import argparse

    from bench.copy_prompts import passages
    from bench.scaling import steps_config
    from dflash_ray.drafter.acceptance import prompt_rows
    from dflash_ray.stages.demo import bundled_inputs

    args = argparse.Namespace(batch=2, anchors=4, gamma=7.0, lr=3e-3, warmup=0.04, max_new_tokens=4)
    cfg = steps_config(str(tmp_path), 2, peers.settings(args))
    uris = peers.prompt_sets(["unseen_kinds", "copy"], {}, tmp_path, cfg)
    rows = {name: prompt_rows(uri, 100) for name, uri in uris.items()}
    assert {name: len(r) for name, r in rows.items()} == {"unseen_kinds": 8, "copy": 32}
    trained = set(passages(bundled_inputs(), min_chars=1))
    asked = [m["content"] for r in rows.values() for row in r for m in row["messages"] if m["role"] == "user"]
    assert not trained & set(asked)
    with pytest.raises(SystemExit, match="none of"):
        peers.prompt_sets(["nope"], {}, tmp_path, cfg)

"""The gate's boundary rules (`data.mask_bounds`): a loss mask one token off, one that never covers the
end-of-turn token, and loss on a tool result each pass every other rule; these fail the gate, naming
the rule and decoding the offending tokens, while the masks `tokenize` makes (conversations answered
turn by turn, tool calls, thinking off, samples cut at max_seq_len or at max_tokens) pass. No Ray:
samples are rendered and masked here as `tokenize` does."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray.config import TokenizeConfig, load_config
from dflash_ray.data import mask_bounds, masking
from dflash_ray.data.tokenized import open_tokenized
from dflash_ray.data.validate import bound_stats, gate_rules, scan
from dflash_ray.stages.validate import run_validate
from test_tokenize_validate import _completion, _long_text, healthy_rows

EOT = "<|im_end|>"


@pytest.fixture(autouse=True)
def _one_tokenizer(monkeypatch, qwen3_tokenizer):
    """The gate loads its tokenizer by name on each run: the session's, loaded once, keeps the file fast."""
    monkeypatch.setattr("dflash_ray.registry.load_tokenizer", lambda name: qwen3_tokenizer)


def _conversations(n=40, seed=0):
    """Answered turn by turn: the earlier answer is trained on, as the template renders it."""
    rng = np.random.default_rng(seed)
    return [
        {
            **_completion(i, _long_text(rng, int(rng.integers(20, 50))), _long_text(rng, int(rng.integers(20, 60)))),
            "messages": [
                {"role": "user", "content": f"Question {i}: name some words."},
                {"role": "assistant", "content": _long_text(rng, int(rng.integers(10, 40)))},
                {"role": "user", "content": "And some more?"},
            ],
            "regenerate": True,
        }
        for i in range(n)
    ]


def _agentic(n=40, seed=1):
    """A tool call and its result before the answer: history, not trained on."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, row in enumerate(healthy_rows(n, seed)):
        call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": f'{{"day": {i}}}'}}
        rows.append(
            {
                **row,
                "messages": row["messages"]
                + [
                    {"role": "assistant", "content": "", "tool_calls": json.dumps([call])},
                    {"role": "tool", "tool_call_id": "c1", "content": _long_text(rng, int(rng.integers(5, 30)))},
                ],
            }
        )
    return rows


def _dataset(tmp_path, samples, name="data"):
    table = pa.table(
        {
            "input_ids": pa.array([s.input_ids.tolist() for s in samples], pa.list_(pa.int32())),
            "loss_mask": pa.array([s.loss_mask.tolist() for s in samples], pa.list_(pa.int8())),
            "id": [f"c{i:05d}" for i in range(len(samples))],
        }
    )
    (tmp_path / name).mkdir()
    pq.write_table(table, tmp_path / name / "part-0.parquet")
    return str(tmp_path / name)


def _remasked(tokenizer, rows, remask):
    """`rows` rendered as `tokenize` does, each mask then changed by `remask(ids, mask, eot)`."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    samples = [masking.render(tokenizer, r) for r in rows]
    return [masking.Sample(s.input_ids, remask(s.input_ids, s.loss_mask, eot).astype(np.int8)) for s in samples]


def _tool_result_trained(ids, mask, eot):
    """Loss on the tool's turn, after its header, through its end-of-turn token: no header under the
    loss, and the tool-call turn before it opens with an assistant header, so `prompt_loss` passes it."""
    out = mask.copy()
    opener = int(ids[0])  # <|im_start|>
    tool = np.flatnonzero(ids == opener)[-2]  # the turn before the answer's
    out[tool + 3 : np.flatnonzero(ids == eot)[-2] + 1] = 1  # after "<|im_start|>user\n"
    return out


FAULTS = {  # remask, the rows, the failed rules, what the decoded example shows (repr'd, the loss in ⟦ ⟧)
    "shifted-right": (
        lambda ids, m, eot: np.concatenate([[0], m[:-1]]),
        _conversations,
        ["loss_shift"],
        r"<\|im_start\|>assistant\\n\w+⟦ \w+",  # the answer's first word left out
    ),
    "past-end-of-turn": (
        lambda ids, m, eot: m | np.concatenate([[0], (m == 1)[:-1] & (ids[:-1] == eot)]),
        _conversations,
        ["loss_shift"],
        r"<\|im_end\|>\\n⟧<\|im_start\|>user",  # the newline after <|im_end|> trained on
    ),
    "shifted-left": (
        lambda ids, m, eot: np.concatenate([m[1:], [0]]),
        _conversations,
        ["loss_shift", "end_of_turn"],
        r"<\|im_start\|>assistant⟦\\n",  # the header's newline trained on
    ),
    "no-end-of-turn": (
        lambda ids, m, eot: np.where(ids == eot, 0, m),
        _conversations,
        ["end_of_turn"],
        r"\w⟧<\|im_end\|>",
    ),
    "tool-result": (
        _tool_result_trained,
        _agentic,
        ["non_assistant_loss"],
        r"<\|im_start\|>user\\n⟦<tool_response>",
    ),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_gate_fails_a_mask_off_its_turn_naming_the_rule_and_the_tokens(tmp_path, qwen3_tokenizer, fault):
    remask, rows, failed, shows = FAULTS[fault]
    data = _dataset(tmp_path, _remasked(qwen3_tokenizer, rows(), remask))
    report = run_validate(data, load_config(), tokenizer_name="qwen3")
    assert report["failed_rules"] == failed, report["rules"]
    assert report["stats"]["prompt_loss_share"] == 0  # what the gate passed before
    for rule in (r for r in report["rules"] if r["rule"] in failed):
        assert rule["value"] == 1.0 and "e.g. c00000 at token " in rule["message"], rule
    message = next(r["message"] for r in report["rules"] if r["rule"] == failed[0])
    assert re.search(shows, message), message


def test_the_cli_exits_3_naming_the_rule(tmp_path, capsys, qwen3_tokenizer):
    from dflash_ray.cli import main

    remask, rows, _, _ = FAULTS["no-end-of-turn"]
    data = _dataset(tmp_path, _remasked(qwen3_tokenizer, rows(), remask))
    code = main(["validate", "--input", data, "--tokenizer", "qwen3", "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 3 and summary["failed_rules"] == ["end_of_turn"], summary["failed_rules"]
    assert summary["stats"]["mask_bounds"]["end_of_turn"] == 1.0 and "end_of_turn: 100.0% of samples" in err


def _generation_cut(tokenizer, rows, max_tokens=48, seed=2):
    """Replayed engine outputs: two in three stopped at max_tokens (no end-of-turn token, kept)."""
    rng = np.random.default_rng(seed)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    samples = []
    for i, row in enumerate(rows):
        prompt = tokenizer(
            tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        output = rng.integers(1000, 9000, size=max_tokens if i % 3 else int(rng.integers(10, max_tokens))).tolist()
        samples.append(masking.replay(prompt, output + ([] if i % 3 else [eot])))
    return samples


def test_masks_tokenize_makes_pass_every_boundary_rule(tmp_path, qwen3_tokenizer):
    tok = qwen3_tokenizer
    plain = healthy_rows(20)
    samples = [masking.render(tok, r) for r in plain + _conversations(20) + _agentic(20)]
    samples += [masking.render(tok, {**r, "reasoning": None}, enable_thinking=False) for r in plain]
    cap = int(np.percentile([s.input_ids.size for s in samples], 80))  # a fifth cut mid-answer at max_seq_len
    samples = [masking.apply_length_policy(s, TokenizeConfig(max_seq_len=cap)) for s in samples]
    samples += _generation_cut(tok, healthy_rows(30, seed=3))
    assert sum(s.truncated for s in samples) >= 10
    report = run_validate(_dataset(tmp_path, samples), load_config(), tokenizer_name="qwen3")
    assert report["stats"]["mask_bounds"] == {**dict.fromkeys(mask_bounds.RULES, 0.0), "examples": {}}, report["rules"]
    assert not {"loss_shift", "end_of_turn", "non_assistant_loss"} & set(report["failed_rules"]), report["rules"]


def test_a_template_without_markers_skips_the_rules_saying_so(tmp_path, qwen3_tokenizer, monkeypatch):
    sample = masking.render(qwen3_tokenizer, healthy_rows(2)[0])
    bare = qwen3_tokenizer
    monkeypatch.setattr(bare, "chat_template", None)
    assert mask_bounds.markers(bare) == "the tokenizer has no chat template that asks for an answer"
    found = scan(open_tokenized(_dataset(tmp_path, [sample])), bare)
    stats = {**_PASSING_STATS, "mask_bounds": bound_stats(found, bare, has_id=True)}
    rules = gate_rules(stats, load_config().validate.gate)
    skipped = [r for r in rules if r["rule"] in mask_bounds.RULES]
    assert len(skipped) == 3 and all(r["passed"] and r["message"].startswith("skipped: ") for r in skipped), skipped


_PASSING_STATS = {
    "loss_mask_sum": {"most_common": [], "max": 0, "median": 64},
    "no_loss_share": 0.0,
    "prompt_loss_share": 0.0,
    "all_loss_share": 0.0,
    "duplicates": 0,
    "duplicate_share": 0.0,
    "empty_thinking_share": None,
}

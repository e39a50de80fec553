"""Conversations regenerated turn by turn: the target answers each user turn with its own earlier
answers in the history, and tokenization trains on every answer and nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_ray.config import GenerateConfig, TokenizeConfig
from dflash_ray.data.formats import normalize
from dflash_ray.data.masking import render, tokenize_record
from dflash_ray.generation.completions import ShardGenerator

CONVERSATION = {
    "conversations": [
        {"from": "human", "value": "Name a primary colour."},
        {"from": "gpt", "value": "Red."},
        {"from": "human", "value": "Name another one."},
        {"from": "gpt", "value": "Blue."},
        {"from": "human", "value": "And a third?"},
        {"from": "gpt", "value": "Yellow."},
    ]
}


def runs(tokenizer, ids: np.ndarray, mask: np.ndarray) -> tuple[list[str], list[str]]:
    """The decoded runs of consecutive masked tokens, and of unmasked ones."""
    edges = np.flatnonzero(np.diff(mask)) + 1
    pieces = [(int(m[0]), tokenizer.decode(i.tolist())) for i, m in zip(np.split(ids, edges), np.split(mask, edges))]
    return [t for m, t in pieces if m], [t for m, t in pieces if not m]


class Recording:
    """A real engine that keeps the prompts it was given."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def submit(self, prompts, seeds):
        self.prompts += prompts
        return self.engine.submit(prompts, seeds)

    def __getattr__(self, name):  # step, unfinished, abort: the engine's own
        return getattr(self.engine, name)


def test_regenerate_is_the_default_for_conversations_and_keeps_the_user_turns():
    (prompt,) = normalize(CONVERSATION)
    assert prompt.regenerate and [m["content"] for m in prompt.messages] == [
        "Name a primary colour.",
        "Name another one.",
        "And a third?",
    ]
    assert not normalize({"conversations": CONVERSATION["conversations"][:2]})[0].regenerate  # one turn
    assert not normalize(CONVERSATION, "user_turns")[0].regenerate


@pytest.mark.slow
def test_three_turns_regenerated_by_smollm2_and_every_answer_under_the_mask(smollm2_tokenizer):
    from dflash_ray.generation.engines import HFEngine
    from dflash_ray.registry import resolve, stop_token_ids

    tok = smollm2_tokenizer
    cfg = GenerateConfig(backend="transformers", max_tokens=12, max_model_len=1024, temperature=0.0, truncated="keep")
    engine = Recording(HFEngine(resolve("smollm2-135m-instruct"), cfg, stop_token_ids(tok)))
    (prompt,) = normalize(CONVERSATION)
    result = ShardGenerator(tok, engine, cfg, "smollm2", "g0").run([prompt.row("chat")])
    assert not result.rejects and len(engine.prompts) == 3  # one engine call per turn
    (record,) = result.completions
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"] + [record["text"]]
    assert all(answers) and answers[:2] != ["Red.", "Blue."]  # the target's own answers, not the dataset's
    # turn 2's prompt holds turn 1's regenerated answer; turn 3's is the record's prompt
    assert f"<|im_start|>assistant\n{answers[0]}<|im_end|>" in tok.decode(engine.prompts[1])
    assert answers[1] not in tok.decode(engine.prompts[1])
    assert engine.prompts[2] == record["prompt_token_ids"]

    sample = tokenize_record(tok, record, TokenizeConfig(tokenizer="smollm2-135m-instruct"))
    assert sample.input_ids.tolist() == record["prompt_token_ids"] + record["output_token_ids"]
    masked, unmasked = runs(tok, sample.input_ids, sample.loss_mask)
    last = tok.decode(record["output_token_ids"])
    assert masked == [f"{answers[0]}<|im_end|>", f"{answers[1]}<|im_end|>", last]
    # every other token is the template's: rendered history, user turns and headers, no answer text
    rendered = tok.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=False)
    assert tok.decode(sample.input_ids.tolist()) == rendered + last
    assert not any(a in u for a in answers for u in unmasked)
    assert unmasked[-1].endswith("<|im_start|>user\nAnd a third?<|im_end|>\n<|im_start|>assistant\n")

    # text alone (no token ids) trains on the same tokens
    text_only = {k: v for k, v in record.items() if k not in ("prompt_token_ids", "output_token_ids")}
    again = render(tok, text_only)
    if record["finish_reason"] == "stop":
        assert again.input_ids.tolist() == sample.input_ids.tolist()
        assert again.loss_mask.tolist() == sample.loss_mask.tolist()
    # the same record not marked as regenerated trains on its last answer only
    once = tokenize_record(tok, {**record, "regenerate": False}, TokenizeConfig())
    assert runs(tok, once.input_ids, once.loss_mask)[0] == [last]


def test_a_thinking_template_drops_earlier_thinking_and_trains_on_the_answers(qwen3_tokenizer):
    record = {
        "id": "c",
        "regenerate": True,
        "reasoning": "Third one.",
        "text": "Yellow.",
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another?"},
        ],
    }
    sample = render(qwen3_tokenizer, record)
    masked, unmasked = runs(qwen3_tokenizer, sample.input_ids, sample.loss_mask)
    assert masked == ["Red.<|im_end|>", "<think>\nThird one.\n</think>\n\nYellow.<|im_end|>"]
    assert "assistant\n" in unmasked[0] and not any("Red." in u for u in unmasked)


def test_a_cut_earlier_answer_rejects_the_conversation_naming_the_turn(tiny_qwen3_dir, qwen3_tokenizer):
    from dflash_ray.generation.engines import HFEngine
    from dflash_ray.registry import stop_token_ids

    cfg = GenerateConfig(
        backend="transformers", max_tokens=4, max_model_len=256, temperature=0.0, enable_thinking=False
    )
    engine = HFEngine(tiny_qwen3_dir, cfg, stop_token_ids(qwen3_tokenizer))
    (prompt,) = normalize(CONVERSATION)
    result = ShardGenerator(qwen3_tokenizer, engine, cfg, "tiny", "g0").run([prompt.row("chat")])
    (reject,) = result.rejects  # random weights never stop in 4 tokens
    assert not result.completions and reject["kind"] == "truncated" and reject["reason"].startswith("turn 1: ")


def test_evaluation_measures_a_conversation_on_its_first_turn(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_ray import manifest
    from dflash_ray.stages.prompts import shard_bytes
    from dflash_ray.drafter.acceptance import prompt_rows

    new, old = tmp_path / "new", tmp_path / "old"
    rows = [
        p.row("chat")
        for p in normalize(CONVERSATION)
        + normalize({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
    ]
    for folder, table in (
        (new, pa.Table.from_pylist(rows)),  # and a shard from before the column existed
        (old, pa.Table.from_pylist([{k: v for k, v in r.items() if k != "regenerate"} for r in rows])),
    ):
        folder.mkdir()
        (folder / "prompts-00000.parquet").write_bytes(shard_bytes(table.to_pylist(), table.schema))
        manifest.write_manifest(
            str(folder), kind="prompts", files=[{"name": "prompts-00000.parquet", "rows": 2}], summary={}
        )
    assert [[m["content"] for m in r["messages"]] for r in prompt_rows(str(new), 10)] == [
        ["Name a primary colour."],
        ["Be brief.", "Hi"],
    ]
    assert [len(r["messages"]) for r in prompt_rows(str(old), 10)] == [3, 2]  # as they were: no turns to answer
    assert pq.read_schema(new / "prompts-00000.parquet").names[-1] == "regenerate"


def test_a_conversation_that_outgrows_the_engine_keeps_the_turns_that_fit(tiny_qwen3_dir, qwen3_tokenizer):
    from dflash_ray.generation.engines import HFEngine
    from dflash_ray.registry import stop_token_ids

    def run(max_model_len: int):
        cfg = GenerateConfig(
            backend="transformers",
            max_tokens=4,
            max_model_len=max_model_len,
            temperature=0.0,
            enable_thinking=False,
            truncated="keep",
        )
        engine = Recording(HFEngine(tiny_qwen3_dir, cfg, stop_token_ids(qwen3_tokenizer)))
        (prompt,) = normalize(CONVERSATION)
        return engine, ShardGenerator(qwen3_tokenizer, engine, cfg, "tiny", "g0").run([prompt.row("chat")])

    whole, result = run(512)
    assert len(whole.prompts) == 3 and result.counts()["conversations_cut"] == 0
    cut, result = run(len(whole.prompts[2]))  # the third turn's prompt no longer fits
    assert len(cut.prompts) == 2 and not result.rejects and result.counts()["conversations_cut"] == 1
    (record,) = result.completions
    assert record["prompt_token_ids"] == whole.prompts[1]  # the second turn, as in the whole run
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user"]

"""Records that once aborted a run or were read wrong without a word: each is now read as written or
quarantined alone, naming its line (or field) and the reason, and the run goes on with the rest."""

import json

import pytest

from dflash_ray import cli, manifest, storage
from dflash_ray.config import TokenizeConfig
from dflash_ray.data import records
from dflash_ray.data.formats import (
    BadRecord,
    normalize,
    normalize_answered,
    split_thinking,
    template_opens_thinking,
)
from dflash_ray.data.masking import TokenizeBatch, render, tokenize_record

USER = {"role": "user", "content": "q"}
R1_TEMPLATE = (  # R1's way: the generation prompt opens the thinking block, the answer only closes it
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def _chat(text):
    return json.dumps({"messages": [{"role": "user", "content": text}]})


def _faulty_lines(limit):
    """(text, kind or None) per line: good records around each fault."""
    return [
        (_chat("first"), None),
        ("[" * 100_000, "nested_too_deep"),
        ('{"messages": [{"role": "user", "content": "n"}], "seed": ' + "7" * 5000 + "}", "number_too_long"),
        ("[" * 150 + "]" * 150, "nested_too_deep"),  # parses, but deeper than any chat record
        (_chat("x" * limit), "record_too_large"),
        (_chat("last"), None),
    ]


def test_a_deep_a_long_number_and_a_huge_record_are_each_quarantined_alone(monkeypatch):
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 8000)
    lines = _faulty_lines(8000)
    data = "\n".join(text for text, _ in lines).encode() + b"\n"
    read = list(records.json_lines("in.jsonl", data))
    assert [(r.line, r.error.kind if r.error else None) for r in read] == [
        (n, kind) for n, (_, kind) in enumerate(lines, start=1)
    ]
    assert "5000 digits" in str(read[2].error) and "8,000" in str(read[4].error)
    assert read[2].raw.startswith('{"messages"')  # kept for its quarantine entry

    # the same values as the elements of a .json array, one a line: each alone, the rest read
    document = ("[\n" + ",\n".join(text for text, _ in lines) + "\n]\n").encode()
    read = list(records.json_document("in.json", document))
    assert [(r.item, r.error.kind if r.error else None) for r in read] == [
        (n, kind) for n, (_, kind) in enumerate(lines, start=1)
    ]

    # a whole list dumped on one line past the size is read element by element
    line = json.dumps([json.loads(_chat(f"a{i}")) for i in range(400)])
    assert len(line) > 8000
    read = list(records.json_lines("in.jsonl", (_chat("first") + "\n" + line + "\n").encode()))
    assert len(read) == 401 and not any(r.error for r in read) and read[-1].item == 400 and read[-1].line == 2


def test_the_prompts_run_goes_on_past_them_and_counts_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(records, "MAX_RECORD_BYTES", 8000)
    lines = _faulty_lines(8000)
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(text for text, _ in lines) + "\n")
    out = tmp_path / "out"
    code = cli.main(["prompts", "--input", str(source), "--output", str(out), "--json"])  # the budget on
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, summary
    assert (summary["records"], summary["prompts"], summary["quarantined"]) == (6, 2, 4)
    assert summary["quarantine_kinds"] == {"nested_too_deep": 2, "number_too_long": 1, "record_too_large": 1}
    quarantined = [json.loads(x) for x in storage.read_text(summary["quarantine_file"]).splitlines()]
    assert [(q["line"], q["kind"]) for q in quarantined] == [(n, k) for n, (_, k) in enumerate(lines, 1) if k]
    assert sorted(r["messages"][0]["content"] for r in manifest.read_rows(str(out), ["messages"], 10)) == [
        "first",
        "last",
    ]


def test_messages_and_conversations_in_one_record_is_refused_naming_both():
    record = {"messages": [USER], "conversations": [{"from": "human", "value": "other"}]}
    with pytest.raises(BadRecord, match="both 'conversations' and 'messages'") as e:
        normalize(record)
    assert e.value.kind == "ambiguous_schema"
    with pytest.raises(BadRecord, match="both"):
        normalize_answered({**record, "messages": [USER, {"role": "assistant", "content": "a"}]})
    # a null one is absent (as an Arrow row has it): the other is the conversation
    assert normalize({"messages": [USER], "conversations": None})[0].messages == [USER]


def test_a_system_prompt_given_as_a_list_is_read_or_refused_naming_the_part():
    sharegpt = {"conversations": [{"from": "human", "value": "q"}]}
    for system, text in (
        (["Be brief.", "Be kind."], "Be brief.\nBe kind."),
        ([{"type": "text", "text": "Be brief."}], "Be brief."),
    ):
        assert normalize({**sharegpt, "system": system})[0].messages == [{"role": "system", "content": text}, USER]
        alpaca = normalize({"instruction": "q", "system": system})[0]
        assert alpaca.messages[0] == {"role": "system", "content": text}
    with pytest.raises(BadRecord, match=r"system\[1\]: unsupported content part 'image_url'"):
        normalize({**sharegpt, "system": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "x"}]})
    with pytest.raises(BadRecord, match="system: must be a string or a list of text parts, got dict"):
        normalize({**sharegpt, "system": {"text": "a"}})


def test_nan_or_infinity_in_tools_is_refused_naming_the_field():
    line = '{"messages": [{"role": "user", "content": "q"}], "tools": [{"name": "f", "limits": [1, NaN]}]}'
    (read,) = records.json_lines("in.jsonl", line.encode())  # Python reads NaN; JSON has none
    with pytest.raises(BadRecord, match=r"tools\[0\]\.limits\[1\]: nan is no JSON value"):
        normalize(read.record)
    with pytest.raises(BadRecord, match="tools: Infinity is no number JSON holds"):
        normalize({"messages": [USER], "tools": '[{"name": "f", "max": Infinity}]'})
    call = {"function": {"name": "f", "arguments": {"x": float("-inf")}}}
    with pytest.raises(BadRecord, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments\.x: -inf"):
        normalize_answered({"messages": [USER, {"role": "assistant", "content": "", "tool_calls": [call]}]})
    with pytest.raises(BadRecord, match="tools: NaN is no number JSON holds"):  # and in tokenize's records
        render(None, {"messages": [USER], "text": "a", "tools": '[{"x": NaN}]'})


def test_a_closing_tag_the_answer_writes_about_stays_answer(qwen3_tokenizer, smollm2_tokenizer):
    prose = "The tag </think> closes a thinking block."
    assert split_thinking(prose) == (prose, None)
    assert split_thinking("Use <think> and </think> around it.") == ("Use <think> and </think> around it.", None)
    # R1's data (its template opened the block): a closing tag on a line of its own, as models write it
    assert split_thinking("Two is prime.\n</think>\n\nTwo.") == ("Two.", "Two is prime.")
    with pytest.raises(BadRecord, match="a block that does not start the answer"):  # tags on lines: a guess
        split_thinking("Two.\n<think>\nplan\n</think>\nMore.")

    # a target whose generation prompt opens the block: its first `</think>` closes it, what follows
    # is answer as written, the tags it mentions included
    assert not template_opens_thinking(qwen3_tokenizer) and not template_opens_thinking(smollm2_tokenizer)
    from dflash_ray.registry import load_tokenizer

    r1 = load_tokenizer("smollm2-135m-instruct")
    r1.chat_template = R1_TEMPLATE
    assert template_opens_thinking(r1)
    answer = "Plan it.</think>The tag </think> closes the block."
    assert split_thinking(answer, opened=True) == ("The tag </think> closes the block.", "Plan it.")
    assert split_thinking("<think>Plan.</think>\n\nDone.", opened=True) == ("Done.", "Plan.")
    with pytest.raises(BadRecord, match="nested"):
        split_thinking("a <think> b</think>c", opened=True)


def test_the_responses_stage_reads_answers_by_the_targets_template(tmp_path):
    from dflash_ray.config import load_config
    from dflash_ray.registry import load_tokenizer
    from dflash_ray.stages.prompts import run_prompts

    r1 = load_tokenizer("smollm2-135m-instruct")
    r1.chat_template = R1_TEMPLATE
    r1.save_pretrained(tmp_path / "r1")
    answers = {"q1": "Plan.</think>Say </think> to close it.", "q2": "The tag </think> is prose here."}
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in answers.items()
        )
    )
    rows = {}
    for name, tokenizer in (("r1", str(tmp_path / "r1")), ("smollm2", "smollm2-135m-instruct")):
        cfg = load_config(None, [f"prompts.tokenizer={tokenizer}", "prompts.max_prompt_tokens=0"])
        run_prompts([str(source)], str(tmp_path / f"out-{name}"), cfg, progress=False, responses=True)
        rows[name] = {
            r["messages"][0]["content"]: (r["reasoning"], r["text"])
            for r in manifest.read_rows(str(tmp_path / f"out-{name}"), ["messages", "reasoning", "text"], 10)
        }
    assert rows["r1"] == {"q1": ("Plan.", "Say </think> to close it."), "q2": ("The tag", "is prose here.")}
    assert rows["smollm2"] == {"q1": (None, answers["q1"]), "q2": (None, answers["q2"])}


def test_tool_calls_the_template_cannot_render_are_refused(smollm2_tokenizer, qwen3_tokenizer):
    calls = json.dumps([{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}])
    record = {"messages": [USER], "text": "", "tool_calls": calls}
    with pytest.raises(BadRecord, match=r"\(lookup missing\): it renders no answer tokens") as e:
        render(smollm2_tokenizer, record)  # SmolLM2's template has no tool calls
    assert e.value.kind == "template_error"
    with pytest.raises(BadRecord, match="the answer would be trained on without them"):
        render(smollm2_tokenizer, {**record, "text": "Looking it up."})
    with pytest.raises(BadRecord, match="renders no answer tokens") as e:
        render(smollm2_tokenizer, {"messages": [USER], "text": "  "})
    assert e.value.kind == "empty_response"
    sample = render(qwen3_tokenizer, record)  # Qwen3's renders them: trained on
    answer = qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask.astype(bool)])
    assert '"name": "lookup"' in answer


def test_replayed_ids_outside_the_vocabulary_or_empty_are_rejected_alone():
    batch = TokenizeBatch(TokenizeConfig(tokenizer="smollm2-135m-instruct"))  # 49152 ids
    good = {"id": "ok", "messages": [USER], "text": "a", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5]}
    rows = [
        good,
        {**good, "id": "past", "output_token_ids": [4, 49152]},
        {**good, "id": "negative", "output_token_ids": [-1]},
        {**good, "id": "empty", "output_token_ids": []},
        {**good, "id": "prompt", "prompt_token_ids": [1, 10**6]},
    ]
    columns, rejects = batch(rows, [{"file": "c.jsonl", "line": n} for n in range(1, 6)])
    assert columns["id"] == ["ok"]
    by_id = {r["id"]: r for r in rejects}
    assert by_id["past"]["kind"] == "out_of_vocabulary" and by_id["past"]["line"] == 2
    assert (
        "output_token_ids[1]: token id 49152 is outside the tokenizer's vocabulary of 49152" in by_id["past"]["reason"]
    )
    assert by_id["negative"]["reason"].startswith("output_token_ids[0]: -1 is not a token id")
    assert by_id["empty"]["kind"] == "empty_response" and "output_token_ids: empty" in by_id["empty"]["reason"]
    assert by_id["prompt"]["reason"].startswith("prompt_token_ids[1]: token id 1000000 is outside")


def test_a_key_given_twice_is_refused_naming_it_by_every_reader(tmp_path, capsys):
    """JSON keeps the last of a key given twice without a word: the readers refuse the record."""
    twice = '{"messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", "content": "b"}]}'
    nested = '{"messages": [{"role": "user", "content": "a", "content": "b"}]}'
    read = list(records.json_lines("in.jsonl", f"{_chat('first')}\n{twice}\n{nested}\n".encode()))
    assert [r.error.kind if r.error else None for r in read] == [None, "duplicate_key", "duplicate_key"]
    assert str(read[1].error).startswith("messages: the key is given twice") and read[1].raw.startswith('{"messages"')
    assert str(read[2].error).startswith("content: the key is given twice")
    (read,) = records.json_document("in.json", f"[{twice}]".encode())  # an array's element, alone
    assert read.error.kind == "duplicate_key" and read.item == 1
    with pytest.raises(BadRecord, match="tools: name: the key is given twice"):  # tools stored as a JSON string
        normalize({"messages": [USER], "tools": '[{"name": "f", "name": "g"}]'})
    with pytest.raises(BadRecord, match=r"messages\[0\]\.tool_calls: id: the key is given twice") as e:
        render(None, {"messages": [{**USER, "tool_calls": '[{"id": 1, "id": 2}]'}], "text": "a"})
    assert e.value.kind == "duplicate_key"

    source = tmp_path / "in.jsonl"
    source.write_text(f"{_chat('first')}\n{twice}\n")
    out = tmp_path / "out"
    assert cli.main(["prompts", "--input", str(source), "--output", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["prompts"], summary["quarantine_kinds"]) == (1, {"duplicate_key": 1})
    (entry,) = [json.loads(x) for x in storage.read_text(summary["quarantine_file"]).splitlines()]
    assert entry["line"] == 2 and "messages: the key is given twice" in entry["reason"]


def test_the_thinking_is_read_under_each_name_and_two_that_differ_are_refused():
    """`reasoning_content` (OpenAI-style logs), `reasoning` (vLLM now), `thinking` (other exports)."""
    for name in ("reasoning_content", "reasoning", "thinking"):
        answer = {"role": "assistant", "content": "Two.", name: "Two is prime."}
        assert normalize_answered({"messages": [USER, answer]}).reasoning == "Two is prime."
        # a prompt's earlier answers give it too: read, then dropped with the answer
        assert (
            normalize({"messages": [USER, answer, {**USER, "content": "again"}]})[0].messages[-1]["content"] == "again"
        )
    both = {"role": "assistant", "content": "Two.", "reasoning_content": "Two is prime.", "reasoning": "Two is prime."}
    assert normalize_answered({"messages": [USER, both]}).reasoning == "Two is prime."
    empty = {**both, "reasoning_content": "", "thinking": None}  # an empty one gives none
    assert normalize_answered({"messages": [USER, empty]}).reasoning == "Two is prime."
    differ = {**both, "thinking": "Two is even."}
    refused = r"messages\[1\]\.thinking: differs from messages\[1\]\.reasoning_content"
    with pytest.raises(BadRecord, match=refused):
        normalize_answered({"messages": [USER, differ]})
    with pytest.raises(BadRecord, match=refused):  # the prompts read the turn as well
        normalize({"messages": [USER, differ, {**USER, "content": "again"}]})
    sharegpt = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "reasoning": "x", "thinking": "y"}]
    with pytest.raises(
        BadRecord, match=r"conversations\[1\]\.thinking: differs from conversations\[1\]\.reasoning"
    ) as e:
        normalize_answered({"conversations": sharegpt})
    assert e.value.kind == "ambiguous_thinking"
    block = {"role": "assistant", "content": "<think>\nTwo is even.\n</think>\n\nTwo.", "reasoning": "Two is prime."}
    with pytest.raises(BadRecord, match="the answer's <think> block and its own thinking field") as e:
        normalize_answered({"messages": [USER, block]})
    same = {**block, "reasoning": "Two is even."}
    assert normalize_answered({"messages": [USER, same]}).reasoning == "Two is even."
    with pytest.raises(BadRecord, match=r"messages\[1\]\.reasoning: content must be a string, got int"):
        normalize_answered({"messages": [USER, {"role": "assistant", "content": "a", "reasoning": 7}]})


TURN = "<|im_end|>\n<|im_start|>user\nand now?"  # ChatML's turn tokens, written inside a text


def test_text_holding_the_templates_special_tokens_is_refused_naming_field_and_token(smollm2_tokenizer):
    batch = TokenizeBatch(TokenizeConfig(tokenizer="smollm2-135m-instruct"))
    good = {"id": "ok", "messages": [USER], "text": "An answer about <think> and <tool_call> tags."}
    call = [{"type": "function", "function": {"name": "f", "arguments": {"q": "<|endoftext|>"}}}]
    rows = [
        good,
        {**good, "id": "text", "text": f"Sure.{TURN}"},
        {**good, "id": "reasoning", "reasoning": f"plan{TURN}"},
        {**good, "id": "prompt", "messages": [{**USER, "content": f"q{TURN}"}]},
        {**good, "id": "calls", "tool_calls": json.dumps(call)},
        {**good, "id": "tools", "tools": json.dumps([{"name": "f", "description": "ends <|im_start|>"}])},
    ]
    columns, rejects = batch(rows, [{"file": "c.jsonl", "line": n} for n in range(1, 7)])
    assert columns["id"] == ["ok"]
    by_id = {r["id"]: r for r in rejects}
    assert {r["kind"] for r in rejects} == {"special_token"} and by_id["text"]["line"] == 2
    assert by_id["text"]["reason"].startswith("text: holds the tokenizer's special token '<|im_end|>' as text")
    assert by_id["reasoning"]["reason"].startswith("reasoning: holds the tokenizer's special token '<|im_end|>'")
    assert by_id["prompt"]["reason"].startswith("messages[0].content: holds the tokenizer's special token")
    assert "tool_calls: holds the tokenizer's special token '<|endoftext|>'" in by_id["calls"]["reason"]
    assert "tools: holds the tokenizer's special token '<|im_start|>'" in by_id["tools"]["reason"]

    # a regenerated conversation's replayed prompt is the rendering of its messages: checked as well
    answered = [USER, {"role": "assistant", "content": f"one{TURN}"}, {**USER, "content": "q2"}]
    replayed = {"id": "r", "messages": answered, "regenerate": True, "prompt_token_ids": [1], "output_token_ids": [2]}
    with pytest.raises(BadRecord, match=r"messages\[1\]\.content: holds the tokenizer's special token '<\|im_end\|>'"):
        tokenize_record(smollm2_tokenizer, replayed, TokenizeConfig(tokenizer="smollm2-135m-instruct"))


def test_generation_refuses_a_prompt_holding_special_tokens(smollm2_tokenizer):
    from dflash_ray.config import GenerateConfig
    from dflash_ray.generation.completions import ShardGenerator

    gen = ShardGenerator(smollm2_tokenizer, object(), GenerateConfig(), "m", "g0")
    assert gen.render({"messages": [USER], "tools": None})
    with pytest.raises(BadRecord, match=r"messages\[0\]\.content: holds the tokenizer's special token") as e:
        gen.render({"messages": [{**USER, "content": f"q{TURN}"}], "tools": None})
    assert e.value.kind == "special_token"

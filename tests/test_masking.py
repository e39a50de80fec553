import json

import numpy as np
import pytest

from dflash_ray.config import TokenizeConfig
from dflash_ray.data.formats import BadRecord
from dflash_ray.data.masking import TokenizeBatch, apply_length_policy, render, replay, tokenize_record

REASONING = "The user wants 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391."
ANSWER = "17 × 23 = **391**."


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_qwen3_thinking_mask_token_by_token(qwen3_tokenizer):
    tok = qwen3_tokenizer
    record = {
        "messages": [{"role": "system", "content": "You are exact."}, {"role": "user", "content": "What is 17 * 23?"}],
        "reasoning": REASONING,
        "text": ANSWER,
    }
    sample = render(tok, record)
    prompt = (
        "<|im_start|>system\nYou are exact.<|im_end|>\n<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    response = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>"
    expected_ids = _ids(tok, prompt) + _ids(tok, response)
    assert sample.input_ids.tolist() == expected_ids
    assert sample.loss_mask.tolist() == [0] * len(_ids(tok, prompt)) + [1] * len(_ids(tok, response))
    tokens = tok.convert_ids_to_tokens(sample.input_ids.tolist())
    first = int(np.argmax(sample.loss_mask))
    assert tokens[first - 3 : first] == ["<|im_start|>", "assistant", "Ċ"]  # header stays unmasked
    assert tokens[first] == "<think>" and tokens[-1] == "<|im_end|>" and sample.loss_mask[-1] == 1
    assert "</think>" in tokens[first:]
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.int8


def test_multi_turn_with_tools_masks_only_the_last_reply(qwen3_tokenizer):
    tok = qwen3_tokenizer
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    record = {
        "messages": [
            {"role": "system", "content": "Helpful."},
            {"role": "user", "content": "Hi"},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "tools": json.dumps(tools),
        "reasoning": "I should call the tool.",
        "text": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    sample = render(tok, record)
    text_prompt = tok.decode(sample.input_ids[sample.loss_mask == 0].tolist())
    text_response = tok.decode(sample.input_ids[sample.loss_mask == 1].tolist())
    assert "<tools>" in text_prompt and "get_weather" in text_prompt and "Weather in Paris?" in text_prompt
    assert text_prompt.endswith("<|im_start|>assistant\n")
    assert text_response.startswith("<think>\nI should call the tool.\n</think>")
    assert text_response.endswith("</tool_call><|im_end|>")
    # one contiguous masked span at the end
    first = int(np.argmax(sample.loss_mask))
    assert sample.loss_mask[first:].all() and not sample.loss_mask[:first].any()


def test_non_thinking_mode_masks_the_answer_only(qwen3_tokenizer):
    record = {"messages": [{"role": "user", "content": "Hi"}], "text": "Hello!"}
    sample = render(qwen3_tokenizer, record, enable_thinking=False)
    assert qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 1].tolist()) == "Hello!<|im_end|>"
    assert qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 0].tolist()).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_template_without_reasoning_support_gets_think_block(smollm2_tokenizer):
    record = {"messages": [{"role": "user", "content": "Hi"}], "reasoning": "Greet back.", "text": "Hello!"}
    sample = render(smollm2_tokenizer, record)
    assert (
        smollm2_tokenizer.decode(sample.input_ids[sample.loss_mask == 1].tolist())
        == "<think>\nGreet back.\n</think>\n\nHello!<|im_end|>"
    )


def test_replay_uses_engine_ids_exactly(qwen3_tokenizer):
    record = {
        "id": "a",
        "messages": [{"role": "user", "content": "ignored"}],
        "text": "ignored too",
        "prompt_token_ids": [5, 6, 7],
        "output_token_ids": [8, 9],
    }
    sample = tokenize_record(qwen3_tokenizer, record, TokenizeConfig())
    assert sample.input_ids.tolist() == [5, 6, 7, 8, 9] and sample.loss_mask.tolist() == [0, 0, 0, 1, 1]


def test_length_policies():
    sample = replay(list(range(6)), list(range(4)))
    cut = apply_length_policy(sample, TokenizeConfig(max_seq_len=8, overlong="truncate"))
    assert cut.truncated and cut.input_ids.tolist() == list(range(6)) + [0, 1] and cut.loss_mask.sum() == 2
    assert cut.cut == 2 and apply_length_policy(sample, TokenizeConfig(max_seq_len=10)).cut == 0
    with pytest.raises(BadRecord, match="over max_seq_len 8") as e:
        apply_length_policy(sample, TokenizeConfig(max_seq_len=8, overlong="drop"))
    assert e.value.kind == "overlong"
    with pytest.raises(BadRecord, match="no response token left"):
        apply_length_policy(sample, TokenizeConfig(max_seq_len=5, overlong="truncate"))


def test_batch_reports_rejects_with_reason():
    fn = TokenizeBatch(TokenizeConfig(max_seq_len=4, overlong="drop"))
    cols, rejects = fn(
        [
            {"id": "ok", "source": "s", "messages": [], "text": "", "prompt_token_ids": [1], "output_token_ids": [2]},
            {"id": "long", "source": "s", "prompt_token_ids": [1] * 5, "output_token_ids": [2]},
            {"id": "empty", "source": "s", "messages": [], "text": None},
        ]
    )
    assert cols["id"] == ["ok"] and cols["seq_len"] == [2]
    assert [(r["id"], r["kind"]) for r in rejects] == [("long", "overlong"), ("empty", "missing_field")]


def test_agentic_answers_keep_their_tool_calls_through_storage_and_the_template(qwen3_tokenizer):
    """An OpenAI chat with an assistant tool call (content null), its tool result, and a final answer
    that is itself a tool call: nothing is quarantined as empty, the history keeps the call and the
    result's call id through the completions schema, and the answer's call is what is trained on."""
    import pyarrow as pa

    from dflash_ray.data import schema
    from dflash_ray.data.formats import normalize_answered

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    again = {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Paris, then Lyon?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": None, "tool_calls": [again]},
        ]
    }
    answered = normalize_answered(record)
    assert answered.text == "" and json.loads(answered.tool_calls) == [again]
    assert answered.prompt.messages[1]["tool_calls"] and answered.prompt.messages[2]["tool_call_id"] == "c1"
    row = pa.Table.from_pylist([answered.row("agent")], schema=schema.COMPLETIONS).to_pylist()[0]  # as stored
    sample = render(qwen3_tokenizer, row, enable_thinking=False)
    prompt = qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 0].tolist())
    response = qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 1].tolist())
    assert '"Paris"' in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt
    assert response.startswith("<tool_call>") and '"Lyon"' in response and response.endswith("</tool_call><|im_end|>")
    # a conversation without tools keeps its id: no tool fields are added to its messages
    plain = normalize_answered(
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    )
    assert plain.prompt.messages == [{"role": "user", "content": "Hi"}]


def test_a_tool_call_without_a_function_name_is_a_bad_record():
    import pytest

    from dflash_ray.data.formats import BadRecord, normalize_answered

    with pytest.raises(BadRecord, match=r"messages\[1\].tool_calls\[0\].function.name"):
        normalize_answered(
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]},
                ]
            }
        )

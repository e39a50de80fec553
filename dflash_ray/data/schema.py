"""The record schemas that stages exchange through storage, in one place.

prompts   (written by `dflash-ray prompts`, read by generation)
    id        string   content hash of (messages, tools): stable across runs and machines
    source    string   input file stem the prompt came from
    messages  list<struct<role, content>>   system and user turns only
    tools     string?  JSON list of OpenAI tool schemas, when the prompt has tools
    turn      int32    user turn index (0 unless multi_turn = per_turn)
    regenerate bool?   the user turns are a conversation the target answers turn by turn, each
                       answer in the history of the next (multi_turn = regenerate, two user turns
                       or more); otherwise the messages are one prompt

completions  (written by `dflash-ray generate` as `COMPLETIONS`, read by `dflash-ray tokenize`;
              other writers may leave out the optional fields)
    the prompt fields (a message may also hold `tool_calls` and `tool_call_id`), plus (for a
    `regenerate` conversation, `messages` holds every turn before the last answer, the target's
    earlier answers included, and the fields below are the last turn's; tokenization trains on every
    assistant turn)
    prompt_token_ids  list<int32>?  exactly what the engine saw
    output_token_ids  list<int32>?  exactly what the engine produced (end-of-turn token included)
    text              string   answer content (after the thinking block when `reasoning` is set)
    reasoning         string?  content of the thinking block, when the model thought
    tool_calls        string?  the answer's tool calls (OpenAI JSON), when it makes any
    finish_reason     string   "stop" | "length" | ...
    num_prompt_tokens, num_output_tokens  int32
    model             string   the target that generated it
    sampling          string   JSON of the sampling and template settings
    generator_id      string   the generator actor that produced it
    When the token ids are present they are replayed exactly; text is never re-tokenized then.

tokenized  (written by `dflash-ray tokenize`, read by validation and training)
    id         string
    source     string
    input_ids  list<int32>   prompt + response tokens
    loss_mask  list<int8>    1 on every response token (thinking, answer, end of turn), else 0
    seq_len    int32
    truncated  bool          cut to max_seq_len by the over-long policy
"""

from __future__ import annotations

import pyarrow as pa

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
# a completion's history may hold tool turns: an assistant turn's `tool_calls` (OpenAI JSON), the
# call a tool result answers (`tool_call_id`); null where a turn has none
HISTORY_MESSAGE = pa.struct(list(MESSAGE) + [("tool_calls", pa.string()), ("tool_call_id", pa.string())])

PROMPTS = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),
        ("turn", pa.int32()),
        ("regenerate", pa.bool_()),
    ]
)

COMPLETION_FIELDS = ("id", "messages", "text")  # the least a completion record must hold

COMPLETIONS = pa.schema(
    [pa.field("messages", pa.list_(HISTORY_MESSAGE)) if f.name == "messages" else f for f in PROMPTS]
    + [
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("text", pa.string()),
        ("reasoning", pa.string()),
        ("tool_calls", pa.string()),
        ("finish_reason", pa.string()),
        ("num_prompt_tokens", pa.int32()),
        ("num_output_tokens", pa.int32()),
        ("model", pa.string()),
        ("sampling", pa.string()),
        ("generator_id", pa.string()),
    ]
)  # the least a completion record must hold

TOKENIZED = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("seq_len", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)

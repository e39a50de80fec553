"""Prompts the target writes itself: the template opening, the drops, and the stage on S3."""

import json

import pytest

from dflash_ray import manifest, storage
from dflash_ray.config import SelfPromptConfig, load_config
from dflash_ray.stages.prompts import run_prompts
from dflash_ray.errors import DFlashError
from dflash_ray.generation.engines import Output
from dflash_ray.generation.selfprompt import openings, select, user_turn_opening


def test_the_opening_ends_where_a_user_message_starts(smollm2_tokenizer):
    text = smollm2_tokenizer.decode(user_turn_opening(smollm2_tokenizer, SelfPromptConfig()))
    assert text.endswith("<|im_start|>user\n") and "<|im_start|>system" in text  # the template's default system
    text = smollm2_tokenizer.decode(user_turn_opening(smollm2_tokenizer, SelfPromptConfig(system="Be brief.")))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>user\n")


def test_cut_short_and_repeated_messages_are_dropped_by_reason():
    cfg = SelfPromptConfig(min_chars=10, system="Be brief.")
    candidates = [
        {"index": 3, "text": "How do I sort a list in Python?", "finish_reason": "stop"},
        {"index": 0, "text": "What is a  good name for a cat?", "finish_reason": "stop"},
        {"index": 1, "text": "what is a good NAME for a cat?", "finish_reason": "stop"},
        {"index": 2, "text": "Tell me", "finish_reason": "stop"},
        {"index": 4, "text": "Write a very long story about", "finish_reason": "length"},
    ]
    records, dropped = select(candidates, cfg)
    assert [r["id"] for r in records] == ["self-0", "self-3"]
    assert records[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a  good name for a cat?"},
    ]
    assert dropped == {"duplicate": 1, "too_short": 1, "cut_at_max_tokens": 1}


def test_degenerate_messages_and_near_copies_are_dropped_by_reason():
    cfg = SelfPromptConfig(min_chars=10)
    texts = [
        "How do I sort a list of numbers in Python?",
        "How do I sort a list of numbers in Python quickly?",  # a near copy of the first
        "#### ---- ==== #### ---- ==== 12345 67890",  # not letters
        "buy buy buy buy buy buy the the the the cheap",  # a few words repeated
        "How do I sort a list of names in Java by length?",  # shares an opening, not a copy
    ]
    records, dropped = select([{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)], cfg)
    assert [r["id"] for r in records] == ["self-0", "self-4"]
    assert dropped == {"near_duplicate": 1, "degenerate": 2}
    # a looser threshold keeps the near copy
    records, _ = select(
        [{"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)],
        SelfPromptConfig(min_chars=10, max_similarity=0.9),
    )
    assert len(records) == 3


def test_openings_are_the_distinct_starts_of_finished_messages_most_common_first():
    outs = [
        Output([5, 6, 7, 1], "stop"),
        Output([8, 9, 9, 1], "stop"),
        Output([8, 9, 9, 2, 1], "stop"),
        Output([3, 3, 3, 3], "length"),  # cut: its start is not taken
        Output([4, 1], "stop"),  # no longer than an opening
    ]
    assert openings(outs, 3) == [[8, 9, 9], [5, 6, 7]]


def test_stage_writes_prompts_the_prompts_stage_reads(ray_cluster, s3_bucket):
    from dflash_ray.stages.selfprompt import FILE, run_selfprompt

    settings = [
        "generate.backend=transformers",
        "generate.generators=2",
        "selfprompt.count=4",
        "selfprompt.openers=2",  # candidates 2 and 3 continue the openings of 0 and 1
        "selfprompt.max_tokens=48",
        "prompts.tokenizer=smollm2-135m-instruct",
    ]
    cfg = load_config(None, settings)
    out = f"{s3_bucket}/self"
    summary = run_selfprompt("smollm2-135m-instruct", out, cfg, progress=False)
    assert summary["candidates"] == 4 and summary["prompts"] + sum(summary["dropped"].values()) == 4
    assert summary["prompts"] >= 1 and not summary["reused"]
    lines = [json.loads(x) for x in storage.read_text(f"{out}/{FILE}").splitlines()]
    assert len(lines) == summary["prompts"] and all(r["messages"][-1]["role"] == "user" for r in lines)
    assert run_selfprompt("smollm2-135m-instruct", out, cfg, progress=False)["reused"]
    with pytest.raises(DFlashError) as e:
        run_selfprompt(
            "smollm2-135m-instruct", out, load_config(None, settings + ["selfprompt.seed=1"]), progress=False
        )
    assert manifest.MANIFEST in str(e.value)
    prompts = run_prompts([out], f"{s3_bucket}/prompts", cfg, progress=False)
    assert prompts["prompts"] == summary["prompts"] and prompts["quarantined"] == 0

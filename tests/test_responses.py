"""Existing responses: chat datasets whose last turn is the answer become completions that
`tokenize` reads as it reads generated ones; earlier turns are context, only the answer is trained
on; bad records are quarantined and counted; answers unlike a thinking target's are flagged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import pyarrow.parquet as pq

from dflash_ray import manifest
from dflash_ray.cli import main
from dflash_ray.config import load_config
from dflash_ray.stages.tokenize import run_tokenize

RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "Seven."},
            {"role": "user", "content": "And an even one?"},
            {"role": "assistant", "content": "<think>\nTwo is even and prime.\n</think>\n\nTwo."},
        ]
    },
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi there!"}]},
    {"instruction": "Add the numbers.", "input": "2 + 3", "output": "2 + 3 = 5."},
    {"messages": [{"role": "user", "content": "An unanswered question?"}]},
]


def _write(tmp_path) -> str:
    path = tmp_path / "answered.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "{not json\n")
    return str(path)


def _run(capsys, *args: str) -> tuple[int, dict]:
    code = main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_answers_become_completions_and_only_the_last_answer_is_trained_on(
    tmp_path, capsys, ray_cluster, smollm2_tokenizer
):
    out = str(tmp_path / "completions")
    code, summary = _run(
        capsys,
        "responses",
        "--input",
        _write(tmp_path),
        "--output",
        out,
        "--set",
        "prompts.tokenizer=smollm2-135m-instruct",
    )
    assert code == 0, summary
    assert summary["records"] == 5 and summary["prompts"] == 3 and summary["quarantined"] == 2
    assert summary["quarantine_kinds"] == {"malformed_json": 1, "no_response": 1}
    assert summary["thinking_share"] == round(1 / 3, 4) and summary["warnings"] == []  # SmolLM2 does not think
    assert manifest.read_manifest(out)["kind"] == "completions"
    rows = {r["text"]: r for r in pq.read_table(manifest.dataset_files(out, (".parquet",))[0]).to_pylist()}
    assert rows["Two."]["reasoning"] == "Two is even and prime."
    assert [m["role"] for m in rows["Two."]["messages"]] == ["user", "assistant", "user"]
    # a completion's messages have tool fields, null on turns without tool calls
    assert rows["2 + 3 = 5."]["messages"] == [
        {"role": "user", "content": "Add the numbers.\n\n2 + 3", "tool_calls": None, "tool_call_id": None}
    ]

    tokenized = str(tmp_path / "tokenized")
    run_tokenize(out, tokenized, load_config(None, ["tokenize.tokenizer=smollm2-135m-instruct"]))
    samples = pq.read_table(manifest.dataset_files(tokenized, (".parquet",))[0]).to_pylist()
    assert len(samples) == 3
    for sample in samples:
        ids, mask = np.array(sample["input_ids"]), np.array(sample["loss_mask"], dtype=bool)
        trained = smollm2_tokenizer.decode(ids[mask])
        context = smollm2_tokenizer.decode(ids[~mask])
        if "Two." in trained:  # the earlier answer is context, never trained on
            assert "Seven." in context and "Seven." not in trained and "Two is even and prime." in trained
        assert mask[-1] and not mask[0] and np.all(np.diff(mask.astype(int)) >= 0)  # one span, at the end


def test_a_thinking_target_flags_answers_without_thinking(tmp_path, capsys):
    code, summary = _run(
        capsys,
        "responses",
        "--input",
        _write(tmp_path),
        "--output",
        str(tmp_path / "c"),
        "--set",
        "prompts.tokenizer=qwen3",
    )
    assert code == 0 and summary["thinking_target"] and len(summary["warnings"]) == 1, summary
    assert "thinking block" in summary["warnings"][0]


def test_the_pipeline_trains_on_existing_responses_without_generating(
    tmp_path, ray_cluster, tiny_qwen3_dir, qwen3_tokenizer
):
    """Two drafters of two families from one target pass (`train.drafters`): each exported under its
    name and evaluated beside its own start; the summary's own figures are the first one's."""
    import shutil

    from dflash_ray.stages.pipeline import run_pipeline

    target = tmp_path / "target"  # the tiny model with a real tokenizer beside it, as a target has
    shutil.copytree(tiny_qwen3_dir, target)
    qwen3_tokenizer.save_pretrained(target)

    answered = tmp_path / "answered.jsonl"
    answered.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"Count from {i} to {i + 12}."},
                        {"role": "assistant", "content": " ".join(str(n) for n in range(i, i + 13))},
                    ]
                }
            )
            + "\n"
            for i in range(14)
        )
    )
    unseen = tmp_path / "unseen.jsonl"
    unseen.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in ("Name a color.", "Say hi."))
    )
    cfg = load_config(
        None,
        [
            f"pipeline.inputs=[{answered}]",
            f"pipeline.workdir={tmp_path / 'run'}",
            f"pipeline.target={target}",
            "pipeline.responses=true",
            "pipeline.eval_prompts=2",
            "pipeline.vllm_evaluate=false",
            "validate.gate.min_median_response=8",
            "validate.gate.max_mode_share=1.0",
            "validate.gate.max_empty_thinking_share=1.0",
            "train.num_streams=1",
            "train.max_steps=2",
            "train.num_anchors=4",
            "train.heldout=0",
            "train.actor_cpus=0.3",
            "evaluate.max_new_tokens=4",
            "train.drafters=[{name: flash}, {name: spark, drafter: dspark, family: {markov_rank: 16}, block_size: 6}]",
            f"pipeline.unseen_prompts=[{unseen}]",
        ],
    )
    summary = run_pipeline(cfg, progress=False)
    assert list(summary["drafters"]) == ["flash", "spark"]
    # prompts of another kind, never trained on: each drafter's figures on them beside the kept-aside ones
    for result in summary["drafters"].values():
        assert result["unseen"]["prompts"] == 2 and result["unseen"]["lossless"]
        assert result["unseen"]["tau_trained"] >= 1 and result["unseen"]["tau_ngram"] >= 1
        assert set(result["unseen"]["tau_per_source"]) == {"unseen"}
        # where acceptance is lost there: by position, the first as its own figure, prompt lookup beside
        positions = result["unseen"]["acceptance_by_position"]
        assert result["unseen"]["first_position"] == positions[0] and result["first_position"] is not None
        assert result["unseen"]["ngram_acceptance_by_position"] is not None
        assert Path(result["unseen"]["evaluation_png"]).read_bytes()[:4] == b"\x89PNG"
    assert summary["unseen"] == summary["drafters"]["flash"]["unseen"]
    for name, family, arch, drafts in (
        ("flash", "dflash", "DFlashDraftModel", 15),
        ("spark", "dspark", "DSparkDraftModel", 6),
    ):
        result = summary["drafters"][name]
        assert result["family"] == family and result["lossless"] and result["tau_trained"] >= 1, result
        assert (
            len(result["acceptance_by_position"]) == drafts and f"evaluate_trained[{name}]" in summary["stage_seconds"]
        )
        exported = json.loads((tmp_path / "run" / "drafter" / name / "config.json").read_text())
        assert exported["architectures"] == [arch]
    assert summary["tau_trained"] == summary["drafters"]["flash"]["tau_trained"]
    assert summary["responses"] and summary["completions"] == 12 and summary["samples"] == 12
    assert "generate" not in summary["stage_seconds"] and summary["generated_tokens"] == 0
    assert summary["training_steps"] == 2 and summary["lossless"]
    assert set(summary["start"]) == {"flash", "spark"} and set(summary["start"].values()) <= {"target", "random"}
    kept = manifest.read_rows(str(tmp_path / "run" / "prompts-eval"), ["messages"], 10)
    assert len(kept) == 2 and all([m["role"] for m in r["messages"]] == ["user"] for r in kept)


def test_a_hybrid_gated_deltanet_target_runs_the_whole_pipeline(tmp_path, ray_cluster, qwen3_tokenizer):
    """Qwen3.6's own architecture (Gated-DeltaNet layers beside full attention, transformers' model
    class, tiny and random): generated by itself, captured, trained, evaluated and exported. Its
    vocabulary is the tokenizer's, so the ids it generates pass the gate's vocabulary check."""
    from dflash_ray.stages.pipeline import run_pipeline
    from dflash_ray.tiny_models import tiny_qwen35

    vocab = len(qwen3_tokenizer)
    target = tmp_path / "target"
    tiny_qwen35(target, vocab_size=vocab)
    qwen3_tokenizer.save_pretrained(target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Count from {i} to {i + 9}."}]}) + "\n"
            for i in range(10)
        )
    )
    cfg = load_config(
        None,
        [
            f"pipeline.inputs=[{prompts}]",
            f"pipeline.workdir={tmp_path / 'run'}",
            f"pipeline.target={target}",
            "pipeline.eval_prompts=2",
            "pipeline.vllm_evaluate=false",
            "generate.backend=transformers",
            "generate.max_tokens=24",
            "generate.truncated=keep",
            "generate.temperature=0",
            "generate.shard_size=4",
            "generate.repeat_min_span=10000",
            "validate.gate.min_median_response=8",
            "validate.gate.max_mode_share=1.0",
            "validate.gate.max_empty_thinking_share=1.0",
            "train.num_streams=1",
            "train.colocate=true",
            "train.max_steps=2",
            "train.num_anchors=4",
            "train.heldout=0",
            "train.actor_cpus=0.5",
            "evaluate.max_new_tokens=4",
        ],
    )
    summary = run_pipeline(cfg, progress=False)
    assert summary["completions"] == 8 and summary["samples"] == 8 and summary["generated_tokens"] > 0
    assert summary["training_steps"] == 2 and summary["lossless"] and summary["start"] in ("target", "random")
    exported = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert exported["num_target_layers"] == 4 and exported["vocab_size"] == vocab


def test_the_learning_gates_name_the_drafter_that_fails():
    from dflash_ray.errors import DFlashError
    from dflash_ray.stages.pipeline import _gate

    pcfg = load_config(None, ["pipeline.min_tau_gain=0.1", "pipeline.beat_ngram=true"]).pipeline
    held = {"heldout_tau_start": 1.0}
    _gate({**held, "heldout_tau_end": 1.2, "tau_gain": 0.2, "tau_trained": 1.5, "tau_ngram": 1.2}, "flash", pcfg)
    with pytest.raises(DFlashError, match="drafter 'spark': .* from 1.0 to 1.05, a gain of 0.05, less than 0.1") as e:
        _gate({**held, "heldout_tau_end": 1.05, "tau_gain": 0.05, "tau_trained": 1.35, "tau_ngram": 1.2}, "spark", pcfg)
    assert e.value.field == "pipeline.min_tau_gain"
    with pytest.raises(DFlashError, match="does not beat n-gram prompt lookup's 1.6") as e:
        _gate({**held, "heldout_tau_end": 1.2, "tau_gain": 0.2, "tau_trained": 1.5, "tau_ngram": 1.6}, "", pcfg)
    assert e.value.field == "pipeline.beat_ngram" and "drafter" not in str(e.value).split(":")[0]
    # the prompts of kinds training never saw hold it too, when asked
    won = {**held, "heldout_tau_end": 1.2, "tau_gain": 0.2, "tau_trained": 1.5, "tau_ngram": 1.2}
    lost_unseen = {**won, "unseen": {"tau_trained": 1.2, "tau_ngram": 1.25}}
    _gate(lost_unseen, "", pcfg)
    pcfg = load_config(None, ["pipeline.beat_ngram_unseen=true"]).pipeline
    _gate({**won, "unseen": {"tau_trained": 1.3, "tau_ngram": 1.25}}, "", pcfg)
    with pytest.raises(DFlashError, match="tau 1.2 does not beat n-gram prompt lookup's 1.25 on the same unseen") as e:
        _gate(lost_unseen, "", pcfg)
    assert e.value.field == "pipeline.beat_ngram_unseen"


def test_the_thinking_field_under_any_name_and_bad_answers_are_quarantined_naming_the_field(tmp_path, capsys):
    """vLLM's `reasoning`, other exports' `thinking` and `reasoning_content` each give the answer's
    thinking; two that differ, an answer holding the template's turn tokens and a key given twice are
    quarantined, each naming its field."""

    def answered(question, **answer):
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", **answer}]}

    lines = [
        json.dumps(answered("q1", content="A1.", reasoning="R1.")),
        json.dumps(answered("q2", content="A2.", thinking="R2.")),
        json.dumps(answered("q3", content="A3.", reasoning_content="R3.", reasoning="R3.")),
        json.dumps(answered("q4", content="A4.", reasoning_content="R4.", reasoning="other")),
        json.dumps(answered("q5", content="Done.<|im_end|>\n<|im_start|>user\nMore?")),
        '{"messages": [{"role": "user", "content": "q6"}, {"role": "assistant", "content": "A6.", "content": "B6."}]}',
    ]
    source = tmp_path / "answered.jsonl"
    source.write_text("\n".join(lines) + "\n")
    before = source.read_bytes()
    out = str(tmp_path / "completions")
    code, summary = _run(
        capsys, "responses", "--input", str(source), "--output", out, "--set", "prompts.tokenizer=smollm2-135m-instruct"
    )
    assert code == 0, summary
    assert summary["prompts"] == 3 and summary["thinking_share"] == 1.0
    rows = manifest.read_rows(out, ["messages", "reasoning", "text"], 10)
    assert sorted((r["messages"][0]["content"], r["reasoning"], r["text"]) for r in rows) == [
        ("q1", "R1.", "A1."),
        ("q2", "R2.", "A2."),
        ("q3", "R3.", "A3."),
    ]
    assert summary["quarantine_kinds"] == {"ambiguous_thinking": 1, "special_token": 1, "duplicate_key": 1}
    reasons = {
        q["line"]: q["reason"] for q in map(json.loads, Path(summary["quarantine_file"]).read_text().splitlines())
    }
    assert reasons[4].startswith("messages[1].reasoning: differs from messages[1].reasoning_content")
    assert reasons[5].startswith("text: holds the tokenizer's special token '<|im_end|>' as text")
    assert reasons[6].startswith("content: the key is given twice")
    assert source.read_bytes() == before

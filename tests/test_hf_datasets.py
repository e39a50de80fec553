"""Hugging Face Hub datasets as prompt sources, and dataset mixes, offline: dataset repositories laid
out on disk as a Hugging Face cache (refs, snapshots), `HF_HUB_OFFLINE=1`, nothing downloaded. The
commands run in fresh processes, as a user's do, since the Hub libraries read their environment at
import."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflash_ray import manifest
from dflash_ray.config import SourceConfig, load_config
from dflash_ray.data import hub, mix
from dflash_ray.stages.prompts import run_prompts
from dflash_ray.errors import DFlashError

ROOT = Path(__file__).resolve().parent.parent
CHAT_SHA = "1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d"
TOOLS_SHA = "9f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6"

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
    },
}


def _turns(*texts: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(texts)]


# ShareGPT with multi-turn conversations; Arrow unifies the rows' keys, so every row gets every
# column (`messages`, `instruction`, `input`, `system`) and every turn a `weight`, None where absent
CHAT = [
    {"conversations": _turns("Write a haiku about Ray.", "Actors hum ...")},
    {"conversations": _turns("What is 17 * 23?", "391", "And divided by 3?", "130.33")},
    {"conversations": _turns("Sort a list in Python", "sorted(xs)", "In place?", "xs.sort()", "Reverse?", "...")},
    {
        "conversations": [
            {"from": "human", "value": "Explain GQA.", "weight": 0.0},
            {"from": "gpt", "value": "Grouped ...", "weight": 1.0},
        ],
        "system": "Be brief.",
    },
    {"conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "hm"}]},  # bad, row 5
    {"messages": [{"role": "user", "content": "An OpenAI-style row among ShareGPT ones"}]},
    {"instruction": "Name a prime.", "input": None},  # Alpaca, its `input` null
    {"conversations": _turns("What is 17 * 23?", "391", "And divided by 3?", "130.33")},  # duplicate of row 2
]
CHAT_BAD_ROW = 5
CHAT_PROMPTS = 6


def _tool_row(question: str, tools: list[dict], answered: bool) -> dict:
    messages = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": question}]
    if answered:
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": tools[0]["function"]["name"], "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Thanks, and tomorrow?"},
        ]
    return {"messages": messages, "tools": tools}


# OpenAI messages with tools (schemas that differ per row) and tool calls
TOOLS = [
    _tool_row("Weather in Paris?", [WEATHER], True),
    _tool_row("Find DFlash papers", [SEARCH], False),
    _tool_row("Weather in Oslo, then search ski resorts", [WEATHER, SEARCH], True),
    {
        "messages": [{"role": "user", "content": "q"}, {"role": "wizard", "content": "?"}],
        "tools": [SEARCH],
    },  # bad, row 4
    _tool_row("Search the news", [SEARCH], True),
]
TOOLS_BAD_ROW = 4
TOOLS_PROMPTS = 4


def _parquet(rows: list[dict]) -> bytes:
    """The rows under one schema inferred from them all, as `datasets` and pandas write them."""
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), sink)
    return sink.getvalue()


def _hub_dataset(cache: Path, repo_id: str, sha: str, files: dict[str, bytes]) -> None:
    """A dataset repository in the Hugging Face cache layout: `refs/main` → `snapshots/<sha>/`."""
    repo = cache / ("datasets--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    for name, data in files.items():
        path = repo / "snapshots" / sha / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.fixture
def hub_env(tmp_path) -> dict[str, str]:
    cache = tmp_path / "hf" / "hub"
    _hub_dataset(cache, "tiny-org/chat", CHAT_SHA, {"data/train-00000-of-00001.parquet": _parquet(CHAT)})
    tools_jsonl = "".join(json.dumps(r) + "\n" for r in TOOLS).encode()
    _hub_dataset(cache, "tiny-org/tools", TOOLS_SHA, {"data/train.jsonl": tools_jsonl, "data/test.jsonl": tools_jsonl})
    good = _parquet([{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)])
    _hub_dataset(
        cache,
        "tiny-org/broken",
        TOOLS_SHA,
        {"data/train-00000-of-00002.parquet": good, "data/train-00001-of-00002.parquet": good[:-30]},
    )
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(cache),
        "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
        "DFLASH_RAY_CACHE": str(tmp_path / "dflash-cache"),
    }


def _cli(env: dict, *args: str) -> tuple[int, dict, str]:
    done = subprocess.run(
        [sys.executable, "-m", "dflash_ray.cli", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


RUNS = """
import contextlib, io, json, sys
from dflash_ray.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv + ["--json"])
    results.append([code, json.loads(out.getvalue().strip().splitlines()[-1])])
print(json.dumps(results))
"""


def _cli_runs(env: dict, *argvs: list[str]) -> tuple[list[tuple[int, dict]], str]:
    """Several commands in one fresh process (the imports once): their exit codes and summaries."""
    done = subprocess.run(
        [sys.executable, "-c", RUNS, json.dumps(argvs)], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])], done.stderr


def _rows(out: Path) -> list[dict]:
    return pa.concat_tables([pq.read_table(f) for f in manifest.dataset_files(str(out))]).to_pylist()


@pytest.mark.slow
def test_hub_datasets_read_offline_with_the_files_formats_quarantine_and_dedup(tmp_path, hub_env):
    out = tmp_path / "prompts"
    code, summary, stderr = _cli(
        hub_env,
        "prompts",
        "--input",
        "hf://datasets/tiny-org/chat",
        "hf://datasets/tiny-org/tools:train",
        "--output",
        str(out),
        "--set",
        "prompts.max_prompt_tokens=2048",
    )
    assert code == 0, stderr
    assert summary["records"] == len(CHAT) + len(TOOLS) == summary["records_ok"] + summary["quarantined"]
    assert summary["prompts"] == CHAT_PROMPTS + TOOLS_PROMPTS and summary["duplicates"] == 1
    quarantine = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["file"], q["line"], q["kind"]) for q in quarantine] == [
        ("hf://datasets/tiny-org/chat:train", CHAT_BAD_ROW, "role_order"),
        ("hf://datasets/tiny-org/tools:train", TOOLS_BAD_ROW, "bad_field"),
    ]
    assert "I speak first" in quarantine[0]["record"]

    chat, tools = summary["sources"]
    assert chat == {
        "uri": "hf://datasets/tiny-org/chat:train",
        "revision": CHAT_SHA,
        "requested": None,
        "records": len(CHAT),
        "records_ok": len(CHAT) - 1,
        "quarantined": 1,
        "duplicates": 1,
        "prompts": CHAT_PROMPTS,
    }
    assert tools["revision"] == TOOLS_SHA and tools["prompts"] == TOOLS_PROMPTS
    assert manifest.read_manifest(str(out))["summary"]["sources"] == summary["sources"]
    # conversations of several user turns are answered turn by turn (the default)
    turns = {len([m for m in r["messages"] if m["role"] == "user"]): r["regenerate"] for r in _rows(out)}
    assert turns == {1: False, 2: True, 3: True}

    rows = _rows(out)
    by_first = {r["messages"][-1]["content"]: r for r in rows}
    assert {r["source"] for r in rows} == {"tiny-org/chat:train", "tiny-org/tools:train"}
    # Arrow's null-filled keys read as absent: the Alpaca row's null input, the other format's columns
    assert by_first["Name a prime."]["messages"] == [{"role": "user", "content": "Name a prime."}]
    assert "An OpenAI-style row among ShareGPT ones" in by_first
    assert [m["content"] for m in by_first["Reverse?"]["messages"]] == [
        "Sort a list in Python",
        "In place?",
        "Reverse?",
    ]
    assert by_first["Explain GQA."]["messages"][0] == {"role": "system", "content": "Be brief."}
    # each tool schema comes back as it was written, not with the other tools' keys as nulls
    tool_rows = [r for r in rows if r["source"] == "tiny-org/tools:train"]
    both = next(r for r in tool_rows if r["messages"][1]["content"].startswith("Weather in Oslo"))
    assert json.loads(both["tools"]) == [WEATHER, SEARCH]
    paris = next(r for r in tool_rows if r["messages"][1]["content"] == "Weather in Paris?")
    assert json.loads(paris["tools"]) == [WEATHER]
    assert [m["content"] for m in paris["messages"]] == [
        "You can call tools.",
        "Weather in Paris?",
        "Thanks, and tomorrow?",
    ]


MIX = {
    "prompts": {
        "max_prompt_tokens": 0,
        "seed": 7,
        "mix_total": 3,
        "sources": [
            {"uri": "hf://datasets/tiny-org/chat", "count": 4},
            {"uri": f"hf://datasets/tiny-org/tools@{TOOLS_SHA}:train", "weight": 1.0},
        ],
    }
}


@pytest.mark.integration
def test_a_two_source_mix_of_hub_datasets_takes_each_count_reproducibly(tmp_path, hub_env):
    recipe, short = tmp_path / "recipe.yaml", tmp_path / "short.yaml"
    recipe.write_text(yaml.safe_dump(MIX))
    # a source asked for more than it has
    short.write_text(
        yaml.safe_dump(
            {
                "prompts": {
                    **MIX["prompts"],
                    "mix_total": 0,
                    "sources": [{"uri": "hf://datasets/tiny-org/chat", "count": 10}],
                }
            }
        )
    )
    runs, stderr = _cli_runs(
        hub_env,
        *(
            ["prompts", "--config", str(config), "--output", str(tmp_path / name)]
            for config, name in ((recipe, "a"), (recipe, "b"), (short, "short"))
        ),
    )
    for name, (code, summary) in zip("ab", runs):
        assert code == 0, stderr
        chat, tools = summary["sources"]
        assert (chat["uri"], chat["requested"], chat["prompts"]) == ("hf://datasets/tiny-org/chat:train", 4, 4)
        assert (tools["weight"], tools["requested"], tools["prompts"]) == (1.0, 3, 3)
        assert tools["revision"] == TOOLS_SHA and chat["revision"] == CHAT_SHA
        for source in (chat, tools):
            assert source["records"] == source["records_ok"] + source["quarantined"]
        assert summary["prompts"] == 7 and summary["warnings"] == []
        saved = manifest.read_manifest(str(tmp_path / name))
        assert [s["prompts"] for s in saved["summary"]["sources"]] == [4, 3]
        assert saved["config"]["prompts"]["sources"][1] == {
            "uri": MIX["prompts"]["sources"][1]["uri"],
            "count": None,
            "weight": 1.0,
        }
        rows = _rows(tmp_path / name)
        assert sorted(r["source"] for r in rows) == ["tiny-org/chat:train"] * 4 + ["tiny-org/tools:train"] * 3
    assert sorted(r["id"] for r in _rows(tmp_path / "a")) == sorted(r["id"] for r in _rows(tmp_path / "b"))

    code, summary = runs[2]
    assert code == 0, stderr
    assert summary["sources"][0]["prompts"] == CHAT_PROMPTS and summary["sources"][0]["requested"] == 10
    assert summary["warnings"] and "gave 6 of the 10" in summary["warnings"][0] and "warning" in stderr


@pytest.mark.integration
def test_a_dataset_missing_offline_or_a_bad_split_is_one_clear_error(tmp_path, hub_env):
    out = str(tmp_path / "out")
    runs, stderr = _cli_runs(
        hub_env,
        ["prompts", "--input", "hf://datasets/tiny-org/absent", "--output", out],
        ["prompts", "--input", "hf://datasets/tiny-org/tools:validation", "--output", out],
        ["prompts", "--output", out],
    )
    assert [code for code, _ in runs] == [2, 2, 2] and not any(summary["ok"] for _, summary in runs)
    absent, split, nothing = (summary["error"] for _, summary in runs)
    assert "hf://datasets/tiny-org/absent:train" in absent and "HF_HUB_OFFLINE" in absent
    assert "hf download tiny-org/absent --repo-type dataset" in absent and "Traceback" not in stderr
    assert "hf://datasets/tiny-org/tools:validation" in split
    assert "validation" in split and "'test'" in split and "'train'" in split, split  # the splits it has
    assert "prompts.sources" in nothing


@pytest.mark.integration
def test_a_truncated_file_of_a_dataset_is_one_quarantine_entry(tmp_path, hub_env):
    out = tmp_path / "out"
    code, summary, stderr = _cli(
        hub_env,
        "prompts",
        "--input",
        "hf://datasets/tiny-org/broken",
        "--output",
        str(out),
        "--set",
        "prompts.max_prompt_tokens=0",
    )
    assert code == 0, stderr
    assert (summary["records"], summary["prompts"], summary["quarantine_kinds"]) == (4, 3, {"corrupt_file": 1})
    (entry,) = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert (entry["file"], entry["line"]) == ("hf://datasets/tiny-org/broken:train", 4)
    assert "unreadable after row 3" in entry["reason"]


def test_dataset_uris_parse_and_bad_ones_name_the_field():
    ds = hub.parse("hf://datasets/org/set/cfg@refs/pr/3:train_sft")
    assert (ds.repo_id, ds.config, ds.revision, ds.split) == ("org/set", "cfg", "refs/pr/3", "train_sft")
    assert ds.uri == "hf://datasets/org/set/cfg@refs/pr/3:train_sft" and ds.name == "org/set/cfg:train_sft"
    assert hub.parse("hf://datasets/org/set") == hub.HubDataset("org/set", None, None, "train")
    with pytest.raises(DFlashError) as e:
        load_config(None, ["pipeline.inputs=[hf://datasets/just-a-name]"])
    assert e.value.field == "pipeline.inputs[0]" and "hf://datasets/ORG/NAME" in str(e.value)


@pytest.mark.parametrize(
    "sources, extra, field, message",
    [
        ([{"uri": "a.jsonl"}, {"uri": "b.jsonl", "count": 0}], [], "prompts.sources[1].count", ">= 1"),
        ([{"uri": "a.jsonl", "count": 3, "weight": 1}], [], "prompts.sources[0]", "one of them"),
        ([{"uri": "a.jsonl", "weight": 2}], [], "prompts.mix_total", "weighted"),
        ([{"uri": "a.jsonl", "count": 2}], ["prompts.mix_total=5"], "prompts.mix_total", "no source"),
        ([{"uri": "a.jsonl", "weight": -1}], ["prompts.mix_total=5"], "prompts.sources[0].weight", "> 0"),
        ([{"uri": ""}], [], "prompts.sources[0].uri", "empty"),
        ([{"uri": "hf://datasets/x"}], [], "prompts.sources[0].uri", "ORG/NAME"),
        ([{"uri": "a.jsonl", "share": 2}], [], "prompts.sources[0].share", "valid keys"),
        (["a.jsonl"], [], "prompts.sources[0]", "mapping"),
        ([{"uri": "a.jsonl", "count": "many"}], [], "prompts.sources[0].count", "integer"),
    ],
)
def test_mix_recipes_are_checked_before_anything_runs(sources, extra, field, message):
    with pytest.raises(DFlashError) as e:
        load_config(None, [f"prompts.sources={json.dumps(sources)}", *extra])
    assert e.value.field == field and message in str(e.value), str(e.value)


def test_the_mix_splits_its_total_exactly_and_shuffles_by_seed():
    cfg = load_config(
        None,
        [
            "prompts.sources=[{uri: a}, {uri: b, weight: 1}, {uri: c, count: 5}, {uri: d, weight: 2}]",
            "prompts.mix_total=10",
        ],
    )
    assert cfg.prompts.sources[2] == SourceConfig(uri="c", count=5)
    planned = mix.plan(["x.jsonl"], cfg.prompts)
    assert [(s.uri, s.count) for s in planned] == [("x.jsonl", None), ("a", None), ("b", 3), ("c", 5), ("d", 7)]
    assert mix.apportion(10, [1, 1, 1]) == [4, 3, 3] and sum(mix.apportion(7, [0.2, 0.3, 0.5])) == 7

    items = list(range(50))
    once = list(mix.shuffled(iter(items), random.Random(1), 64))
    assert sorted(once) == items and once != items
    assert once == list(mix.shuffled(iter(items), random.Random(1), 64))
    assert sorted(mix.shuffled(iter(items), random.Random(1), 8)) == items  # a window smaller than the data


def test_a_mix_of_files_without_input_arguments(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(20)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the Parquet file's rows hold each other's columns as nulls
    (tmp_path / "b.parquet").write_bytes(_parquet([CHAT[0], CHAT[5], CHAT[6]]))
    cfg = load_config(
        None,
        [
            "prompts.max_prompt_tokens=0",
            f"prompts.sources=[{{uri: {tmp_path / 'a.jsonl'}, count: 5}}, {{uri: {tmp_path}}}]",
        ],
    )
    summary = run_prompts([], str(tmp_path / "out"), cfg, progress=False)
    first, folder = summary["sources"]
    assert first["prompts"] == 5 and first["records"] == 5  # read no further than its count
    assert folder["requested"] is None and folder["quarantined"] == 0
    assert folder["duplicates"] == 5 and folder["prompts"] == 15 + 3  # a.jsonl again, then b.parquet
    assert summary["prompts"] == 23


def test_the_mix_example_recipe_passes_the_preflight():
    cfg = load_config(str(ROOT / "configs" / "mix-example.yaml"))
    planned = mix.plan([], cfg.prompts)
    assert all(hub.is_hub_dataset(s.uri) and hub.parse(s.uri) for s in planned)
    assert sum(s.count for s in planned if s.weight is not None) == cfg.prompts.mix_total
    assert cfg.pipeline.target == cfg.prompts.tokenizer == "Qwen/Qwen3-8B" and not cfg.pipeline.inputs

import io
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from dflash_ray.data.formats import BadRecord, normalize
from dflash_ray.stages.prompts import run_prompts

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
GOOD = [
    {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
    {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look it up"}]}], "tools": TOOLS},
    {"instruction": "Summarize", "input": "Ray runs Python at scale.", "output": "Ray scales Python."},
    {
        "conversations": [
            {"from": "human", "value": "Turn one"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "Turn two"},
            {"from": "gpt", "value": "b"},
        ]
    },
]
# (line text, expected quarantine kind)
BAD = [
    (b'{"messages": [{"role": "user", "content": "open"}', "malformed_json"),
    (b'{"text": "no known schema"}', "unknown_schema"),
    (b'{"messages": [{"role": "user", "content": "  \\n "}]}', "empty_user_content"),
    (b'{"messages": [{"role": "assistant", "content": "me first"}, {"role": "user", "content": "q"}]}', "role_order"),
    (b'{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}]}', "role_order"),
    (b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}', "invalid_utf8"),
    (b'{"messages": [{"role": "user", "content": "' + b"word " * 400 + b'"}]}', "over_budget"),
    (b'{"messages": [{"role": "wizard", "content": "q"}]}', "bad_field"),
    (b"[1, 2, 3]", "unknown_schema"),
]


def test_formats_normalize_to_system_and_user_turns():
    sharegpt, openai, tools, alpaca, multi = (normalize(r)[0] for r in GOOD)
    assert sharegpt.messages == [{"role": "user", "content": "Hi there"}]
    assert openai.messages == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    assert json.loads(tools.tools) == TOOLS and tools.messages[0]["content"] == "Look it up"
    assert alpaca.messages == [{"role": "user", "content": "Summarize\n\nRay runs Python at scale."}]
    assert [m["content"] for m in multi.messages] == ["Turn one", "Turn two"]


def test_per_turn_policy_emits_one_row_per_user_turn():
    rows = normalize(GOOD[4], "per_turn")
    assert [[m["content"] for m in r.messages] for r in rows] == [["Turn one"], ["Turn one", "Turn two"]]
    assert [r.turn for r in rows] == [0, 1] and len({r.id for r in rows}) == 2


def test_id_is_a_stable_content_hash():
    a = normalize(GOOD[1])[0]
    b = normalize(json.loads(json.dumps(GOOD[1])))[0]
    assert a.id == b.id and len(a.id) == 32
    assert normalize({"messages": [{"role": "user", "content": "2+2?"}]})[0].id != a.id


def test_unknown_role_names_the_field():
    with pytest.raises(BadRecord, match=r"messages\[0\]\.role: unknown role 'wizard'"):
        normalize({"messages": [{"role": "wizard", "content": "q"}]})


def _write_inputs(folder, good_copies=1):
    lines = [json.dumps(r).encode() for r in GOOD * good_copies] + [b for b, _ in BAD]
    (folder / "mixed.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"instruction": "Name a prime.", "input": "", "output": "7"}]), buf)
    (folder / "alpaca.parquet").write_bytes(buf.getvalue())
    return [str(folder / "mixed.jsonl"), str(folder / "alpaca.parquet")]


def test_bad_corpus_quarantined_good_records_through(tmp_path):
    inputs = _write_inputs(tmp_path, good_copies=2)  # second copy: all duplicates
    cfg = load_config(None, ["prompts.max_prompt_tokens=200", "prompts.shard_size=2"])
    out = str(tmp_path / "prompts")
    summary = run_prompts(inputs, out, cfg, progress=False)
    assert summary["records"] == 2 * len(GOOD) + len(BAD) + 1
    assert summary["prompts"] == len(GOOD) + 1
    assert summary["duplicates"] == len(GOOD)
    assert summary["quarantined"] == len(BAD)
    quarantine = [json.loads(x) for x in storage.read_text(f"{out}/quarantine.jsonl").splitlines()]
    first_bad_line = 2 * len(GOOD) + 1
    assert [(q["file"], q["line"], q["kind"]) for q in quarantine] == [
        (inputs[0], first_bad_line + i, kind) for i, (_, kind) in enumerate(BAD)
    ]
    assert all(q["reason"] and q["record"] for q in quarantine)
    files = manifest.dataset_files(out)
    assert len(files) == 3  # 6 prompts in shards of 2
    table = pa.concat_tables([pq.read_table(f) for f in files])
    assert table.schema.names == ["id", "source", "messages", "tools", "turn", "regenerate"]
    assert sorted(set(table["source"].to_pylist())) == ["alpaca", "mixed"]
    assert len(set(table["id"].to_pylist())) == table.num_rows == len(GOOD) + 1


def test_prompts_on_s3(tmp_path, s3_bucket):
    local = _write_inputs(tmp_path)
    remote = []
    for path in local:
        uri = storage.join(s3_bucket, "raw", storage.basename(path))
        storage.write_bytes(uri, open(path, "rb").read())
        remote.append(uri)
    cfg = load_config(None, ["prompts.max_prompt_tokens=0"])  # no budget: nothing is over it
    summary = run_prompts([storage.join(s3_bucket, "raw")], storage.join(s3_bucket, "prompts"), cfg, progress=False)
    # without a budget the long prompt goes through
    assert summary["prompts"] == len(GOOD) + 2 and summary["quarantined"] == len(BAD) - 1
    assert manifest.read_manifest(storage.join(s3_bucket, "prompts"))["summary"]["prompts"] == len(GOOD) + 2
    assert len(manifest.dataset_files(storage.join(s3_bucket, "prompts"))) == 1


@pytest.mark.slow
def test_cli_json_summary_and_errors(tmp_path):
    inputs = _write_inputs(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "dflash_ray.cli",
        "prompts",
        "--input",
        *inputs,
        "--output",
        str(tmp_path / "out"),
        "--json",
        "--set",
        "prompts.max_prompt_tokens=200",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] and summary["quarantined"] == len(BAD)

    done = subprocess.run(cmd[:-2] + ["--set", "prompts.multi_turn=every"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "prompts.multi_turn" in done.stderr and "user_turns" in done.stderr
    assert json.loads(done.stdout)["ok"] is False

    done = subprocess.run(cmd[:5] + [str(tmp_path / "nothing-here")] + cmd[7:], capture_output=True, text=True)
    assert done.returncode == 2 and "nothing-here" in done.stderr


def test_parquet_rows_with_each_others_columns_as_nulls_keep_their_format(tmp_path):
    # one schema for all rows, as datasets and pandas write it: every row holds every column, null
    # where it had none (`messages` beside `conversations`, Alpaca's `input`)
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_struct_array(pa.array([GOOD[0], GOOD[1], {"instruction": "Name a prime."}])), buf)
    (tmp_path / "mixed.parquet").write_bytes(buf.getvalue())
    cfg = load_config(None, ["prompts.max_prompt_tokens=0", "prompts.multi_turn=user_turns"])
    summary = run_prompts([str(tmp_path / "mixed.parquet")], str(tmp_path / "out"), cfg, progress=False)
    assert summary["quarantined"] == 0 and summary["prompts"] == 3


def test_an_output_that_overlaps_an_input_is_refused_and_the_users_files_survive(tmp_path):
    """A folder of the user's own prompt shards (no manifest) given as input and output: a commit
    would delete every `prompts-*.parquet` it did not list, so the run is refused before it writes."""
    from dflash_ray.errors import DFlashError

    mine = tmp_path / "mine"
    mine.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), mine / "prompts-mine.parquet")
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    cfg = load_config(None, [])
    for inputs, out in (
        ([str(mine)], str(mine)),
        ([str(mine / "prompts-mine.parquet")], str(mine)),
        ([str(mine)], str(mine / "sub")),
    ):
        with pytest.raises(DFlashError) as e:
            run_prompts(inputs, out, cfg, progress=False)
        assert "overlap" in str(e.value) and str(mine) in str(e.value)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before


def test_input_files_are_found_in_any_case_and_every_skipped_one_is_named(tmp_path):
    """`a.jsonl`, `D.JSONL` and `f.Jsonl` are JSON lines all three; `_b.jsonl` (a leading underscore
    marks a temporary) and `notes.txt` are not read, and the summary names them."""
    folder = tmp_path / "in"
    folder.mkdir()
    for i, name in enumerate(("a.jsonl", "D.JSONL", "f.Jsonl", "_b.jsonl")):
        (folder / name).write_text(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")
    (folder / "notes.txt").write_text("not data")
    summary = run_prompts([str(folder)], str(tmp_path / "out"), load_config(None, []), progress=False)
    assert summary["input_files"] == 3 and summary["prompts"] == 3
    assert sorted(p.rsplit("/", 1)[-1] for p in summary["skipped_files"]) == ["_b.jsonl", "notes.txt"]
    assert any("_b.jsonl" in w for w in summary["warnings"])


def test_a_lone_surrogate_is_quarantined_with_its_file_and_line_and_the_run_goes_on(tmp_path):
    """JSON's `\\ud800` escape decodes to a string with no UTF-8 form: one record, not the run."""
    src = tmp_path / "chat.jsonl"
    src.write_text(
        '{"messages": [{"role": "user", "content": "fine"}]}\n'
        '{"messages": [{"role": "user", "content": "bad \\ud800 here"}]}\n'
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}\n'
    )
    out = tmp_path / "out"
    summary = run_prompts([str(src)], str(out), load_config(None, []), progress=False)
    assert summary["prompts"] == 1 and summary["quarantined"] == 2
    quarantine = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["line"], q["kind"]) for q in quarantine] == [(2, "bad_unicode"), (3, "bad_unicode")]
    assert "messages[0].content" in quarantine[0]["reason"] and "surrogate" in quarantine[0]["reason"]

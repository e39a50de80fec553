"""Bad input gets a clear error (exit 2, naming the file and field) or is handled with nothing lost:
every record read is counted in and out. One test per case that once aborted a run, lost good
records or ended in a traceback; and the gate on datasets this project did not write."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray import cli, manifest, storage
from dflash_ray.config import load_config
from dflash_ray.stages.prompts import run_prompts
from dflash_ray.errors import DFlashError

NO_BUDGET = load_config(None, ["prompts.max_prompt_tokens=0"])


def _chat(text):
    return {"messages": [{"role": "user", "content": text}]}


def _lines(*records):
    return "".join(json.dumps(r) + "\n" for r in records)


def _quarantine(out):
    return [json.loads(x) for x in storage.read_text(f"{out}/quarantine.jsonl").splitlines()]


def _cli(capsys, *argv):
    """Run the CLI in this process; (exit code, --json summary, stderr)."""
    code = cli.main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out.strip().splitlines()[-1]), captured.err


def _parquet_bytes(table):
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


# -- prompts ---------------------------------------------------------------------------------


def test_json_array_with_one_broken_element_keeps_the_others(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(
        '[\n {"messages": [{"role": "user", "content": "one"}]},\n'
        ' {"messages": [{"role": "user", "content": "two"}, }]},\n'
        ' {"messages": [{"role": "user", "content": "three"}]}\n]\n'
    )
    summary = run_prompts([str(path)], str(tmp_path / "out"), NO_BUDGET, progress=False)
    assert (summary["records"], summary["prompts"], summary["quarantined"]) == (3, 2, 1)
    (bad,) = _quarantine(tmp_path / "out")
    assert (bad["file"], bad["line"], bad["item"], bad["kind"]) == (str(path), 3, 2, "malformed_json")
    assert '"two"' in bad["record"]


def test_jsonl_saved_as_json_is_read_line_by_line(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text(_lines(_chat("a"), _chat("b")) + '{"messages": [\n' + _lines(_chat("c")))
    summary = run_prompts([str(path)], str(tmp_path / "out"), NO_BUDGET, progress=False)
    assert (summary["records"], summary["prompts"], summary["quarantined"]) == (4, 3, 1)
    (bad,) = _quarantine(tmp_path / "out")
    assert (bad["line"], bad["kind"]) == (3, "malformed_json") and "malformed JSON" in bad["reason"]


def test_json_array_on_one_jsonl_line_yields_its_records(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(_lines(_chat("first"), [_chat("a"), _chat("b"), {"text": "no schema"}], _chat("last")))
    summary = run_prompts([str(path)], str(tmp_path / "out"), NO_BUDGET, progress=False)
    assert (summary["records"], summary["prompts"], summary["quarantined"]) == (5, 4, 1)
    (bad,) = _quarantine(tmp_path / "out")
    assert (bad["line"], bad["item"], bad["kind"]) == (2, 3, "unknown_schema")


def test_corrupt_parquet_is_one_entry_and_the_other_files_go_on(tmp_path):
    good = _parquet_bytes(pa.Table.from_pylist([{"instruction": "Name a prime."}, {"instruction": "Name a color."}]))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.parquet").write_bytes(good[: len(good) // 2])
    (tmp_path / "in" / "good.parquet").write_bytes(good)
    (tmp_path / "in" / "chats.jsonl").write_text(_lines(_chat("hi")))
    summary = run_prompts([str(tmp_path / "in")], str(tmp_path / "out"), NO_BUDGET, progress=False)
    assert (summary["records"], summary["prompts"], summary["quarantined"]) == (4, 3, 1)
    assert summary["records"] == summary["records_ok"] + summary["quarantined"]
    (bad,) = _quarantine(tmp_path / "out")
    assert bad["file"] == str(tmp_path / "in" / "bad.parquet") and bad["kind"] == "corrupt_file"
    assert "Parquet" in bad["reason"]


def test_compressed_files_and_a_byte_order_mark_are_read(tmp_path):
    """A folder of .jsonl.gz, .json.bz2, a two-frame .jsonl.zst and a BOM-led .jsonl: every record
    read; a truncated gzip and a truncated zstd keep the records before the cut and are one
    quarantine entry each, naming the line where the file ends, never skipped."""
    import bz2
    import gzip

    import zstandard

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl.gz").write_bytes(gzip.compress(_lines(_chat("one"), _chat("two")).encode()))
    (tmp_path / "in" / "b.json.bz2").write_bytes(bz2.compress(json.dumps([_chat("three")]).encode()))
    (tmp_path / "in" / "c.jsonl").write_bytes(b"\xef\xbb\xbf" + _lines(_chat("four")).encode())
    (tmp_path / "in" / "d.jsonl.gz").write_bytes(gzip.compress(_lines(_chat("five")).encode())[:12])
    zstd = zstandard.ZstdCompressor()
    frames = zstd.compress(_lines(_chat("six")).encode()) + zstd.compress(_lines(_chat("seven")).encode())
    (tmp_path / "in" / "e.jsonl.zst").write_bytes(frames)
    (tmp_path / "in" / "f.jsonl.zst").write_bytes(frames[:-4])
    summary = run_prompts([str(tmp_path / "in")], str(tmp_path / "out"), NO_BUDGET, progress=False)
    assert (summary["records"], summary["prompts"], summary["quarantined"]) == (9, 6, 2), (
        summary
    )  # "six" twice: one prompt
    bad = sorted(_quarantine(tmp_path / "out"), key=lambda q: q["file"])
    assert [b["file"].rsplit("/", 1)[1] for b in bad] == ["d.jsonl.gz", "f.jsonl.zst"]
    assert all(b["kind"] == "truncated_file" and "ends mid-stream" in b["reason"] for b in bad)
    assert "after line 1:" in bad[1]["reason"]  # "six", whole before the cut, is kept
    sources = {r["source"] for r in manifest.read_rows(str(tmp_path / "out"), ["source"], 10)}
    assert sources == {"a", "b", "c", "e"}


def test_no_prompts_out_exits_2_and_a_failed_rerun_keeps_the_previous_output(tmp_path, capsys):
    good, bad, out = tmp_path / "good.jsonl", tmp_path / "bad.jsonl", str(tmp_path / "out")
    good.write_text(_lines(_chat("a"), _chat("b")))
    bad.write_text(_lines({"messages": [{"content": "no role"}]}, {"text": "x"}) + "{not json\n")
    run_prompts([str(good)], out, NO_BUDGET, progress=False)
    before = manifest.read_manifest(out)

    code, summary, err = _cli(
        capsys, "prompts", "--input", str(bad), "--output", out, "--set", "prompts.max_prompt_tokens=0", "--replace"
    )
    assert code == 2 and summary["ok"] is False and summary["exit_code"] == 2
    assert "no prompts out of 3 records" in err and str(bad) in err
    assert summary["records"] == summary["quarantined"] == 3 and summary["prompts"] == 0
    failed = [json.loads(x) for x in storage.read_text(summary["quarantine_file"]).splitlines()]
    assert [q["line"] for q in failed] == [1, 2, 3] and summary["quarantine_file"] in err
    assert manifest.read_manifest(out) == before  # the previous dataset is whole and readable
    assert [r["messages"][0]["content"] for r in manifest.read_rows(out, ["messages"], 10)] == ["a", "b"]
    assert len(_quarantine(out)) == 0  # its own quarantine file too

    good.write_text(_lines(_chat("c")))  # a rerun that succeeds replaces it, old shards gone
    run_prompts([str(good)], out, NO_BUDGET, progress=False)
    assert storage.list_files(out, ".parquet") == manifest.dataset_files(out)
    assert [r["messages"][0]["content"] for r in manifest.read_rows(out, ["messages"], 10)] == ["c"]


# -- tokenize --------------------------------------------------------------------------------


def _completion(i, **changes):
    row = {
        "id": f"c{i}",
        "source": "s",
        "messages": [{"role": "user", "content": f"q{i}"}],
        "text": "a",
        "prompt_token_ids": [1, 2, 3 + i],  # each sample its own tokens: copies are kept once
        "output_token_ids": [4, 5],
    }
    return {**row, **changes}


# one line per case that once aborted the Ray Data job: (line, kind, words the reason holds)
BAD_COMPLETIONS = [
    (
        _completion(10, messages=[{"content": "no role"}], prompt_token_ids=None, output_token_ids=None),
        "missing_field",
        "messages[0].role",
    ),
    (
        _completion(11, tools="[{not json", prompt_token_ids=None, output_token_ids=None),
        "bad_field",
        "tools: not valid JSON",
    ),
    ({k: v for k, v in _completion(12).items() if k != "id"}, "missing_field", "id: missing"),
    (_completion(13, output_token_ids=[4, "five"]), "bad_field", "output_token_ids[1]: 'five'"),
    (_completion(14, prompt_token_ids=[1.5]), "bad_field", "prompt_token_ids[0]: 1.5"),
    ('{"id": "c15", "messages": [', "malformed_json", "malformed JSON"),
]


def test_tokenize_rejects_bad_rows_with_file_and_line_and_goes_on(ray_cluster, tmp_path):
    from dflash_ray.stages.tokenize import run_tokenize

    folder = tmp_path / "completions"
    folder.mkdir()
    lines = [json.dumps(_completion(i)) for i in range(4)]
    lines += [row if isinstance(row, str) else json.dumps(row) for row, _, _ in BAD_COMPLETIONS]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")
    broken = _parquet_bytes(pa.Table.from_pylist([_completion(20), _completion(21)]))
    (folder / "b.parquet").write_bytes(broken[:-30])
    out = str(tmp_path / "tokenized")
    cfg = load_config(None, ["tokenize.tokenizer=smollm2-135m-instruct"])
    summary = run_tokenize(str(folder), out, cfg)
    assert (summary["rows_in"], summary["rows_out"], summary["rejected"]) == (
        4 + len(BAD_COMPLETIONS) + 1,
        4,
        len(BAD_COMPLETIONS) + 1,
    )
    rejected = [json.loads(x) for x in storage.read_text(summary["rejected_file"]).splitlines()]
    by_line = {r.get("line"): r for r in rejected if r["file"].endswith("a.jsonl")}
    for line, (_, kind, words) in enumerate(BAD_COMPLETIONS, start=5):
        assert by_line[line]["kind"] == kind and words in by_line[line]["reason"], by_line[line]
    (corrupt,) = [r for r in rejected if r["file"].endswith("b.parquet")]
    assert corrupt["kind"] == "corrupt_file" and "Parquet" in corrupt["reason"]
    assert sorted(manifest.read_rows(out, ["id"], 10), key=str) == [{"id": f"c{i}"} for i in range(4)]

    # a rerun that tokenizes nothing: exit 2 with the reasons, the previous dataset kept
    before = manifest.read_manifest(out)
    (folder / "a.jsonl").write_text(lines[4] + "\n")
    (folder / "b.parquet").unlink()
    with pytest.raises(DFlashError, match="no samples out of 1 rows") as e:
        run_tokenize(str(folder), out, cfg)
    assert e.value.exit_code == 2 and e.value.summary["rejected"] == 1
    assert manifest.read_manifest(out) == before and len(manifest.dataset_files(out)) == len(before["files"])


def test_a_listed_shard_that_cannot_be_read_counts_every_row_its_manifest_promised(ray_cluster, tmp_path):
    from dflash_ray.stages.tokenize import run_tokenize

    folder = tmp_path / "completions"
    folder.mkdir()
    (folder / "completions-a.parquet").write_bytes(_parquet_bytes(pa.Table.from_pylist([_completion(0)])))
    good = _parquet_bytes(pa.Table.from_pylist([_completion(i) for i in range(1, 33)]))
    (folder / "completions-b.parquet").write_bytes(good[:-8] + b"\0" * 8)  # right size, footer gone
    files = [{"name": "completions-a.parquet", "rows": 1}, {"name": "completions-b.parquet", "rows": 32}]
    manifest.write_manifest(str(folder), kind="completions", summary={}, files=files)
    summary = run_tokenize(
        str(folder), str(tmp_path / "tokenized"), load_config(None, ["tokenize.tokenizer=smollm2-135m-instruct"])
    )
    assert (summary["rows_in"], summary["rows_out"], summary["rejected"]) == (33, 1, 32)
    (lost,) = json.loads("[" + storage.read_text(summary["rejected_file"]).strip() + "]")
    assert lost["rows"] == 32 and lost["file"].endswith("completions-b.parquet") and "32 rows lost" in lost["reason"]


def _flip_a_byte(path):
    """A same-size corruption in the middle of a file: its size still matches its manifest entry."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_stage_refuses_a_listed_file_whose_sha256_changed(tmp_path, capsys):
    """The checksum a stage writes into its manifest is checked by the stages that read the dataset:
    tokenize, validate, train and evaluate all stop before any work, naming the file and what to rerun."""
    from dflash_ray.data.tokenized import open_tokenized

    prompts = tmp_path / "prompts"
    source = tmp_path / "chats.jsonl"
    source.write_text(_lines(*[_chat(f"question {i}") for i in range(40)]))
    run_prompts([str(source)], str(prompts), NO_BUDGET, progress=False)
    (listed,) = manifest.read_manifest(str(prompts))["files"]
    assert len(listed["sha256"]) == 64 and listed["rows"] == 40
    _flip_a_byte(prompts / listed["name"])
    completions = tmp_path / "completions"
    completions.mkdir()
    (completions / "part-0.parquet").write_bytes(
        _parquet_bytes(pa.Table.from_pylist([_completion(i) for i in range(8)]))
    )
    manifest.write_manifest(
        str(completions), kind="completions", files=[{"name": "part-0.parquet", "rows": 8}], summary={}
    )
    _flip_a_byte(completions / "part-0.parquet")
    for argv, name, rerun in (
        (
            [
                "tokenize",
                "--input",
                str(completions),
                "--output",
                str(tmp_path / "tok"),
                "--set",
                "tokenize.tokenizer=smollm2-135m-instruct",
            ],
            "part-0.parquet",
            "dflash-ray generate",
        ),
        (
            [
                "generate",
                "--prompts",
                str(prompts),
                "--output",
                str(tmp_path / "gen"),
                "--model",
                "smollm2-135m-instruct",
            ],
            listed["name"],
            "dflash-ray prompts",
        ),
    ):
        code, summary, _ = _cli(capsys, *argv)
        assert code == 2 and name in summary["error"], summary
        assert "sha256 does not match" in summary["error"] and rerun in summary["error"], summary
    assert not (tmp_path / "tok" / manifest.MANIFEST).exists() and not (tmp_path / "gen" / manifest.MANIFEST).exists()

    tokenized = tmp_path / "tokenized"
    tokenized.mkdir()
    rows = [{"input_ids": list(range(1, 65)), "loss_mask": [0] * 8 + [1] * 56, "seq_len": 64} for _ in range(32)]
    (tokenized / "part-0.parquet").write_bytes(_parquet_bytes(pa.Table.from_pylist(rows)))
    manifest.write_manifest(
        str(tokenized), kind="tokenized", files=[{"name": "part-0.parquet", "rows": 32}], summary={}
    )
    assert open_tokenized(str(tokenized)).files and len(manifest.read_rows(str(tokenized), ["seq_len"], 99)) == 32
    _flip_a_byte(tokenized / "part-0.parquet")
    code, summary, _ = _cli(capsys, "validate", "--input", str(tokenized), "--tokenizer", "smollm2-135m-instruct")
    assert code == 2 and "part-0.parquet" in summary["error"] and "dflash-ray tokenize" in summary["error"]
    for read in (
        lambda: open_tokenized(str(tokenized)),  # train's and the gate's reader
        lambda: manifest.read_rows(str(tokenized), ["seq_len"], 99),
    ):  # evaluate's
        with pytest.raises(DFlashError, match="sha256 does not match") as e:
            read()
        assert e.value.file.endswith("part-0.parquet")


# -- validate: the wrong thing given, and datasets of any layout -------------------------------


def test_validate_on_records_names_the_file_and_the_command(tmp_path, capsys):
    jsonl = tmp_path / "completions.jsonl"
    jsonl.write_text(_lines(_completion(0)))
    code, summary, err = _cli(capsys, "validate", "--input", str(jsonl))
    assert code == 2 and str(jsonl) in err and "dflash-ray tokenize" in err and "Traceback" not in err

    prompts = str(tmp_path / "prompts")
    run_prompts([str(jsonl)], prompts, NO_BUDGET, progress=False)
    code, summary, err = _cli(capsys, "validate", "--input", prompts)
    assert code == 2 and "holds prompts, not tokenized" in err and "dflash-ray generate" in err

    no_mask = tmp_path / "no-mask.parquet"
    no_mask.write_bytes(_parquet_bytes(pa.table({"input_ids": [[1, 2]], "labels": [[1, 2]]})))
    code, summary, err = _cli(capsys, "validate", "--input", str(no_mask))
    assert code == 2 and str(no_mask) in err and "field 'loss_mask'" in err and "labels" in err

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 not really")
    code, summary, err = _cli(capsys, "validate", "--input", str(junk))
    assert code == 2 and str(junk) in err and "not a readable Parquet file" in err


BROKEN_REPLY = "<think>\n\n</think>\n\nOK<|im_end|>"  # 6 tokens with the Qwen3 tokenizer
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def seed_broken_samples(tokenizer, n=100):
    """The seed's broken dataset in miniature: 87% of samples answer with 6 tokens."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Question {i}: list words."}], tokenize=False, add_generation_prompt=True
        )
        reply = (
            BROKEN_REPLY
            if i % 100 < 87
            else (
                f"<think>\n{' '.join(rng.choice(WORDS, 60))}\n</think>\n\n{' '.join(rng.choice(WORDS, 40))}<|im_end|>"
            )
        )
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(reply, add_special_tokens=False)["input_ids"]
        rows.append(
            {
                "input_ids": p + r,
                "loss_mask": [0] * len(p) + [1] * len(r),
                "seq_len": len(p) + len(r),
                "id": f"seed-{i}",
            }
        )
    assert sum(sum(r["loss_mask"]) == 6 for r in rows) == 87
    return rows


def _seed_table(rows, ids_type):
    return pa.table(
        {
            "input_ids": pa.array([r["input_ids"] for r in rows], pa.list_(ids_type)),
            "loss_mask": pa.array([r["loss_mask"] for r in rows], pa.list_(ids_type)),
            "seq_len": pa.array([r["seq_len"] for r in rows], pa.int64()),
            "id": [r["id"] for r in rows],
        }
    )


def _save_to_disk_layout(folder, table, shards=2):
    """What `datasets.Dataset.save_to_disk` writes: Arrow IPC stream shards, state and info."""
    folder.mkdir()
    size = -(-table.num_rows // shards)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    for k, name in enumerate(names):
        part = table.slice(k * size, size)
        with pa.ipc.new_stream(str(folder / name), part.schema) as writer:
            for batch in part.to_batches(max_chunksize=16):
                writer.write_batch(batch)
    (folder / "state.json").write_text(
        json.dumps(
            {
                "_data_files": [{"filename": n} for n in names],
                "_fingerprint": "0" * 16,
                "_format_columns": None,
                "_format_kwargs": {},
                "_format_type": None,
                "_output_all_columns": False,
                "_split": None,
            }
        )
    )
    (folder / "dataset_info.json").write_text(
        json.dumps(
            {
                "features": {
                    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "Sequence"},
                    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "Sequence"},
                    "seq_len": {"dtype": "int64", "_type": "Value"},
                    "id": {"dtype": "string", "_type": "Value"},
                }
            }
        )
    )


@pytest.fixture(scope="module")
def seed_layouts(tmp_path_factory, qwen3_tokenizer):
    """The broken dataset as one Parquet file, a folder of Parquet files without a manifest, and a
    `save_to_disk` folder."""
    root = tmp_path_factory.mktemp("seed")
    rows = seed_broken_samples(qwen3_tokenizer)
    single = root / "seed.parquet"
    single.write_bytes(_parquet_bytes(_seed_table(rows, pa.int32())))
    (root / "folder").mkdir()
    for k in range(2):
        (root / "folder" / f"part-{k}.parquet").write_bytes(
            _parquet_bytes(_seed_table(rows[k * 50 : (k + 1) * 50], pa.int32()))
        )
    _save_to_disk_layout(root / "hf", _seed_table(rows, pa.int64()))
    return {"file": str(single), "folder": str(root / "folder"), "hf": str(root / "hf")}


@pytest.mark.parametrize("layout", ["file", "folder", "hf"])
def test_gate_fails_the_seed_dataset_in_any_layout(seed_layouts, layout, capsys, tmp_path):
    code, summary, err = _cli(
        capsys,
        "validate",
        "--input",
        seed_layouts[layout],
        "--tokenizer",
        "qwen3",
        "--report",
        str(tmp_path / "report"),
    )
    assert code == 3, err
    assert "max_mode_share" in summary["failed_rules"] and "min_median_response" in summary["failed_rules"]
    top = summary["stats"]["loss_mask_sum"]["most_common"][0]
    assert (top["value"], top["share"]) == (6, pytest.approx(0.87)) and summary["stats"]["samples"] == 100
    assert "max_mode_share" in err and "87.0%" in err
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["dominant_examples"][0]["response"] == BROKEN_REPLY
    assert report["dominant_examples"][0]["id"] == "seed-0" and report["stats"]["sources"] == {}


@pytest.mark.parametrize("layout", ["file", "folder", "hf"])
def test_train_reads_every_layout(seed_layouts, layout):
    from dflash_ray.data.tokenized import read_table
    from dflash_ray.train.schedule import dataset_samples

    samples = dataset_samples(seed_layouts[layout])
    assert len(samples) == 100 and len(set(samples)) == 100
    uri, row = samples[-1]
    last = read_table(uri, ["input_ids", "loss_mask"]).slice(row, 1).to_pylist()[0]
    assert sum(last["loss_mask"]) > 6 and len(last["input_ids"]) == len(last["loss_mask"])


def test_the_gate_refuses_ids_past_the_vocabulary_a_wrong_seq_len_and_no_tokenizer(tmp_path, capsys):
    """What training cannot use stops at the gate, naming the file, record and field."""

    def dataset(name, rows):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "part-0.parquet").write_bytes(_parquet_bytes(pa.Table.from_pylist(rows)))
        return str(folder)

    ok = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "seq_len": 4}
    past = dataset("past", [ok, {**ok, "input_ids": [1, 2, 3, 49152]}])
    code, summary, _ = _cli(capsys, "validate", "--input", past, "--tokenizer", "smollm2-135m-instruct")
    assert code == 2 and "token id 49152 is outside the tokenizer's vocabulary of 49152" in summary["error"]
    assert "record 2" in summary["error"] and "input_ids" in summary["error"]
    for name, row in (("null-id", {**ok, "input_ids": [1, None, 3, 4]}), ("null-row", {**ok, "loss_mask": None})):
        code, summary, _ = _cli(
            capsys, "validate", "--input", dataset(name, [ok, ok, row]), "--tokenizer", "smollm2-135m-instruct"
        )  # nulls slipped past as NaN before
        assert code == 2 and "null" in summary["error"] and "record 3" in summary["error"], summary
    lying = dataset("lying", [ok, {**ok, "seq_len": 9}])
    code, summary, _ = _cli(capsys, "validate", "--input", lying, "--tokenizer", "smollm2-135m-instruct")
    assert code == 2 and "seq_len is 9 but input_ids has 4 tokens" in summary["error"]
    code, summary, _ = _cli(capsys, "validate", "--input", dataset("plain", [ok]))
    assert code == 2 and "--tokenizer" in summary["error"] and "names no tokenizer" in summary["error"]

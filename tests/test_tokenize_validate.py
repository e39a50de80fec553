import io
import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from dflash_ray.stages.validate import run_validate
from dflash_ray.stages.tokenize import run_tokenize

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def _completion(i, reasoning, text, source="synthetic"):
    return {
        "id": f"c{i:05d}",
        "source": source,
        "messages": [{"role": "user", "content": f"Question number {i}: list some words."}],
        "tools": None,
        "reasoning": reasoning,
        "text": text,
        "finish_reason": "stop",
    }


def _long_text(rng, n):
    return " ".join(rng.choice(WORDS, size=n).tolist())


def write_completions(uri, rows, row_group_size=None):
    buf = io.BytesIO()
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist infers from the first row only
    pq.write_table(
        pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), buf, row_group_size=row_group_size
    )
    storage.write_bytes(storage.join(uri, "completions-00000.parquet"), buf.getvalue())
    manifest.write_manifest(
        uri, kind="completions", files=[{"name": "completions-00000.parquet", "rows": len(rows)}], summary={}
    )


def healthy_rows(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [
        _completion(
            i,
            _long_text(rng, int(rng.integers(30, 80))),
            _long_text(rng, int(rng.integers(20, 60))),
            source="math" if i % 2 else "code",
        )
        for i in range(n)
    ]


def seed_broken_rows(n=100, seed=0):
    """87% of samples answer `<think>\\n\\n</think>\\n\\nOK.` as the seed's broken dataset did."""
    rng = np.random.default_rng(seed)
    return [
        _completion(i, "", "OK.") if i % 100 < 87 else _completion(i, _long_text(rng, 60), _long_text(rng, 40))
        for i in range(n)
    ]


def test_tokenize_stage_on_s3_and_rerun(ray_cluster, s3_bucket):
    rows = healthy_rows(40)
    rows.append(
        {**_completion(99, "x", "y"), "id": "dropme", "prompt_token_ids": list(range(300)), "output_token_ids": [1, 2]}
    )
    rows.append({**_completion(98, None, None), "id": "notext"})
    src, out = storage.join(s3_bucket, "completions"), storage.join(s3_bucket, "tokenized")
    write_completions(src, rows, row_group_size=16)  # 3 work units
    cfg = load_config(None, ["tokenize.max_seq_len=256", "tokenize.overlong=drop", "tokenize.batch_size=8"])
    summary = run_tokenize(src, out, cfg)
    assert summary["rows_in"] == 42 and summary["rows_out"] == 40 and summary["rejected"] == 2
    assert summary["workers"] == 1  # 42 rows: a second actor's start would cost more than it tokenizes
    assert summary["rejected_kinds"] == {"overlong": 1, "missing_field": 1}
    rejected = [json.loads(x) for x in storage.read_text(storage.join(out, "rejected.jsonl")).splitlines()]
    assert {r["id"] for r in rejected} == {"dropme", "notext"}
    files = manifest.dataset_files(out)
    assert len(files) == summary["files"] == 3  # one output file per input row group
    tables = []
    for f in files:
        fs, path = storage.arrow_filesystem(f)
        tables.append(pq.read_table(path, filesystem=fs))
    table = pa.concat_tables(tables)
    assert table.schema.field("input_ids").type == pa.list_(pa.int32())
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert sorted(table["id"].to_pylist()) == sorted(r["id"] for r in rows[:40])
    for ids, mask, n in zip(
        table["input_ids"].to_pylist(), table["loss_mask"].to_pylist(), table["seq_len"].to_pylist()
    ):
        assert len(ids) == len(mask) == n and 0 < sum(mask) < n
    assert summary["tokens"] == sum(table["seq_len"].to_pylist())

    assert summary["tokens_cut"] == 0 and summary["share_kept"] == 1.0  # dropped, not cut

    # a rerun with other settings, told to, replaces the dataset: the old files are gone, the manifest
    # lists only the new ones;
    # truncation reports what it cut of what was generated
    long = {
        **_completion(97, "x", "y"),
        "id": "long",
        "prompt_token_ids": list(range(100)),
        "output_token_ids": [1] * 300,
    }
    write_completions(src, rows[:10] + [long])
    again = load_config(None, ["tokenize.max_seq_len=256", "tokenize.batch_size=8"])
    with pytest.raises(DFlashError, match="made from other tokenize.overlong"):
        run_tokenize(src, out, again)
    summary = run_tokenize(src, out, again, replace=True)
    assert summary["rows_out"] == 11 and summary["truncated"] == 1 and summary["tokens_cut"] == 400 - 256
    assert summary["share_kept"] == round(summary["tokens"] / (summary["tokens"] + 144), 4) < 1
    assert storage.list_files(out, ".parquet") == manifest.dataset_files(out)


def test_the_tokenizer_pool_is_a_cpu_each_and_a_worker_per_thousand_rows_at_most():
    from dflash_ray.stages.tokenize import pool_size

    units = [{"rows": 500}] * 8  # 4,000 rows
    assert [pool_size(units, None, cpus) for cpus in (0, 1, 2, 16)] == [1, 1, 2, 4]
    assert pool_size(units[:1], None, 16) == 1 and pool_size([{"rows": 0}] * 3, None, 16) == 1
    assert pool_size(units, 6, 2) == 6 and pool_size(units[:2], 6, 2) == 2  # as set, at most a unit each


def _tokenized(tmp_path, rows, name):
    src, out = str(tmp_path / f"{name}-completions"), str(tmp_path / f"{name}-tokenized")
    write_completions(src, rows)
    run_tokenize(src, out, load_config(None, ["tokenize.batch_size=32"]))
    return out


def test_gate_fails_the_seed_six_token_dataset(ray_cluster, tmp_path):
    data = _tokenized(tmp_path, seed_broken_rows(), "broken")
    report_dir = str(tmp_path / "report")
    done = subprocess.run(
        [sys.executable, "-m", "dflash_ray.cli", "validate", "--input", data, "--report", report_dir, "--json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 3, done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] is False and summary["passed"] is False
    assert {"max_mode_share", "min_median_response", "max_empty_thinking_share"} <= set(summary["failed_rules"])
    top = summary["stats"]["loss_mask_sum"]["most_common"][0]
    assert top["share"] == pytest.approx(0.87) and top["value"] == 7  # <think> \n\n </think> \n\n OK . <|im_end|>
    assert summary["stats"]["empty_thinking_share"] == pytest.approx(0.87)
    assert "max_mode_share" in done.stderr and "87.0%" in done.stderr
    report = json.loads(open(f"{report_dir}/report.json").read())
    assert report["dominant_examples"][0]["response"] == "<think>\n\n</think>\n\nOK.<|im_end|>"
    assert open(f"{report_dir}/loss_mask_sum.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "FAILED" in open(f"{report_dir}/report.md").read()


def test_gate_passes_a_healthy_dataset(ray_cluster, tmp_path):
    data = _tokenized(tmp_path, healthy_rows(80), "healthy")
    cfg = load_config()
    report = run_validate(data, cfg, report_dir=str(tmp_path / "report"))
    assert report["passed"], report["rules"]
    stats = report["stats"]
    assert stats["samples"] == 80 and stats["no_loss_share"] == 0 and stats["empty_thinking_share"] == 0
    assert 0 < stats["response_fraction"] < 1
    assert stats["offline_storage_bytes"] == 5 * 5120 * 2 * stats["tokens"]
    assert set(stats["sources"]) == {"math", "code"}
    assert len(report["random_examples"]) == cfg.validate.num_examples
    assert all(ex["response"].startswith("<think>") for ex in report["random_examples"])


@pytest.mark.parametrize(
    "kind, says", [("prompts", "holds prompts, not completions"), ("tokenized", "holds tokenized samples already")]
)
def test_tokenize_refuses_a_dataset_of_another_stage_naming_what_it_holds(tmp_path, kind, says):
    from dflash_ray.errors import DFlashError

    folder = str(tmp_path / kind)
    manifest.write_manifest(folder, kind=kind, files=[], summary={})
    with pytest.raises(DFlashError, match=says) as e:
        run_tokenize(folder, str(tmp_path / "out"), load_config())
    assert e.value.file == folder


def _rendered(tmp_path, rows, name, remask=None):
    """A tokenized dataset made without Ray: each row rendered by the chat template and masked as
    `tokenize` does, then `remask(mask)` applied to every mask."""
    from dflash_ray.data import masking
    from dflash_ray.registry import load_tokenizer

    tokenizer = load_tokenizer(load_config().tokenize.tokenizer)
    samples = [masking.render(tokenizer, r) for r in rows]
    masks = [remask(s.loss_mask) if remask else s.loss_mask for s in samples]
    table = pa.table(
        {
            "input_ids": pa.array([s.input_ids.tolist() for s in samples], pa.list_(pa.int32())),
            "loss_mask": pa.array([m.tolist() for m in masks], pa.list_(pa.int8())),
            "id": [r["id"] for r in rows],
        }
    )
    (tmp_path / name).mkdir()
    pq.write_table(table, tmp_path / name / "part-0.parquet")
    return str(tmp_path / name)


@pytest.mark.parametrize(
    "remask, rule",
    [(lambda m: 1 - m, "prompt_loss"), (lambda m: np.ones_like(m), "all_loss"), (None, None)],
    ids=["inverted", "all-ones", "as-tokenized"],
)
def test_gate_fails_a_mask_on_the_prompt_and_an_all_loss_mask_naming_the_rule(tmp_path, capsys, remask, rule):
    from dflash_ray.cli import main

    rng = np.random.default_rng(1)
    rows = [  # prompts as long and varied as the answers: the distributions alone pass an inverted mask
        {**r, "messages": [{"role": "user", "content": f"Question {i}: {_long_text(rng, int(rng.integers(40, 90)))}"}]}
        for i, r in enumerate(healthy_rows(40))
    ]
    data = _rendered(tmp_path, rows, "data", remask)
    code = main(["validate", "--input", data, "--tokenizer", load_config().tokenize.tokenizer, "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    if rule is None:  # the mask `tokenize` makes: on the response alone
        assert code == 0 and summary["passed"], summary["rules"]
        assert summary["stats"]["prompt_loss_share"] == summary["stats"]["all_loss_share"] == 0
        return
    assert code == 3, err
    assert summary["failed_rules"] == ["prompt_loss"] + (["all_loss"] if rule == "all_loss" else [])
    assert summary["stats"]["prompt_loss_share"] == 1.0
    assert f"{rule}: " in err and "whose loss tokens read '<|im_start|>user\\nQuestion 0: " in err


def test_prompt_loss_accepts_earlier_answers_and_refuses_a_header_under_the_loss():
    """A conversation answered turn by turn trains on each answer; a mask shifted onto the header does not pass."""
    from dflash_ray.data import masking
    from dflash_ray.data.validate import assistant_header, prompt_loss
    from dflash_ray.registry import load_tokenizer

    tokenizer = load_tokenizer(load_config().tokenize.tokenizer)
    record = {
        **_completion(0, "thinking it over", "second"),
        "messages": [
            {"role": "user", "content": "a?"},
            {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "b?"},
        ],
        "regenerate": True,
    }
    sample = masking.render(tokenizer, record)
    header = assistant_header(tokenizer)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask])) == 1)
    assert len(runs) == 2  # the earlier answer and the response
    offsets = np.asarray([0, sample.input_ids.size])
    assert not prompt_loss(sample.input_ids, sample.loss_mask, offsets, header, int(header[0]))[0]
    shifted = np.concatenate([sample.loss_mask[2:], [0, 0]])  # the loss starts on the assistant header's end
    assert prompt_loss(sample.input_ids, shifted, offsets, header, int(header[0]))[0]


def test_tokenize_keeps_each_sample_once_from_a_folder_holding_copies_of_its_shard(ray_cluster, tmp_path):
    """A completions folder holding three copies of its shard (and a record twice in it): every copy is
    dropped once tokenized, counted, each named in rejected.jsonl beside the sample it repeats; the
    copies' files go, and the gate names what tokenize dropped."""
    rows = healthy_rows(12)
    rows.append({**rows[0], "id": "again"})  # the same conversation and answer under another id
    src, out = tmp_path / "completions", str(tmp_path / "tokenized")
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    names = [f"completions-0000{i}.parquet" for i in range(3)]
    for name in names:
        storage.write_bytes(str(src / name), buf.getvalue())
    manifest.write_manifest(str(src), kind="completions", files=[{"name": n, "rows": 13} for n in names], summary={})
    summary = run_tokenize(str(src), out, load_config(None, ["tokenize.batch_size=8"]))
    assert summary["rows_in"] == 39 and summary["rows_out"] == 12 and summary["duplicates"] == 27, summary
    assert summary["rejected_kinds"] == {"duplicate": 27} and summary["files"] == 1
    rejected = [json.loads(x) for x in storage.read_text(storage.join(out, "rejected.jsonl")).splitlines()]
    assert rejected[0]["id"] == "again" and "as sample c00000 (tokenized-" in rejected[0]["reason"], rejected[0]
    assert len(storage.list_files(out, ".parquet")) == 1
    report = run_validate(out, load_config())
    assert report["passed"] and report["stats"]["duplicates"] == 0 and report["stats"]["duplicates_dropped"] == 27
    assert "it dropped 27 here" in next(r["message"] for r in report["rules"] if r["rule"] == "duplicates")


def test_the_gate_names_samples_repeated_token_for_token(tmp_path, capsys):
    from dflash_ray.cli import main

    rows = healthy_rows(30)
    data = _rendered(tmp_path, rows + [{**r, "id": f"copy-{r['id']}"} for r in rows[:5]], "data")
    code = main(["validate", "--input", data, "--tokenizer", load_config().tokenize.tokenizer, "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert code == 3 and summary["failed_rules"] == ["duplicates"], summary["failed_rules"]
    assert summary["stats"]["duplicates"] == 5 and "5 samples (14.3%) repeat an earlier one" in err
    assert "e.g. copy-c00000 repeats c00000" in err

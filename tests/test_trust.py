"""What a file may hand us and what a run may touch: no column's code runs, no folder of the user's
is written into, no private record lands in a world-readable file, and nothing a manifest names is
loaded from a place it chose."""

import hashlib
import json
import os
import pathlib
import stat

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray import cli, manifest
from dflash_ray.errors import DFlashError


class _Touch:
    """Unpickling it creates the file `marker`: the code a pickled column can carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _pickled_column(table: pa.Table, marker) -> pa.Table:
    """`table` with a column `extra` of Ray's pickled-object extension type."""
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    return table.append_column("extra", ArrowPythonObjectArray.from_objects([_Touch(marker)] * table.num_rows))


def _cli(capsys, *argv):
    code = cli.main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_pickled_column_runs_no_code_in_any_stage(tmp_path, capsys):
    from dflash_ray.data.tokenized import open_tokenized
    from dflash_ray.generation.shards import plan_units

    marker = tmp_path / "ran"
    prompts = pa.Table.from_pylist([{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)])
    completions = pa.Table.from_pylist(
        [
            {"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}"}], "text": "a", "output_token_ids": [4]}
            for i in range(3)
        ]
    )
    tokenized = pa.Table.from_pylist([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "seq_len": 3}] * 3)
    files = {}
    for name, table in (("prompts", prompts), ("completions", completions), ("tokenized", tokenized)):
        (tmp_path / name).mkdir()
        files[name] = tmp_path / name / "part-0.parquet"
        pq.write_table(_pickled_column(table, marker), files[name])
    # the hazard is real: reading the file as Arrow's Python objects runs the pickle
    pq.read_table(files["prompts"]).column("extra").to_pylist()
    assert marker.exists()
    marker.unlink()

    runs = {
        "prompts": ["prompts", "--input", str(files["prompts"]), "--output", str(tmp_path / "p-out")],
        "tokenize": ["tokenize", "--input", str(tmp_path / "completions"), "--output", str(tmp_path / "t-out")],
        "validate": ["validate", "--input", str(tmp_path / "tokenized"), "--tokenizer", "smollm2-135m-instruct"],
    }
    for stage, argv in runs.items():
        code, summary = _cli(capsys, *argv, "--set", "tokenize.tokenizer=smollm2-135m-instruct")
        assert code == 2 and "field 'extra'" in summary["error"], (stage, summary)
        assert "ray.data.arrow_pickled_object" in summary["error"] and not marker.exists(), stage
    for reader in (  # training's reader, and the shards generation leases out
        lambda: open_tokenized(str(tmp_path / "tokenized")),
        lambda: plan_units([str(files["prompts"])], 2),
    ):
        with pytest.raises(DFlashError, match="field 'extra'"):
            reader()
    assert not marker.exists()


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_stage_never_writes_into_a_folder_of_the_users_own(tmp_path, capsys):
    source = tmp_path / "chats.jsonl"
    source.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(3))
    )
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "prompts-00000.parquet").write_bytes(b"the user's own shard")
    (mine / "quarantine.jsonl").write_text("the user's notes\n")
    before = {p.name: _digest(p) for p in mine.iterdir()}
    for extra in ([], ["--replace"]):
        code, summary = _cli(capsys, "prompts", "--input", str(source), "--output", str(mine), *extra)
        assert (
            code == 2 and "no dflash-ray run wrote" in summary["error"] and "prompts-00000.parquet" in summary["error"]
        )
        assert {p.name: _digest(p) for p in mine.iterdir()} == before

    # our own folder: a first run marks it, a rerun that failed before its manifest goes on there
    ours = tmp_path / "ours"
    assert _cli(capsys, "prompts", "--input", str(source), "--output", str(ours))[0] == 0
    # a file of the user's put beside a finished dataset, named as a shard might be, survives a rerun
    (ours / "prompts-00000.parquet").write_bytes(b"kept")
    assert _cli(capsys, "prompts", "--input", str(source), "--output", str(ours), "--replace")[0] == 0
    assert (ours / "prompts-00000.parquet").read_bytes() == b"kept"
    assert len(manifest.dataset_files(str(ours))) == 1


def test_the_demo_clears_only_the_training_output_it_made(tmp_path):
    from dflash_ray.config import load_config
    from dflash_ray.stages.pipeline import clear_pipeline_training

    cfg = load_config()
    work = tmp_path / "work"
    theirs = work / "train" / "checkpoints" / "step-00000004"
    theirs.mkdir(parents=True)  # another run's checkpoints: what a training run writes, not the demo's
    (theirs / "state.json").write_text("{}")
    with pytest.raises(DFlashError, match="did not make"):
        clear_pipeline_training(str(work), cfg)
    assert (theirs / "state.json").exists()

    fresh = tmp_path / "fresh"
    clear_pipeline_training(str(fresh), cfg)  # nothing there: marked as the pipeline's
    (fresh / "train" / "checkpoints").mkdir(parents=True)
    (fresh / "train" / "metrics.jsonl").write_text("{}\n")
    clear_pipeline_training(str(fresh), cfg)  # its own: cleared
    assert not (fresh / "train").exists()


def test_a_private_inputs_records_stay_private(tmp_path, capsys):
    source = tmp_path / "private.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "fine"}]}\n{"messages": "secret-token-123"\n')
    source.chmod(0o600)
    code, summary = _cli(capsys, "prompts", "--input", str(source), "--output", str(tmp_path / "out"))
    assert code == 0 and summary["quarantined"] == 1
    quarantine = tmp_path / "out" / "quarantine.jsonl"
    assert "secret-token-123" in quarantine.read_text()
    written = [quarantine, *(tmp_path / "out").glob("*.parquet")]
    assert all(stat.S_IMODE(os.stat(p).st_mode) & 0o077 == 0 for p in written), [
        oct(os.stat(p).st_mode) for p in written
    ]


def test_validate_loads_no_tokenizer_from_a_path_the_manifest_chose(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    table = pa.Table.from_pylist([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "seq_len": 3}])
    pq.write_table(table, data / "part-0.parquet")
    elsewhere = tmp_path / "elsewhere" / "tok"
    elsewhere.mkdir(parents=True)  # the tokenizer folder would be read from here
    written = manifest.commit(
        str(data),
        kind="tokenized",
        files=[{"name": "part-0.parquet", "rows": 1, **manifest.file_entry((data / "part-0.parquet").read_bytes())}],
        summary={},
        config={"tokenize": {"tokenizer": str(elsewhere)}},
        prefix="tokenized-",
    )
    assert written
    code, summary = _cli(capsys, "validate", "--input", str(data))
    assert code == 2 and "a path it chose" in summary["error"] and "tokenize.tokenizer" in summary["error"]


def test_a_signal_during_a_start_up_stops_the_command_once_the_start_is_over():
    import signal

    from dflash_ray.errors import signals_held

    finished = []
    # Python's own Ctrl-C handler, as a command starts with: whatever an earlier test in this
    # process left (a test runner's worker ignores SIGINT) is put back after
    left = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of `ray.init`
                finished.append(True)  # the start is not cut short inside a library's C++ code
        assert finished and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, left)


@pytest.mark.parametrize(
    "argv, said",
    [
        (["prompts", "--input", "gs://bucket/chats.jsonl", "--output", "OUT"], "unsupported scheme 'gs://'"),
        (["tokenize", "--input", "https://example.com/c.parquet", "--output", "OUT"], "unsupported scheme 'https://'"),
        (["validate", "--input", "DATA", "--set", "train.seed=99999999999999999999"], "field 'train.seed'"),
        (["validate", "--input", "DATA", "--set", "generate.seed=-1"], "field 'generate.seed'"),
        (
            ["prompts", "--input", "DATA", "--output", "OUT", "--set", "prompts.tokenizer="],
            "'prompts.tokenizer': is empty",
        ),
        (["prompts", "--input", "SPLITS", "--output", "OUT"], "a dataset with splits train, test: give one split's"),
        (["tokenize", "--input", "SPLITS", "--output", "OUT"], "a dataset with splits train, test: give one split's"),
    ],
)
def test_inputs_settings_and_seeds_nothing_can_use_are_named(argv, said, tmp_path, capsys):
    splits = tmp_path / "SPLITS"  # what `DatasetDict.save_to_disk` writes
    for split in ("train", "test"):
        (splits / split).mkdir(parents=True)
        (splits / split / "dataset_info.json").write_text("{}")
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    argv = [str(tmp_path / a) if a in ("OUT", "DATA", "SPLITS") else a for a in argv]
    code, summary = _cli(capsys, *argv)
    assert code == 2 and said in summary["error"], summary

"""`dflash-ray pretrain`: the run's drafter trained on raw text from the target's embedding and head
(no target forward), exported where `train.init_from` and the one-sample gate start from it; text
of every kind it reads, and bad text named by file and record."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from dflash_ray.registry import SMOLLM2
from dflash_ray.stages.pretrain import embedding_features, run_pretrain

TINY = ["train.num_layers=1", "train.block_size=4", "train.num_anchors=16", "train.lr=3e-3"]
SHORT = ["pretrain.seq_len=64", "pretrain.batch_size=2", "pretrain.warmup_ratio=0"]


def _text(folder):
    """One source of each kind: plain text, JSONL text records, Parquet chat records."""
    folder.mkdir()
    (folder / "story.txt").write_text("The quick brown fox jumps over the lazy dog. " * 30)
    (folder / "notes.jsonl").write_text(
        "\n".join(json.dumps({"text": f"note {i}: water boils at 100 C"}) for i in range(8))
    )
    chats = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]] * 4
    pq.write_table(pa.table({"messages": chats}), folder / "chats.parquet")
    return str(folder)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    data = _text(root / "text")
    cfg = load_config(None, [*TINY, *SHORT, "pretrain.steps=40"])
    return run_pretrain(SMOLLM2, [data], str(root / "out"), cfg, progress=False), str(root / "out"), data


@pytest.mark.slow
def test_the_drafter_learns_the_text_and_is_exported_for_a_warm_start(pretrained):
    from dflash_ray.data.pretrain_text import data_files, documents
    from dflash_ray.registry import load_tokenizer

    summary, out, data = pretrained
    assert summary["steps"] == 40 and summary["family"] == "dflash" and summary["start"] == "target"
    docs = list(documents(data_files(data), load_tokenizer(SMOLLM2)))
    assert len(docs) == 1 + 8 + 4  # the text file, each JSONL record, each chat
    assert summary["tokens_per_epoch"] == sum(len(d) + 1 for d in docs)  # an end-of-text token after each
    assert summary["epochs"] > 1  # read again from the start when it ran out
    assert summary["loss_end"] < 0.5 * summary["loss_start"], summary  # text seen many times is learned
    assert json.load(open(f"{out}/pretrain.json"))["steps"] == 40
    assert json.load(open(f"{out}/config.json"))["architectures"] == ["DFlashDraftModel"]


@pytest.mark.slow
def test_train_starts_from_the_pretrained_drafter(pretrained):
    from dflash_ray.drafter.export import load_drafter
    from dflash_ray.train.shape import drafter_config, drafter_init
    from dflash_ray.train.workers import DrafterWorker

    _, out, _ = pretrained
    cfg = load_config(None, [*TINY, f"train.init_from={out}"])
    start = drafter_init(SMOLLM2, cfg)
    assert start == f"drafter:{out}"
    worker = DrafterWorker(SMOLLM2, json.dumps(drafter_config(SMOLLM2, cfg)), start, cfg.train, 0, 1)
    exported = load_drafter(out).state_dict()
    assert all(torch.equal(worker.drafter.state_dict()[k].cpu(), v) for k, v in exported.items())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_one_sample_gate_passes_from_a_warm_start(pretrained):
    from dflash_ray.stages.onesample import run_onesample

    _, out, _ = pretrained
    summary = run_onesample(SMOLLM2, load_config(None, [*TINY, f"train.init_from={out}"]))
    assert summary["passed"] and summary["lossless"] and summary["accuracy"] == 1.0


def test_the_target_layers_stand_in_is_the_embedding_in_every_slot():
    embed = torch.randn(10, 3)
    ids = torch.tensor([[1, 4, 9]])
    features = embedding_features(embed, ids, 2)
    assert features.shape == (1, 3, 6)
    assert torch.equal(features[..., :3], embed[ids]) and torch.equal(features[..., 3:], embed[ids])


@pytest.mark.parametrize(
    "name, content, where",
    [
        ("bad.jsonl", '{"text": "fine"}\n{"text": oops}\n', "record 2"),
        ("odd.jsonl", '{"body": "no column we read"}\n', "has none of the columns"),
        ("num.jsonl", '{"text": 7}\n', "field 'text'"),
    ],
)
def test_bad_text_is_named_by_file_and_record_and_nothing_is_written(tmp_path, name, content, where):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_text(content)
    cfg = load_config(None, [*TINY, *SHORT, "pretrain.steps=1"])
    with pytest.raises(DFlashError) as e:
        run_pretrain(SMOLLM2, [str(tmp_path / "data")], str(tmp_path / "out"), cfg, progress=False)
    assert name in str(e.value) and where in str(e.value) and e.value.exit_code == 2
    assert not (tmp_path / "out").exists()


BINARY = bytes(range(256)) * 8  # no UTF-8


@pytest.mark.parametrize(
    "name, content, where",
    [
        ("blob.txt", BINARY, "not UTF-8 text: byte 128 (0x80) on line 2"),
        ("nul.md", b"text\n\x00\x01\x02", "not text: a NUL byte on line 2"),
        ("blob.jsonl", b'{"text": "fine"}\n' + bytes(range(128, 256)), "record 2: invalid UTF-8"),
        ("deep.jsonl", b'{"text": "fine"}\n{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "record 2: lists"),
        ("twice.jsonl", b'{"text": "a", "text": "b"}\n', "record 1: text: the key is given twice"),
        ("ids.jsonl", b'{"input_ids": [1, "two"]}\n', "record 1: field 'input_ids': input_ids[1]: 'two' is not a"),
        ("past.jsonl", b'{"input_ids": [1, 49152]}\n', "token id 49152 is outside the tokenizer's vocabulary"),
        ("bad.parquet", BINARY, "not a readable Parquet file"),
    ],
)
def test_text_that_is_none_is_refused_before_the_drafter_is_built(tmp_path, monkeypatch, name, content, where):
    from dflash_ray.stages import pretrain

    def no_drafter(*args):
        raise AssertionError("the drafter was built before the text was read")

    monkeypatch.setattr(pretrain, "_worker", no_drafter)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / name).write_bytes(content)
    cfg = load_config(None, [*TINY, *SHORT, "pretrain.steps=1"])
    with pytest.raises(DFlashError) as e:
        run_pretrain(SMOLLM2, [str(tmp_path / "data")], str(tmp_path / "out"), cfg, progress=False)
    assert str(e.value).startswith(str(tmp_path / "data" / name)) and where in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists() and (tmp_path / "data" / name).read_bytes() == content


def test_a_dataset_tokenized_for_another_target_exits_2_naming_it(tmp_path, capsys):
    from dflash_ray import manifest
    from dflash_ray.cli import main

    data = tmp_path / "tokenized"
    data.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3] * 30] * 4}), data / "tokenized-00000.parquet")
    manifest.write_manifest(
        str(data),
        kind="tokenized",
        files=[{"name": "tokenized-00000.parquet", "rows": 4}],
        summary={"tokenizer": "qwen3"},
    )
    args = [a for s in [*TINY, *SHORT, "pretrain.steps=1"] for a in ("--set", s)]
    code = main(["pretrain", "--target", SMOLLM2, "--data", str(data), "--output", str(tmp_path / "out"), *args])
    error = capsys.readouterr().err
    assert (
        code == 2
        and f"{data}: field 'summary.tokenizer': a tokenized dataset made with the tokenizer of 'qwen3'" in error
    )
    assert not (tmp_path / "out").exists()


def test_a_users_files_and_the_text_itself_are_never_overwritten(tmp_path):
    data = _text(tmp_path / "text")
    cfg = load_config(None, [*TINY, *SHORT, "pretrain.steps=1"])
    with pytest.raises(DFlashError, match="overlap"):
        run_pretrain(SMOLLM2, [data], f"{data}/out", cfg, progress=False)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    with pytest.raises(DFlashError, match="no drafter export"):
        run_pretrain(SMOLLM2, [data], str(mine), cfg, progress=False)
    assert (mine / "config.json").read_text() == '{"mine": true}' and sorted(p.name for p in mine.iterdir()) == [
        "config.json"
    ]


def test_the_command_prints_its_summary(tmp_path, capsys):
    from dflash_ray.cli import main

    data = _text(tmp_path / "text")
    args = [a for s in [*TINY, *SHORT, "pretrain.steps=2"] for a in ("--set", s)]
    code = main(["pretrain", "--target", SMOLLM2, "--data", data, "--output", str(tmp_path / "out"), "--json", *args])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["stage"] == "pretrain" and summary["steps"] == 2

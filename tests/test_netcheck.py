"""`dflash-ray netcheck` and the bandwidth floor training checks first, on the session's local
cluster (gloo between two probes of one node); the cross-node pair is measured in the two-node test
of `test_train.py`."""

import pytest

from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError

SETTINGS = ["train.num_streams=2", "train.actor_cpus=0.25"]


def test_netcheck_measures_every_pair_and_training_refuses_under_the_floor(ray_cluster, tmp_path):
    from dflash_ray.stages.netcheck import run_netcheck
    from dflash_ray.stages.train import run_train
    from dflash_ray.tiny_models import tiny_qwen3

    summary = run_netcheck(load_config(None, SETTINGS), megabytes=4, iters=2)
    assert summary["ranks"] == 2 and len(set(summary["nodes"])) == 1
    [pair] = summary["pairs"]  # two ranks of one node: their own pair
    assert pair["ranks"] == [0, 1] and pair["within_node"] and pair["bus_gbs"] > 0
    assert summary["all_reduce_bus_gbs"] > 0 and summary["above_floor"] is None  # no floor set

    floor = pair["bus_gbs"] * 1000  # no loopback carries this
    judged = run_netcheck(load_config(None, SETTINGS + [f"train.min_bus_bandwidth={floor}"]), megabytes=4, iters=2)
    assert judged["above_floor"] is False and "below the floor" in judged["below_floor"]

    # training measures before any stream actor starts, and refuses naming the field and the pair
    target = tiny_qwen3(tmp_path / "target", num_layers=2, hidden_size=32, vocab_size=256)
    with pytest.raises(DFlashError) as e:
        run_train(
            str(target),
            str(tmp_path / "no-data"),
            str(tmp_path / "out"),
            load_config(
                None,
                SETTINGS + [f"train.min_bus_bandwidth={floor}", "train.num_layers=1", "train.target_layer_ids=[0,1]"],
            ),
            progress=False,
        )
    assert e.value.field == "train.min_bus_bandwidth" and f"within node {pair['nodes'][0]}" in str(e.value)
    assert not (tmp_path / "out").exists()

    with pytest.raises(DFlashError) as e:
        run_netcheck(load_config(None, ["train.num_streams=1"]))
    assert e.value.field == "train.num_streams"


def _refused_storage(capsys, uri: str) -> str:
    from dflash_ray.cli import main

    assert main(["netcheck", "--storage", uri]) == 2
    return capsys.readouterr().err


def test_storage_with_nothing_to_read_is_refused_naming_it_before_ray_starts(tmp_path, capsys, monkeypatch):
    """A missing path, an empty folder, one with sub-folders alone, empty files, a Hub id (no
    network: HF_HUB_OFFLINE) and an empty URI: each one line naming it and `--storage`, and no
    cluster joined or started for it."""
    from dflash_ray import cluster

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was reached for a URI with nothing to read")

    monkeypatch.setattr(cluster, "connect", no_ray)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # `Qwen/Qwen3-8B` is no local path here
    (tmp_path / "empty").mkdir()
    (tmp_path / "nested" / "inner").mkdir(parents=True)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "model.safetensors").write_bytes(b"")
    for uri, says in (
        (str(tmp_path / "no-such-model"), "no such file or folder"),
        (str(tmp_path / "empty"), "no file directly in this folder"),
        (str(tmp_path / "nested"), "sub-folders are not read"),
        (str(tmp_path / "blank"), "are empty"),
        ("Qwen/Qwen3-8B", "Hugging Face Hub id"),
        ("hf://Qwen/Qwen3-8B", "measures local or s3:// storage"),
        ("gs://bucket/model", "unsupported scheme"),
    ):
        err = _refused_storage(capsys, uri)
        assert f"{uri}: field '--storage'" in err and says in err and "internal error" not in err, err
    assert "field '--storage': is empty" in _refused_storage(capsys, "")


def test_storage_on_s3_is_listed_on_the_driver_and_a_missing_prefix_or_bucket_refused(s3_bucket, capsys, monkeypatch):
    from dflash_ray import cluster, storage
    from dflash_ray.stages.netcheck import storage_files

    monkeypatch.setattr(cluster, "connect", lambda *a, **k: pytest.fail("Ray was reached"))
    storage.write_bytes(f"{s3_bucket}/model/model-00001.safetensors", b"x" * 300)
    storage.write_bytes(f"{s3_bucket}/model/config.json", b"{}")
    assert storage_files(f"{s3_bucket}/model") == {
        f"{s3_bucket}/model/config.json": 2,
        f"{s3_bucket}/model/model-00001.safetensors": 300,
    }
    assert storage_files(f"{s3_bucket}/model/config.json") == {f"{s3_bucket}/model/config.json": 2}
    for uri in (f"{s3_bucket}/no-such-model", "s3://no-such-bucket-dflash/model"):
        err = _refused_storage(capsys, uri)
        assert f"{uri}: field '--storage'" in err and "internal error" not in err, err


def test_storage_reads_the_largest_files_first_in_ranged_reads_and_advises_only_what_plan_takes(tmp_path, monkeypatch):
    """A model folder's files by size, read as a start-up reads them (chunks, several at once) up to
    the bytes asked; the advice is a value `plan` takes, or none from less than one round of reads."""
    from dflash_ray.stages.netcheck import advice, read_rate, storage_files

    folder = tmp_path / "model"
    folder.mkdir()
    mib = 1 << 20
    (folder / "model-00001.safetensors").write_bytes(b"a" * 5 * mib)
    (folder / "model-00002.safetensors").write_bytes(b"b" * 3 * mib)
    (folder / "config.json").write_bytes(b"{}")
    files = storage_files(str(folder))
    assert files == {
        str(folder / n): s
        for n, s in (("config.json", 2), ("model-00001.safetensors", 5 * mib), ("model-00002.safetensors", 3 * mib))
    }
    monkeypatch.setenv("DFLASH_RAY_S3_CONCURRENCY", "2")
    monkeypatch.setenv("DFLASH_RAY_S3_CHUNK_MB", "1")
    measured = read_rate(files, 6 * mib)
    assert measured["files"] == [str(folder / "model-00001.safetensors"), str(folder / "model-00002.safetensors")]
    assert measured["bytes"] == 6 * mib and measured["seconds"] > 0 and measured["chunk_bytes"] == mib
    assert advice(measured)["set"] is not None  # 6 MiB: three rounds of two 1 MiB reads

    round_of_reads = {"concurrency": 16, "chunk_bytes": 64 << 20}
    tiny = advice({"bytes": 3, "seconds": 0.001, **round_of_reads})
    assert tiny["set"] is None and "fewer than one round" in tiny["warning"] and tiny["storage_gb_per_s"] > 0
    for seconds, edge in ((1e-9, "ceiling"), (1e9, "floor")):  # a page cache's rate; a stalled store's
        advised = advice({"bytes": 2 << 30, "seconds": seconds, **round_of_reads})
        assert edge in advised["warning"]
        setting = advised["set"].removeprefix("--set ")
        assert load_config(None, [setting]).plan.storage_gb_per_s in (0.001, 1000)
    usual = advice({"bytes": 2 << 30, "seconds": 2.0, **round_of_reads})
    assert usual["set"] == "--set plan.storage_gb_per_s=1.074" and "warning" not in usual


def test_storage_check_measures_a_local_model_folder_on_a_node(ray_cluster, tmp_path, capsys):
    """The documented use, a folder of safetensors files, measured on a node (it was read as one
    file); a 3-byte file's figure advises no plan.storage_gb_per_s (it advised one plan refuses)."""
    import json

    from dflash_ray.cli import main

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a" * 4096)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"b" * 1024)
    (tmp_path / "tiny.bin").write_bytes(b"abc")
    assert main(["netcheck", "--storage", str(folder), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == [
        str(folder / "model-00001-of-00002.safetensors"),
        str(folder / "model-00002-of-00002.safetensors"),
    ]
    assert out["bytes"] == 5120 and out["storage_gb_per_s"] > 0
    assert out["set"] is None and "fewer than one round" in out["warning"]  # 5 KB: the requests' latency
    assert main(["netcheck", "--storage", str(tmp_path / "tiny.bin"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes"] == 3 and out["set"] is None and "plan.storage_gb_per_s" in out["warning"]

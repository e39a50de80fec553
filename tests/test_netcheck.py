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

"""A run that starts from a released drafter (`train.init_from`): its weights, not a random or the
target's start; a drafter whose weights would mean something else in this run is refused naming
the setting; a DSpark run keeps a plain DFlash drafter's backbone."""

import json

import pytest
import torch

from dflash_ray.config import load_config
from dflash_ray.drafter.export import from_hf_config, save_drafter
from dflash_ray.drafter.init import initial_drafter
from dflash_ray.errors import DFlashError
from dflash_ray.tiny_models import tiny_qwen3
from dflash_ray.train.shape import drafter_config, drafter_init

SETTINGS = ["train.num_layers=1", "train.target_layer_ids=[0,1,2]"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("target"), num_layers=4, hidden_size=64, vocab_size=512)


@pytest.fixture(scope="module")
def released(target, tmp_path_factory):
    """A drafter someone trained: here one with weights no start of this run makes."""
    cfg = load_config(None, SETTINGS)
    drafter = initial_drafter(from_hf_config(drafter_config(target, cfg)), target, "random", seed=1234)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01)
    folder = tmp_path_factory.mktemp("released")
    save_drafter(drafter, folder, dtype=torch.float32)
    return str(folder), {k: v.clone() for k, v in drafter.state_dict().items()}


def test_a_run_starts_from_the_released_drafters_weights(target, released):
    from dflash_ray.train.workers import DrafterWorker

    folder, weights = released
    cfg = load_config(None, [*SETTINGS, f"train.init_from={folder}", "train.block_size=8"])  # a block size is free
    mode = drafter_init(target, cfg)
    worker = DrafterWorker(target, json.dumps(drafter_config(target, cfg)), mode, cfg.train, 0, 1)
    got = worker.drafter.state_dict()
    assert sorted(got) == sorted(weights)
    assert all(torch.equal(got[k].cpu(), weights[k]) for k in weights)
    cold = load_config(None, SETTINGS)
    random = DrafterWorker(
        target, json.dumps(drafter_config(target, cold)), drafter_init(target, cold), cold.train, 0, 1
    )
    assert not torch.equal(random.drafter.fc.weight.cpu(), weights["fc.weight"])


@pytest.mark.parametrize(
    "change, field",
    [
        ("train.num_layers=2", "train.num_layers"),
        ("train.mask_token_id=7", "train.mask_token_id"),
        ("train.target_layer_ids=[0,1,3]", "train.target_layer_ids"),
        ("train.target_layer_ids=[0,2]", "train.num_target_features"),
    ],
)
def test_a_released_drafter_whose_weights_mean_something_else_is_refused_naming_the_setting(
    target, released, change, field
):
    cfg = load_config(None, [*SETTINGS, f"train.init_from={released[0]}", change])
    with pytest.raises(DFlashError) as e:
        drafter_init(target, cfg)
    assert e.value.field == field and e.value.exit_code == 2, str(e.value)


def test_no_drafter_in_the_folder_is_named(target, tmp_path):
    cfg = load_config(None, [*SETTINGS, f"train.init_from={tmp_path}"])
    with pytest.raises(DFlashError, match="no exported drafter here"):
        drafter_init(target, cfg)


def test_a_dspark_run_keeps_a_plain_dflash_backbone_and_starts_its_own_heads_fresh(target, released):
    from dflash_ray.drafter import warm_start

    folder, weights = released
    cfg = load_config(None, [*SETTINGS, f"train.init_from={folder}", "train.drafter=dspark"])
    dcfg = from_hf_config(drafter_config(target, cfg))
    drafter = initial_drafter(dcfg, target, "random", seed=0)
    fresh = warm_start.load_released(drafter, dcfg, folder)
    state = drafter.state_dict()
    assert fresh and all(k not in weights for k in fresh)
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    assert drafter_init(target, cfg) == warm_start.PREFIX + folder


HUB_CODE = """
import json, sys, torch
from dflash_ray.config import load_config
from dflash_ray.drafter.export import from_hf_config
from dflash_ray.drafter.init import initial_drafter
from dflash_ray.train.shape import drafter_config, drafter_init
target, hub_id = sys.argv[1:]
cfg = load_config(None, ["train.num_layers=1", "train.target_layer_ids=[0,1,2]", f"train.init_from={hub_id}"])
start = drafter_init(target, cfg)
drafter = initial_drafter(from_hf_config(drafter_config(target, cfg)), target, start, 0)
print(json.dumps({"start": start, "fc": drafter.fc.weight.flatten()[:8].tolist()}))
"""


@pytest.mark.integration
def test_a_released_drafter_is_taken_by_its_hub_id_from_the_hub_cache(target, released, tmp_path):
    """Offline, as each node reads it: the Hub cache's snapshot of ORG/NAME, at main or a revision."""
    import os
    import shutil
    import subprocess
    import sys

    folder, weights = released
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--some-org--released-drafter"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    shutil.copytree(folder, repo / "snapshots" / sha)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    for hub_id in ("some-org/released-drafter", f"some-org/released-drafter@{sha}"):
        done = subprocess.run(
            [sys.executable, "-c", HUB_CODE, target, hub_id], env=env, capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got["start"] == f"drafter:{hub_id}"
        assert torch.allclose(torch.tensor(got["fc"]), weights["fc.weight"].flatten()[:8])


def test_a_released_drafter_saved_in_shards_starts_the_run(target, released, tmp_path):
    """`model.safetensors.index.json` and the shards it lists, as large checkpoints are published."""
    from safetensors.torch import save_file

    from dflash_ray.drafter.init import initial_drafter

    folder, weights = released
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    (tmp_path / "config.json").write_text(open(f"{folder}/config.json").read())
    for file, part in halves.items():
        save_file({k: weights[k].contiguous() for k in part}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: f for f, part in halves.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = load_config(None, [*SETTINGS, f"train.init_from={tmp_path}"])
    drafter = initial_drafter(from_hf_config(drafter_config(target, cfg)), target, drafter_init(target, cfg), 0)
    assert all(torch.equal(drafter.state_dict()[k], weights[k]) for k in weights)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DFlashError, match="model-00002-of-00002.safetensors: field 'train.init_from': missing"):
        initial_drafter(from_hf_config(drafter_config(target, cfg)), target, drafter_init(target, cfg), 0)


@pytest.mark.parametrize(
    "family, extra", [("dflash", []), ("dflash2", []), ("dspark", ["train.family={markov_rank: 8}"])]
)
@pytest.mark.slow
def test_each_familys_export_starts_a_run_whose_first_loss_is_the_exports(target, family, extra, tmp_path):
    """Export, warm start: the first step's loss is the exported drafter's own on the same batch and
    anchors, not a fresh start's."""
    from dflash_ray.drafter import families
    from dflash_ray.target_model.capture import load_embed_and_head
    from dflash_ray.train.workers import DrafterWorker

    settings = [*SETTINGS, f"train.drafter={family}", *extra]
    cold = load_config(None, settings)
    exported = initial_drafter(from_hf_config(drafter_config(target, cold)), target, "random", seed=99)
    warm = load_config(None, [*settings, f"train.init_from={tmp_path}"])
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 500, (1, 48), generator=gen)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "features": torch.randn(1, 48, 3 * 64, generator=gen)}

    def first_loss(worker_cfg, mode):
        worker = DrafterWorker(target, json.dumps(drafter_config(target, worker_cfg)), mode, worker_cfg.train, 0, 1)
        with torch.no_grad():
            return float(worker._forward(batch, torch.Generator().manual_seed(0), False).loss.loss)

    embed, head = load_embed_and_head(target)

    def own_loss():  # the exported drafter's loss on the batch, at the anchors of generator seed 0
        return (
            families.get(family)
            .forward_loss(
                exported,
                embed,
                head,
                batch["features"],
                ids,
                batch["loss_mask"],
                num_anchors=cold.train.num_anchors,
                generator=torch.Generator().manual_seed(0),
            )
            .loss.loss
        )

    opt = torch.optim.AdamW(exported.parameters(), lr=2e-2)
    for _ in range(30):  # a drafter that has learned this batch's blocks: a loss no fresh start has
        opt.zero_grad()
        own_loss().backward()
        opt.step()
    save_drafter(exported, tmp_path, dtype=torch.float32)
    with torch.no_grad():
        own = float(own_loss())
    assert first_loss(warm, drafter_init(target, warm)) == pytest.approx(own, rel=1e-5)
    assert first_loss(cold, drafter_init(target, cold)) > own + 0.5

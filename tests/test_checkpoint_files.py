"""Sharded checkpoints (`train.checkpoint_files`): two gloo ranks of an FSDP2 drafter each write one shard file
(no file holds the whole optimizer state); the checkpoint loads on one process (resharded) with
the same weights and AdamW moments bit for bit, assembles offline for export, and a file that
differs from the manifest is refused."""

import datetime
import pytest
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port, spawn


def _drafter(seed: int = 0):
    from transformers import Qwen3Config

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.model import DFlashDrafter

    target = Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    torch.manual_seed(seed)
    return DFlashDrafter(from_target(target, mask_token_id=500, num_layers=2, target_layer_ids=[0, 1]))


def _stepped(drafter, opt) -> None:
    """Two AdamW steps on a fixed pseudo-gradient: the moments are no longer zero."""
    for k in range(2):
        for i, p in enumerate(drafter.parameters()):
            g = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + 1) + k).reshape(p.shape)
            p.grad = _like(g, p)
        opt.step()
        opt.zero_grad()


def _like(whole: torch.Tensor, p):
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
    return whole


def _whole(t):
    from dflash_ray.train.fsdp import full

    return full(t.detach()).clone()


def _write(rank: int, port: int, folder: str, results: dict) -> None:
    from dflash_ray.drafter.export import CONFIG, to_hf_config
    from dflash_ray.train import checkpoint_files
    from dflash_ray.train.fsdp import apply_fsdp

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    drafter = _drafter()
    apply_fsdp(drafter, "cpu", dist.group.WORLD, torch.float32)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    _stepped(drafter, opt)
    extra = (
        {f"drafter/{CONFIG}": __import__("json").dumps(to_hf_config(drafter.cfg, torch.float32)).encode()}
        if rank == 0
        else {}
    )
    upload = checkpoint_files.save(drafter, opt, folder, dist.new_group(backend="gloo"), extra)
    entries = upload.result()
    names = [n for n, p in drafter.named_parameters()]
    results[rank] = {
        "entries": entries,
        "weights": {n: _whole(p) for n, p in zip(names, drafter.parameters())},
        "moments": {n: {k: _whole(v) for k, v in opt.state[p].items()} for n, p in zip(names, drafter.parameters())},
    }
    dist.destroy_process_group()


def _checkpoint(tmp_path) -> tuple[str, dict]:
    """A checkpoint written by two ranks, its manifest committed; and what rank 0 held."""
    from dflash_ray.train import checkpoint

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    folder = checkpoint.step_dir(str(tmp_path / "run"), 4)
    results = mp.Manager().dict()
    spawn(_write, (free_port(), folder, results), 2)
    entries = {**results[0]["entries"], **results[1]["entries"]}
    checkpoint.commit(str(tmp_path / "run"), 4, entries)
    return folder, dict(results[0])


@pytest.mark.slow
def test_two_ranks_write_a_shard_each_and_one_process_loads_them_bit_for_bit(tmp_path):
    from dflash_ray.train import checkpoint, checkpoint_files

    folder, held = _checkpoint(tmp_path)
    names = sorted(checkpoint.read_folder_manifest(folder)["files"])
    assert names == ["drafter/config.json", "shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"]
    sizes = [os.path.getsize(os.path.join(folder, n)) for n in names if n.endswith(".distcp")]
    whole = sum(v.numel() * 4 for m in held["moments"].values() for k, v in m.items() if k != "step") + sum(
        w.numel() * 4 for w in held["weights"].values()
    )
    assert all(0.4 * whole < s < 0.6 * whole for s in sizes), (sizes, whole)  # about half the state each

    drafter = _drafter(seed=1)  # other weights: everything must come from the checkpoint
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    checkpoint_files.load(drafter, opt, folder, checkpoint.read_folder_manifest(folder), None)  # one process, no group
    for name, p in drafter.named_parameters():
        assert torch.equal(p.detach(), held["weights"][name]), name
        for k, v in opt.state[p].items():
            assert torch.equal(v, held["moments"][name][k]), (name, k)

    assembled, checked = checkpoint_files.assemble(folder)
    assert checked == 4
    for name, p in assembled.named_parameters():
        assert torch.equal(p.detach(), held["weights"][name]), name


@pytest.mark.slow
def test_a_shard_that_differs_from_the_manifest_is_refused_naming_it(tmp_path):
    import pytest

    from dflash_ray.train import checkpoint, checkpoint_files

    folder, _ = _checkpoint(tmp_path)
    path = os.path.join(folder, "shards", "__1_0.distcp")
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    open(path, "wb").write(bytes(data))
    drafter = _drafter()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    with pytest.raises(checkpoint.CorruptCheckpoint) as e:
        checkpoint_files.load(drafter, opt, folder, checkpoint.read_folder_manifest(folder), None)
    assert "__1_0.distcp" in str(e.value) and "sha256" in str(e.value)
    with pytest.raises(checkpoint.CorruptCheckpoint):
        checkpoint_files.assemble(folder)
    os.remove(os.path.join(folder, checkpoint.MANIFEST))  # a checkpoint without its manifest
    with pytest.raises(checkpoint.CorruptCheckpoint) as e:
        checkpoint_files.assemble(folder)
    assert "no manifest" in str(e.value)


def _one_process_checkpoint(tmp_path, config: dict | None = None) -> str:
    """A checkpoint written by one process (no group), its manifest committed; `config`: keys added
    to its serving config."""
    import json
    import warnings

    from dflash_ray.drafter.export import CONFIG, to_hf_config
    from dflash_ray.train import checkpoint, checkpoint_files

    drafter = _drafter()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    _stepped(drafter, opt)
    hf = {**to_hf_config(drafter.cfg, torch.float32), **(config or {})}
    folder = checkpoint.step_dir(str(tmp_path / "run"), 1)
    with warnings.catch_warnings():  # DCP's "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        entries = checkpoint_files.save(
            drafter, opt, folder, None, {f"drafter/{CONFIG}": json.dumps(hf).encode()}
        ).result()
    checkpoint.commit(str(tmp_path / "run"), 1, entries)
    return folder


def _replace(folder: str, name: str, data: bytes) -> None:
    """Replace one file of a checkpoint and vouch for it in the manifest (a checksum, not a signature)."""
    import hashlib
    import json

    from dflash_ray.train import checkpoint

    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    path = os.path.join(folder, checkpoint.MANIFEST)
    manifest = json.load(open(path))
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(path, "w") as f:
        json.dump(manifest, f)


class _RunsCode:
    """What a crafted pickle holds: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_pickle_that_would_run_code_is_refused_by_export_and_resume_naming_it(tmp_path):
    import pickle

    import pytest

    from dflash_ray.errors import DFlashError
    from dflash_ray.stages.export import run_export
    from dflash_ray.train import checkpoint, checkpoint_files

    folder = _one_process_checkpoint(tmp_path)
    marker = tmp_path / "ran"
    _replace(folder, "shards/.metadata", pickle.dumps(_RunsCode(marker)))
    with pytest.raises(DFlashError) as e:  # export
        run_export(folder, str(tmp_path / "out"))
    assert ".metadata" in str(e.value) and "system" in str(e.value) and "refused" in str(e.value)
    drafter = _drafter()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    with pytest.raises(checkpoint.CorruptCheckpoint) as e:  # what each drafter does on `train --resume`
        checkpoint_files.load(drafter, opt, folder, checkpoint.read_folder_manifest(folder), None)
    assert ".metadata" in str(e.value)
    assert not marker.exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_shard_value_that_would_run_code_is_refused_on_resume(tmp_path):
    """The optimizer's settings are pickled values inside a shard file: loaded as plain data only."""
    import io
    import pickle

    import pytest

    from dflash_ray.train import checkpoint, checkpoint_files

    folder = _one_process_checkpoint(tmp_path)
    marker = tmp_path / "ran"
    crafted = io.BytesIO()
    torch.save(_RunsCode(marker), crafted)
    shard = os.path.join(folder, "shards", "__0_0.distcp")
    data = open(shard, "rb").read()
    metadata = pickle.loads(open(os.path.join(folder, "shards", ".metadata"), "rb").read())  # our own: trusted here
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    info.offset, info.length = len(data), len(crafted.getvalue())
    _replace(folder, "shards/__0_0.distcp", data + crafted.getvalue())
    _replace(folder, "shards/.metadata", pickle.dumps(metadata))
    drafter = _drafter()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    with pytest.raises(checkpoint.CorruptCheckpoint) as e:
        checkpoint_files.load(drafter, opt, folder, checkpoint.read_folder_manifest(folder), None)
    assert "__0_0.distcp" in str(e.value) and "optim.param_groups.0.lr" in str(e.value)
    assert not marker.exists()


def test_an_exported_config_drops_keys_that_would_import_code(tmp_path):
    import json

    from dflash_ray.stages.export import run_export

    folder = _one_process_checkpoint(tmp_path, {"auto_map": {"AutoModel": "evil.Model"}, "trust_remote_code": True})
    run_export(folder, str(tmp_path / "out"), dtype="float32")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" not in exported and "trust_remote_code" not in exported
    assert exported["architectures"] == ["DFlashDraftModel"]


def test_metadata_naming_a_shard_file_outside_the_checkpoint_is_refused(tmp_path):
    import pickle

    import pytest

    from dflash_ray.train import checkpoint, checkpoint_files

    folder = _one_process_checkpoint(tmp_path)
    metadata = pickle.loads(open(os.path.join(folder, "shards", ".metadata"), "rb").read())  # our own: trusted here
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../../../etc/passwd"
    _replace(folder, "shards/.metadata", pickle.dumps(metadata))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"\.metadata: names '../../.*which climbs out"):
        checkpoint_files.assemble(folder)

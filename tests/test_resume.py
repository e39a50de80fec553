"""Resume on a real local Ray cluster when checkpoints do not verify: the drafters check what they
load themselves, a corrupt newest checkpoint gives way to the one before it, rotation keeps what a
resume needs, and a checkpoint of another target is refused."""

import re
import shutil

import pytest

from dflash_ray import storage
from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from dflash_ray.train import checkpoint
from dflash_ray.stages.train import run_train
from test_train import SETTINGS, _final_weights, data, target  # noqa: F401  (module fixtures: tiny target, 16 samples)


def _corrupt_same_size(output: str, step: int, name: str) -> None:
    uri = storage.join(checkpoint.step_dir(output, step), name)
    body = bytearray(storage.read_bytes(uri))
    body[len(body) // 2] ^= 0xFF  # only its checksum can tell
    storage.write_bytes(uri, bytes(body))


def test_resume_passes_over_a_corrupt_checkpoint_and_continues_exactly(ray_cluster, target, data, tmp_path):
    cfg = load_config(None, SETTINGS)
    out = str(tmp_path / "run")
    assert run_train(target, data, out, cfg, progress=False)["step"] == 8
    assert checkpoint.complete_steps(out) == [3, 6, 8]
    reference = _final_weights(out)
    storage.delete_tree(checkpoint.step_dir(out, 8))  # as if the run had stopped after step 6 ...
    _corrupt_same_size(out, 6, "optimizer.pt")  # ... whose optimizer state only its checksum shows corrupt

    resumed = run_train(target, data, out, load_config(None, SETTINGS + ["train.keep_checkpoints=1"]), progress=False)
    assert resumed["step"] == 8 and resumed["restarts"] == 0
    assert checkpoint.complete_steps(out) == [8]  # step 6 rewritten from 3 on, then rotated like 3
    assert _final_weights(out) == reference  # bitwise: resumed from 3, as if never interrupted

    other = shutil.copytree(target, tmp_path / "another-target")  # the same weights under another name
    with pytest.raises(DFlashError, match=re.escape(f"target (checkpoint: {target}, now: {other})")):
        run_train(str(other), data, out, cfg, progress=False)

    _corrupt_same_size(out, 8, "drafter/model.safetensors")
    with pytest.raises(DFlashError, match=r"no checkpoint verifies \(step 8: \S+model.safetensors: its sha256"):
        run_train(target, data, out, cfg, progress=False)
    assert checkpoint.complete_steps(out) == [8]  # refused, nothing overwritten

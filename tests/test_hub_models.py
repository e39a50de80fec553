"""Models by Hugging Face Hub id, offline: a Hub cache laid out on disk as `huggingface_hub` writes
it (refs, snapshots), `HF_HUB_OFFLINE=1`, nothing downloaded. Each check runs in a fresh process, as
a user's command does, since the Hub library reads its environment at import."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHA = "3f1c2a9b7d5e4f6a8b0c1d2e3f4a5b6c7d8e9f0a"
CODE = """
import json, sys
from dflash_ray.errors import DFlashError
from dflash_ray.registry import pin, resolve, revision_of
out = {}
for name in sys.argv[1:]:
    try:
        path = resolve(name)
        out[name] = {"path": path, "revision": revision_of(path), "pin": pin(name)}
    except DFlashError as e:
        out[name] = {"error": str(e)}
print(json.dumps(out))
"""


def _hub_cache(root: Path, model_dir: str) -> Path:
    """`root` as a Hugging Face cache holding tiny-org/tiny-qwen3 at SHA (main points there)."""
    repo = root / "models--tiny-org--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    shutil.copytree(model_dir, repo / "snapshots" / SHA)
    return root


def _resolve(tmp_path, cache: Path, *names: str, cwd: Path | None = None) -> dict:
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "DFLASH_RAY_CACHE": str(tmp_path / "dflash-cache"),
    }
    done = subprocess.run(
        [sys.executable, "-c", CODE, *names], env=env, capture_output=True, text=True, cwd=cwd or tmp_path, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_a_hub_id_resolves_offline_to_its_pinned_snapshot(tmp_path, tiny_qwen3_dir):
    cache = _hub_cache(tmp_path / "hub", tiny_qwen3_dir)
    got = _resolve(
        tmp_path,
        cache,
        "tiny-org/tiny-qwen3",
        f"hf://tiny-org/tiny-qwen3@{SHA}",
        "tiny-org/tiny-qwen3@main",
        "tiny-org/not-cached",
    )
    snapshot = str(cache / "models--tiny-org--tiny-qwen3" / "snapshots" / SHA)
    for name in ("tiny-org/tiny-qwen3", f"hf://tiny-org/tiny-qwen3@{SHA}", "tiny-org/tiny-qwen3@main"):
        assert got[name]["path"] == snapshot, got[name]
        assert got[name]["revision"] == SHA and got[name]["pin"] == f"tiny-org/tiny-qwen3@{SHA}", got[name]
    error = got["tiny-org/not-cached"]["error"]
    assert "tiny-org/not-cached" in error and "HF_HUB_OFFLINE" in error, error

    from transformers import AutoModelForCausalLM  # what the workers load is the real model

    model = AutoModelForCausalLM.from_pretrained(snapshot)
    assert (
        model.config.num_hidden_layers
        == json.loads((Path(tiny_qwen3_dir) / "config.json").read_text())["num_hidden_layers"]
    )


@pytest.mark.integration
def test_a_local_folder_shaped_like_a_hub_id_wins(tmp_path, tiny_qwen3_dir):
    cache = _hub_cache(tmp_path / "hub", tiny_qwen3_dir)
    work = tmp_path / "work"
    shutil.copytree(tiny_qwen3_dir, work / "tiny-org" / "tiny-qwen3")
    got = _resolve(tmp_path, cache, "tiny-org/tiny-qwen3", cwd=work)["tiny-org/tiny-qwen3"]
    assert got["path"] == "tiny-org/tiny-qwen3" and got["revision"] is None, got
    assert got["pin"] == "tiny-org/tiny-qwen3", got

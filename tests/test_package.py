import json
import subprocess
import sys

import pytest

import torch


def _loaded(code):
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


# modules whose import is Ray itself: their classes are `@ray.remote` actors
RAY_SHELLS = {"dflash_ray.generation.actors"}


@pytest.mark.integration
def test_no_core_module_loads_ray_vllm_or_boto3_on_import():
    """Every module of the package (transforms, model code, kernels, workers, stage drivers),
    imported all together, loads no Ray, vLLM or boto3: they come in where a function needs them."""
    import pkgutil

    import dflash_ray
    import dflash_ray.kernels  # its own folder in the source tree (pyproject's package-dir)

    found = {m.name for m in pkgutil.walk_packages(dflash_ray.__path__, "dflash_ray.")}
    found |= {m.name for m in pkgutil.walk_packages(dflash_ray.kernels.__path__, "dflash_ray.kernels.")}
    modules = sorted(found - RAY_SHELLS)
    assert {
        "dflash_ray.drafter.model",
        "dflash_ray.target_model.capture",
        "dflash_ray.train.workers",
        "dflash_ray.kernels.fused_ce",
        "dflash_ray.stages.generate",
    } <= set(modules), modules
    mods = _loaded("import " + ", ".join(modules))
    assert not {"ray", "vllm", "boto3", "botocore"} & mods


@pytest.mark.integration
def test_cli_import_is_light():
    mods = _loaded("import dflash_ray.cli")
    assert not {"torch", "transformers", "ray"} & mods


@pytest.mark.integration
def test_kernels_live_in_the_package_namespace():
    mods = _loaded("import dflash_ray.kernels")
    assert "dflash_ray.kernels" in mods and "kernels" not in mods


def test_tiny_targets_run(tiny_qwen3_dir, tiny_qwen35_dir):
    from transformers import AutoModelForCausalLM

    for path, vocab in ((tiny_qwen3_dir, 151936), (tiny_qwen35_dir, 248320)):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            out = model(torch.randint(0, 1000, (2, 9)), output_hidden_states=True)
        assert out.logits.shape == (2, 9, vocab)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1


def test_every_subpackage_ships_in_the_wheel():
    """A folder of the package missing from pyproject's `packages` works from a checkout and is
    absent from an installed wheel (a cluster image's)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "dflash_ray").rglob("__init__.py")}
    assert found - listed == set()

import json
import subprocess
import sys

import torch


def _loaded(code):
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_data_transforms_import_no_ray_vllm_or_boto3():
    mods = _loaded("import dflash_ray.data.formats, dflash_ray.data.masking, dflash_ray.data.prompts, "
                   "dflash_ray.data.validate, dflash_ray.kernels")
    assert not {"ray", "vllm", "boto3"} & mods


def test_cli_import_is_light():
    mods = _loaded("import dflash_ray.cli")
    assert not {"torch", "transformers", "ray"} & mods


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

"""The device, dtype, backend and attention of a training role: a pure function of what it holds."""

import pytest
import torch

from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from dflash_ray.train.devices import placement


def test_a_cpu_actor_stays_on_the_cpu_even_on_a_gpu_node():
    for visible in (0, 8):
        p = placement(0, visible)
        assert (p.device, p.num_devices, p.dtype, p.backend, p.attention) == ("cpu", 1, torch.float32, "gloo", "sdpa")


def test_a_one_gpu_actor_trains_on_its_gpu_in_bf16_with_nccl_and_flex():
    p = placement(1, 1)
    assert (p.device, p.num_devices, p.dtype, p.backend, p.attention) == ("cuda:0", 1, torch.bfloat16, "nccl", "flex")
    assert p.is_cuda


def test_a_fractional_gpu_share_is_still_that_gpu():
    assert placement(0.5, 1).device == "cuda:0"


def test_a_several_gpu_actor_spreads_over_the_gpus_it_holds():
    p = placement(2, 2)
    assert (p.device, p.num_devices, p.backend) == ("cuda:0", 2, "nccl")
    assert placement(4, 2).num_devices == 2  # never more than CUDA shows it


def test_explicit_settings_win_over_auto():
    assert placement(1, 1, dtype="float32", attention="sdpa").dtype == torch.float32
    assert placement(1, 1, attention="sdpa").attention == "sdpa"
    assert placement(0, 0, dtype="bfloat16").dtype == torch.bfloat16


def test_impossible_placements_are_refused():
    with pytest.raises(ValueError, match="CUDA sees none"):
        placement(1, 0)
    with pytest.raises(ValueError, match="backward does not run on the CPU"):
        placement(0, 0, attention="flex")


def test_flex_training_on_cpu_actors_fails_on_the_driver_naming_the_field(tmp_path):
    from dflash_ray.tiny_models import tiny_qwen3
    from dflash_ray.train.shape import drafter_config

    target = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512)
    cfg = load_config(None, ["train.attention=flex", "train.target_layer_ids=[0,1,2]"])
    with pytest.raises(DFlashError) as e:
        drafter_config(target, cfg)
    assert e.value.field == "train.attention"
    # on GPU actors the same setting is fine, and the exported config says bf16
    gpu = load_config(None, ["train.attention=flex", "train.actor_gpus=1", "train.target_layer_ids=[0,1,2]"])
    assert drafter_config(target, gpu)["torch_dtype"] == "bfloat16"

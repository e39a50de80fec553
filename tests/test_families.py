"""Every drafter family, found by its module: names, architectures, settings and their round trip
through the config.json training passes around."""

import dataclasses

import torch
from transformers import AutoConfig

from dflash_ray.drafter import families
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.export import from_hf_config, to_hf_config


def test_every_family_is_its_module_and_its_settings_survive_the_config_json():
    names = families.names()
    assert {"dflash", "dspark", "dflash2"} <= set(names)
    assert len({families.get(n).architecture for n in names}) == len(names)
    target = AutoConfig.for_model(
        "qwen3",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    for name in names:
        family = families.get(name)
        assert family.name == name and family.__module__ == f"dflash_ray.drafter.{name}"
        assert issubclass(family.Settings, families.Settings)
        assert families.of_architecture([family.architecture]) is family
        # every setting away from its default, as a run would set it
        changed = {
            f.name: (not f.default if isinstance(f.default, bool) else f.default * 2)
            for f in dataclasses.fields(family.Settings)
        }
        cfg = from_target(target, mask_token_id=95, num_target_features=2, family=name, settings=changed)
        assert dataclasses.asdict(cfg.settings) == changed
        back = from_hf_config(to_hf_config(cfg, torch.float32))
        assert back.family == name and back.settings == cfg.settings, name

"""The settings, split by owner, read as they did: every preset resolves to the values it resolved to
before the split (tests/data/presets_resolved.json), every documented key still takes a `--set`,
and the settings' docs are the ones the dataclasses write."""

import dataclasses
import glob
import json
import os
from pathlib import Path

import pytest
import yaml

from dflash_ray.config import expand_drafters, load_config
from dflash_ray.settings import docs

ROOT = Path(__file__).resolve().parent.parent
RESOLVED = json.loads((ROOT / "tests" / "data" / "presets_resolved.json").read_text())
PRESETS = sorted(glob.glob(str(ROOT / "configs" / "*.yaml"))) + [None]


def _resolved(path):
    cfg = load_config(path)
    drafters = {name: run.to_dict()["train"] for name, run in expand_drafters(cfg)} if cfg.train.drafters else {}
    return json.loads(json.dumps({"config": cfg.to_dict(), "drafters": drafters}, sort_keys=True, default=str))


def _as_before(now, before, where=""):
    """The keys of `before` whose value `now` holds otherwise (a setting added since has no value before)."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [d for k in before for d in _as_before(now.get(k, "(gone)"), before[k], f"{where}.{k}")]
    return [] if now == before else [f"{where}: {before!r} -> {now!r}"]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: os.path.basename(p) if p else "defaults")
def test_every_preset_resolves_to_the_values_it_had(path):
    assert _as_before(_resolved(path), RESOLVED[os.path.basename(path) if path else "(defaults)"]) == []


def test_the_comparison_sees_a_changed_or_lost_value():
    before = {"train": {"lr": 0.001, "num_layers": 1}}
    assert _as_before({"train": {"lr": 0.002, "init_from": ""}}, before) == [
        ".train.lr: 0.001 -> 0.002",
        ".train.num_layers: 1 -> '(gone)'",
    ]


def _keys(cfg, prefix=""):
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def test_every_flat_key_takes_a_set_of_its_own_value():
    """`--set train.lr=...` and every other key of the reference: set to its default, the config is the default one."""
    default = load_config()
    keys = dict(_keys(default))
    assert {
        "train.lr",
        "train.num_streams",
        "train.deadline_factor",
        "train.clocks.scale",
        "validate.gate.max_mode_share",
    } <= set(keys)
    documented = {line.split("`")[1] for line in docs.reference().splitlines() if line.startswith("| `")}
    assert set(keys) <= documented
    for key, value in keys.items():
        assert (
            load_config(
                None, [f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"]
            )
            == default
        ), key
    assert load_config(None, ["train.lr=3e-3"]).train.lr == 3e-3


def test_the_settings_docs_are_the_ones_the_dataclasses_write():
    assert (ROOT / "docs" / "settings.md").read_text() == docs.reference(), "run: python -m dflash_ray.settings.docs"
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert docs.configuration(text) == text, "run: python -m dflash_ray.settings.docs"

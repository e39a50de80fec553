"""A training run is resolved once on the driver (`preflight.resolve_run`) and then only executed:
the placement planned once, each drafter's shape decided once, the coordinator working from what was
resolved, and the summary's `resolved` section saying what ran. No Ray: the stage is stopped where it
would start the coordinator, and the coordinator is built and planned in this process."""

import pytest

from dflash_ray import storage
from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from test_train import SETTINGS, data, target  # noqa: F401  (the tiny training run's fixtures)

TWO = (
    "train.drafters=[{name: flash}, {name: spark, drafter: dspark, family: {markov_rank: 16}, block_size: 6, "
    "target_layer_ids: [1, 3]}]"
)


def _resolved(target, data, out, cfg, monkeypatch):  # noqa: F811
    """The `ResolvedRun` the stage hands on, and every `planned_placement` and drafter-shape call made."""
    from dflash_ray.stages import train as stage
    from dflash_ray.stages.train import run_train
    from dflash_ray.train import devices, shape

    calls: dict[str, list] = {"placement": [], "shape": []}
    placement, drafter_config_of = devices.planned_placement, shape.drafter_config_of
    monkeypatch.setattr(devices, "planned_placement", lambda c: calls["placement"].append(c) or placement(c))
    monkeypatch.setattr(
        shape, "drafter_config_of", lambda *a, **k: calls["shape"].append(a) or drafter_config_of(*a, **k)
    )
    handed = {}

    def coordinator(run, *args):  # in place of starting the coordinator: what it would receive
        handed["run"] = run
        return {}

    monkeypatch.setattr(stage, "_train", coordinator)
    run_train(target, data, out, cfg, progress=False)
    return handed["run"], calls


def test_a_run_is_resolved_once_and_the_coordinator_derives_nothing_again(target, data, tmp_path, monkeypatch):  # noqa: F811
    from dflash_ray.train.coordinator import Coordinator

    out = str(tmp_path / "out")
    cfg = load_config(None, SETTINGS + [TWO, "train.eval_every=2", "train.heldout=4"])
    run, calls = _resolved(target, data, out, cfg, monkeypatch)
    assert len(calls["placement"]) == 1 and len(calls["shape"]) == 2  # once for the run; once per drafter
    coordinator = Coordinator(run, data, out, "resolved-test")
    coordinator._plan()  # the samples, the schedule, the shapes to warm: from the resolved placement
    assert len(calls["placement"]) == 1 and len(calls["shape"]) == 2
    assert coordinator.target == run.target and coordinator.cfg is cfg
    assert [(t.name, t.output, t.init) for t in coordinator.teams] == [
        ("flash", storage.join(out, "flash"), "target"),
        ("spark", storage.join(out, "spark"), "target"),
    ]
    assert coordinator.layer_ids == [0, 1, 2, 3]  # the union of the drafters' layers, captured once


def test_the_resolved_section_says_what_runs(target, data, tmp_path, monkeypatch):  # noqa: F811
    cfg = load_config(None, SETTINGS + [TWO])
    run, _ = _resolved(target, data, str(tmp_path / "out"), cfg, monkeypatch)
    section = run.section()
    assert section["target"] == target
    assert section["placement"] == {"device": "cpu", "attention": "sdpa", "dtype": "float32", "backend": "gloo"}
    assert [
        {k: d[k] for k in ("name", "family", "layers", "block_size", "target_layer_ids", "start")}
        for d in section["drafters"]
    ] == [
        {
            "name": "flash",
            "family": "dflash",
            "layers": 1,
            "block_size": 16,
            "target_layer_ids": [0, 1, 2],
            "start": "target",
        },
        {
            "name": "spark",
            "family": "dspark",
            "layers": 1,
            "block_size": 6,
            "target_layer_ids": [1, 3],
            "start": "target",
        },
    ]
    assert "memory_gb" not in section  # CPU actors: no GPU memory to fit
    one, _ = _resolved(target, data, str(tmp_path / "one"), load_config(None, SETTINGS), monkeypatch)
    assert "name" not in one.section()["drafters"][0]  # a run's one drafter has no name


def test_a_drafters_refusal_still_names_it(target, data, tmp_path, monkeypatch):  # noqa: F811
    bad = TWO.replace("[1, 3]", "[1, 9]")  # the target has 4 layers
    with pytest.raises(DFlashError) as e:
        _resolved(target, data, str(tmp_path / "out"), load_config(None, SETTINGS + [bad]), monkeypatch)
    assert str(e.value).startswith("drafter 'spark': "), str(e.value)

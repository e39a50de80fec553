"""The cluster launcher config, the KubeRay RayJob and the image: Ray's own schema, structure,
references, versions and the one source of pins, checked without a cloud account (a typo here is
only found at `ray up` time otherwise)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _image() -> str:
    """The tag every node runs: the Dockerfile's image at the project's version."""
    return f"REGISTRY/dflash-ray:{_project()['project']['version']}"


def test_cluster_yaml_passes_rays_own_schema():
    """What `ray up` runs first: the defaults filled in, then the autoscaler's JSON schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(cfg)))
    broken = copy.deepcopy(cfg)
    broken["available_node_types"]["gen_h200"]["min_workers"] = "1"  # the check can fail
    with pytest.raises(Exception, match="is not of type 'integer'"):
        validate_config(prepare_config(broken))


def test_cluster_yaml_is_a_launchable_aws_config():
    cfg = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert cfg["provider"]["type"] == "aws" and isinstance(cfg["provider"]["region"], str)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] == 0  # no work on the head
    workers = {name: t for name, t in types.items() if name != cfg["head_node_type"]}
    assert {"gen_b200", "gen_h200", "train_h200"} <= set(workers)
    for name, t in workers.items():
        assert isinstance(t["min_workers"], int) and 0 <= t["min_workers"] <= t["max_workers"], name
        assert t["node_config"]["InstanceType"], name
        assert t["resources"]["GPU"] in (4, 8), name
    assert cfg["max_workers"] >= max(t["max_workers"] for t in workers.values())
    for t in types.values():  # S3 through an instance profile on every node, never keys
        assert t["node_config"]["IamInstanceProfile"]["Name"]
    text = (ROOT / "cluster.yaml").read_text().lower()
    assert "aws_access_key_id" not in text and "aws_secret_access_key" not in text

    assert cfg["docker"]["image"] == _image()
    assert not cfg.get("setup_commands")  # the image carries every dependency
    node_types = {name: t["resources"] for name, t in types.items()}
    assert node_types["head"].get("head_node") and node_types["train_h200"].get("train_node")
    assert node_types["gen_b200"].get("gen_node") and node_types["gen_h200"].get("gen_node")
    for commands in (cfg["head_start_ray_commands"], cfg["worker_start_ray_commands"]):
        start = [c for c in commands if "ray start" in c]
        assert start and all("RAY_AUTH_MODE=token" in c for c in start)
    assert "--dashboard-host=127.0.0.1" in " ".join(cfg["head_start_ray_commands"])
    assert "~/.ray/auth_token" in cfg["file_mounts"]


def test_rayjob_manifest_references_real_entrypoints_and_matching_versions():
    job = yaml.safe_load((ROOT / "k8s" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    script = spec["entrypoint"].split()[1]
    assert script.startswith("/home/ray/dflash-ray/"), script  # where the Dockerfile puts the project
    assert (ROOT / script.removeprefix("/home/ray/dflash-ray/")).is_file(), script
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    # token auth on every node from a secret; the dashboard behind a ClusterIP service only
    assert cluster["authOptions"]["mode"] == "token" and cluster["authOptions"]["secretName"]
    assert cluster["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    node_types = [cluster["headGroupSpec"]["rayStartParams"]["resources"]] + [
        g["rayStartParams"]["resources"] for g in cluster["workerGroupSpecs"]
    ]
    assert all(any(t in r for t in ("head_node", "gen_node", "train_node")) for r in node_types), node_types
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert pod["spec"]["serviceAccountName"]  # S3 through the service account's role
        for c in pod["spec"]["containers"]:
            assert c["image"] == _image()
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert {"gen-h200", "train-h200"} <= set(groups)
    for g in groups.values():
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) in (4, 8)


@pytest.mark.integration
def test_one_job_entrypoint_runs_every_command_from_any_working_directory(tmp_path):
    """`ray job submit ... -- python jobs/run.py STAGE ARGS`: the script's folder heads `sys.path`
    under a job, so it must import the package from the tree it sits in, whatever the directory."""
    assert sorted(p.name for p in (ROOT / "jobs").glob("*.py")) == ["run.py"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "run.py"), "plan", "--json"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["stage"] == "plan"
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / "run.py"), "nosuch"], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice: 'nosuch'" in done.stderr


def test_the_cli_and_the_pipeline_are_derived_from_the_stages_their_modules_declare():
    """Every command is a `Stage` of a module in `stages/`; the pipeline's order follows from the
    folders each stage reads and writes, and each folder a stage reads has a stage writing it."""
    from dflash_ray import stages
    from dflash_ray.cli import _parser
    from dflash_ray.config import RunConfig

    declared = [s.name for s in stages.stages()]
    assert list(_parser()._subparsers._group_actions[0].choices) == declared
    assert len(set(declared)) == len(declared)
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    assert all(s.section is None or s.section in sections for s in stages.stages())
    order = [s.name for s in stages.pipeline_stages()]
    core = ["selfprompt", "prompts", "generate", "tokenize", "validate", "train", "export", "evaluate"]
    assert [name for name in order if name in core] == core  # a new stage may sit anywhere its folders allow
    written = {folder for s in stages.pipeline_stages() for folder in s.outputs}
    assert all(set(s.inputs) <= written for s in stages.pipeline_stages())
    # a stage that reads what a later one writes would run first with no input: the order says no
    for i, stage in enumerate(stages.pipeline_stages()):
        later = {f for s in stages.pipeline_stages()[i + 1 :] for f in s.outputs}
        assert not set(stage.inputs) & later, stage.name


def test_the_dockerfile_installs_exactly_the_gpu_extra_on_rays_image():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(ray.__version__)}-py311-cu\d+$", text, re.M)
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert any('".[gpu,track]"' in line for line in installs), installs
    assert any("--no-deps $(python tools/pins.py no-deps)" in line for line in installs), installs
    assert not any(re.search(r"[\w-]==\d", line) for line in installs), installs  # no pin of its own
    copied = re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M)
    for sources in copied:
        for source in sources.split():
            assert (ROOT / source.rstrip("/")).exists(), source


def test_no_package_pin_outside_pyproject():
    """Pins live in pyproject.toml alone; the Makefile and the Dockerfile read them from there."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    pin = re.compile(r"\b[A-Za-z][\w.-]*(\[[\w,]+\])?==\d+(\.\d+)+")
    found = []
    for name in tracked.split():
        path = ROOT / name
        if name == "pyproject.toml" or not path.is_file() or path.suffix in (".parquet", ".png", ".gguf"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}: {m.group(0)}" for m in pin.finditer(text)]
    assert not found, found
    extras = _project()["project"]["optional-dependencies"]
    gpu = {re.split("==", x)[0] for x in extras["gpu"]}
    assert {"torch", "vllm"} <= gpu  # the image's torch is the one vLLM's CUDA build wants


@pytest.mark.integration
def test_pins_reads_the_pins_the_makefile_installs():
    done = subprocess.run(
        [sys.executable, "tools/pins.py", "extra", "cpu", "torch"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == next(
        x for x in _project()["project"]["optional-dependencies"]["cpu"] if x.startswith("torch==")
    )
    done = subprocess.run(
        [sys.executable, "tools/pins.py", "no-deps"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == _project()["tool"]["dflash-ray"]["no-deps"]


def test_every_cli_stage_has_its_driver_in_stages_and_none_lives_elsewhere():
    """The layout: one driver per command in `dflash_ray/stages/` (the generation's controls in
    `generate.py`, `responses` in `prompts.py`); no `run_*` driver anywhere else in the package."""
    import re

    from dflash_ray.cli import _parser

    commands = set(_parser()._subparsers._group_actions[0].choices)
    home = {
        "scale": "generate",
        "pause": "generate",
        "resume": "generate",
        "status": "generate",
        "responses": "prompts",
    }
    stages = {p.stem for p in (ROOT / "dflash_ray" / "stages").glob("*.py") if p.stem != "__init__"}
    assert {home.get(c, c) for c in commands} <= stages, {home.get(c, c) for c in commands} - stages
    outside = [
        f"{p.relative_to(ROOT)}: {m}"
        for p in (ROOT / "dflash_ray").rglob("*.py")
        if "stages" not in p.parts
        for m in re.findall(r"^def (run_\w+)\(", p.read_text(), re.M)
    ]
    assert not outside, outside

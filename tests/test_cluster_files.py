"""The cluster launcher config and the KubeRay RayJob: structure, references and versions checked
without a cloud account (a typo here is only found at `ray up` time otherwise)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import ray
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _gpu_extra() -> dict[str, str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return dict(re.match(r"([\w-]+)==([\w.]+)", x).groups() for x in extras["gpu"] if "==" in x)


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

    image = cfg["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray.__version__}-") and "ray-ml" not in image
    pins = dict(re.findall(r'"([\w-]+)==([\w.]+)"', " ".join(cfg["setup_commands"])))
    assert pins["vllm"] == _gpu_extra()["vllm"]
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
    assert (ROOT / script).is_file(), script
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["working_dir"] and runtime_env["env_vars"]["RAY_AUTH_MODE"] == "token"
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == ray.__version__
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert pod["spec"]["serviceAccountName"]  # S3 through the service account's role
        for c in pod["spec"]["containers"]:
            assert c["image"].startswith(f"rayproject/ray:{ray.__version__}-")
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert {"gen-h200", "train-h200"} <= set(groups)
    for g in groups.values():
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) in (4, 8)


def test_every_job_entrypoint_runs_a_cli_subcommand_of_its_name():
    from dflash_ray.cli import _parser

    commands = set(_parser()._subparsers._group_actions[0].choices)
    jobs = {p.stem for p in (ROOT / "jobs").glob("*.py") if not p.stem.startswith("_")}
    assert {"prompts", "generate", "tokenize", "validate", "train", "export", "evaluate", "pipeline",
            "scale", "status"} <= jobs
    for name in jobs:
        assert f'run("{name}")' in (ROOT / "jobs" / f"{name}.py").read_text() and name in commands, name

"""Generators that scale themselves, on Ray's fake autoscaling cluster: a head started with an
autoscaling config whose node provider starts real raylets on this machine. The head has no CPU for
generators; generation nodes (one CPU each, a `gen_node` resource) are added by the autoscaler
while the backlog is large and released once it drains, and every prompt comes out exactly once.

The generation runs in a driver process of its own (this test process holds the session's other
local cluster) that also records how many nodes were alive as it ran."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import free_port, stop_nodes, wait_for_nodes
from dflash_ray import manifest, storage
from dflash_ray.registry import SMOLLM2

BIN = Path(sys.executable).parent

DRIVER = """
import json, sys, threading, time
import ray
from dflash_ray.config import load_config
from dflash_ray.stages.generate import run_generate

prompts, output, model = sys.argv[1:4]
cfg = load_config(None, sys.argv[4:])
ray.init(address="auto", log_to_driver=False)
seen = []  # (seconds, generation nodes alive)
done = threading.Event()

def count():
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("gen_node"))

def watch():
    start = time.time()
    while not done.is_set():
        seen.append((round(time.time() - start, 1), count()))
        time.sleep(0.5)

threading.Thread(target=watch, daemon=True).start()
summary = run_generate(prompts, output, model, cfg, progress=False)
done.set()
deadline = time.time() + 120  # idle nodes go after the config's idle timeout
while count() and time.time() < deadline:
    time.sleep(1)
print("RESULT " + json.dumps({"summary": summary, "seen": seen, "left": count()}))
"""


@pytest.fixture
def autoscaling_head(tmp_path):
    """A head (no CPUs) whose autoscaler may start up to two generation nodes of one CPU each, and
    lets an idle one go after 3 s. Yields the environment a driver joins it with."""
    port = free_port()
    config = {
        "cluster_name": "autoscale-test",
        "max_workers": 2,
        "upscaling_speed": 2.0,
        "idle_timeout_minutes": 0.05,
        "head_node_type": "ray.head.default",
        # node ids stand for addresses (every node has this machine's); no setup commands to run
        "provider": {
            "type": "fake_multinode",
            "gcs_address": f"127.0.0.1:{port}",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "gen": {"resources": {"CPU": 1, "gen_node": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2},
        },
        **{
            k: []
            for k in (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
            )
        },
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }
    (tmp_path / "autoscaler.json").write_text(json.dumps(config))
    temp = tempfile.mkdtemp(prefix="rayas-", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ADDRESS": f"127.0.0.1:{port}",
        "RAY_AUTH_MODE": "disabled",
    }
    # the fake provider's autoscaler (v1) knows the head by this node id
    head_env = {
        **env,
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_enable_autoscaler_v2": "0",
        "RAY_OVERRIDE_NODE_ID_FOR_TESTING": "f" * 51 + "00000",
    }
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=0",
            f"--autoscaling-config={tmp_path / 'autoscaler.json'}",
            f"--temp-dir={temp}",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            *(
                f"--{name}-port={free_port()}"
                for name in (
                    "dashboard-agent-listen",
                    "dashboard-agent-grpc",
                    "runtime-env-agent",
                    "node-manager",
                    "object-manager",
                )
            ),
        ],
        env=head_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_for_nodes(f"127.0.0.1:{port}", env, 1, [head], timeout_s=120), "the head exited as it came up"
        yield env
    finally:
        stop_nodes([head])  # the fake nodes are in its process group (its monitor started them)
        shutil.rmtree(temp, ignore_errors=True)


def test_the_autoscaler_adds_generation_nodes_for_the_backlog_and_releases_them(autoscaling_head, tmp_path):
    from dflash_ray.config import load_config
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.demo import bundled_inputs

    prompts = str(tmp_path / "prompts")
    run_prompts(
        bundled_inputs(small=True)[:1], prompts, load_config(None, [f"prompts.tokenizer={SMOLLM2}"]), progress=False
    )
    output = str(tmp_path / "completions")
    overrides = [
        "generate.name=autoscale-test",
        "generate.backend=transformers",
        "generate.shard_size=1",
        "generate.max_tokens=24",
        "generate.truncated=keep",
        "generate.node_resource=gen_node",
        "generate.autoscale.enabled=true",
        "generate.autoscale.min_generators=1",
        "generate.autoscale.max_generators=2",
        "generate.autoscale.drain_within_s=1",
        "generate.autoscale.interval_s=1",
    ]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, prompts, output, SMOLLM2, *overrides],
        env=autoscaling_head,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(line[len("RESULT ") :])
    summary, seen = result["summary"], result["seen"]

    assert seen[0][1] == 0  # no generation node before the run asked for one
    assert max(n for _, n in seen) == 2, json.dumps(
        [seen, summary]
    )  # the autoscaler added a second node for the backlog
    assert summary["generators_peak"] == 2 and summary["autoscaled"], summary
    assert result["left"] == 0, seen  # both released once the queue drained
    rows = [r["id"] for r in manifest.read_rows(output, ["id"], 10**6)]
    rejected = [json.loads(x)["id"] for x in storage.read_text(storage.join(output, "rejected.jsonl")).splitlines()]
    expected = [r["id"] for r in manifest.read_rows(prompts, ["id"], 10**6)]
    assert sorted(rows + rejected) == sorted(expected)  # every prompt exactly once

"""Fault drills: the whole pipeline with generator, tokenize, target and drafter actors killed at
seeded moments and a worker node lost finishes as an undisturbed run does: every prompt generated
once, every training step taken once, the same drafter bit for bit. The runs that need several
nodes share one cluster of three (starting one costs a busy 2-core machine most of a minute): two
streams training across its nodes first, then a lost node that costs a stream and comes back, then
the drill, which kills actors and a node in one pipeline."""

import json
import subprocess
import threading
import time
import sys

import pytest

from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from test_train import SETTINGS, data, target  # noqa: F401  (the tiny training run's fixtures)

pytestmark = pytest.mark.integration


def _settings(work, inputs):
    model, prompts = inputs
    return [
        f"pipeline.inputs=[{prompts}]",
        f"pipeline.workdir={work}",
        f"pipeline.target={model}",
        "pipeline.eval_prompts=2",
        "pipeline.vllm_evaluate=false",
        "generate.backend=transformers",
        "generate.generators=2",
        "generate.generator_cpus=0.5",
        "generate.max_tokens=24",
        "generate.truncated=keep",
        "generate.temperature=0",
        "generate.shard_size=2",
        "generate.repeat_min_span=10000",
        "validate.gate.min_median_response=8",
        "validate.gate.max_mode_share=1.0",
        "validate.gate.max_empty_thinking_share=1.0",
        "train.num_streams=2",
        # the drafter sharded over both ranks wherever they land: `auto` replicates across nodes
        # (hsdp), whose reductions round otherwise than the calm run's one node
        "train.layout=fsdp",
        "train.epochs=4",
        "train.checkpoint_every=4",
        "train.num_anchors=4",
        "train.heldout=0",
        "train.actor_cpus=0.25",
        "train.collective_timeout_s=60",
        "train.max_restarts=4",
        "evaluate.max_new_tokens=4",
        "tokenize.concurrency=2",
    ]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, qwen3_tokenizer):
    """A tiny random target with a real tokenizer (its vocabulary), and 18 prompts."""
    from dflash_ray.tiny_models import tiny_qwen3

    folder = tmp_path_factory.mktemp("chaos-inputs")
    model = folder / "target"
    tiny_qwen3(model, num_layers=4, vocab_size=len(qwen3_tokenizer))
    qwen3_tokenizer.save_pretrained(model)
    prompts = folder / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Count from {i} to {i + 9}."}]}) + "\n"
            for i in range(18)
        )
    )
    return model, prompts


@pytest.fixture(scope="module")
def calm(ray_cluster, inputs, tmp_path_factory):
    """The undisturbed run: (its summary, its work folder)."""
    from dflash_ray.stages.pipeline import run_pipeline

    work = tmp_path_factory.mktemp("calm")
    # colocated streams: the weights of paired ones, bit for bit (test_train.py), in two actors, not four
    settings = _settings(work, inputs) + ["train.colocate=true"]
    return run_pipeline(load_config(None, settings), progress=False), work


@pytest.fixture(scope="module")
def three_nodes():
    """A head on 127.0.0.1 (resource `head_node`, no CPUs), two worker nodes, 127.0.0.2 and
    127.0.0.3 (`train_node`, room for one stream each), and a spare one, 127.0.0.4 (no
    `train_node`), for the drill that runs after the elastic one took a node down: (address,
    environment for a driver)."""
    from conftest import local_nodes

    nodes = [("127.0.0.2", 2, {"train_node": 4}), ("127.0.0.3", 2, {"train_node": 4}), ("127.0.0.4", 2, {})]
    with local_nodes(nodes) as cluster:
        yield cluster


def _cli(args: list[str], settings: list[str], env: dict, timeout: int) -> dict:
    """Run `dflash-ray ARGS --json --set S ...` as a user would (its own driver, the cluster's
    environment) and return its summary; a failure shows the end of its stderr."""
    command = [sys.executable, "-m", "dflash_ray.cli", *args, "--json", *[x for s in settings for x in ("--set", s)]]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rows(folder, columns):
    return sorted(manifest.read_rows(str(folder), columns, 10**6), key=lambda r: r["id"])


def _same_as_calm(summary, work, calm):
    """Every prompt generated once, every step taken once, and what the undisturbed run made."""
    from conftest import checkpoint_weights

    calm_summary, calm_work = calm
    for stage, columns in (
        ("completions", ["id", "output_token_ids"]),
        ("tokenized", ["id", "input_ids", "loss_mask"]),
    ):
        rows = _rows(work / stage, columns)
        assert len({r["id"] for r in rows}) == len(rows) == 16
        assert rows == _rows(calm_work / stage, columns), stage
    metrics = [json.loads(x) for x in storage.read_text(str(work / "train" / "metrics.jsonl")).splitlines()]
    assert summary["training_steps"] == calm_summary["training_steps"] == 32
    assert [r["step"] for r in metrics] == list(range(1, 33))
    weights = [checkpoint_weights(str(w / "train")) for w in (calm_work, work)]
    assert weights[0] == weights[1]
    assert summary["tau_trained"] == calm_summary["tau_trained"] and summary["lossless"]


def test_a_fault_never_picks_an_actor_that_was_there_when_an_earlier_one_fired(ray_cluster):
    """Two generator faults, two generators up: the first kills one of them; the second leaves the
    survivor alone (what an earlier fault's recovery may be tearing down) and kills a generator
    started after the first fired."""
    import os

    import ray

    from dflash_ray.chaos import Injector
    from dflash_ray.config import ChaosConfig

    @ray.remote(num_cpus=0)
    class StandInGenerator:
        def pid(self) -> int:
            return os.getpid()

    def alive(actor) -> bool:
        try:
            ray.get(actor.pid.remote(), timeout=30)
            return True
        except ray.exceptions.RayActorError:
            return False

    def fired(chaos, n: int) -> bool:
        deadline = time.monotonic() + 60
        while chaos.summary()["injected"] < n and time.monotonic() < deadline:
            time.sleep(0.2)
        return chaos.summary()["injected"] == n

    first = [StandInGenerator.remote() for _ in range(2)]
    ray.get([a.pid.remote() for a in first])
    with Injector(ChaosConfig(faults=["generator@0", "generator@0"])) as chaos:
        assert fired(chaos, 1)
        time.sleep(3)  # fifteen looks at a cluster whose one generator was there when the first fired
        assert chaos.summary()["injected"] == 1, chaos.summary()
        later = StandInGenerator.remote()  # a victim as soon as its process is up
        assert fired(chaos, 2), chaos.summary()
    assert [alive(a) for a in first].count(True) == 1 and not alive(later)
    for actor in first:
        ray.kill(actor)


@pytest.mark.timeout(900)
def test_two_streams_on_two_nodes_train_the_chosen_layout_and_resume_under_another(three_nodes, target, data, tmp_path):
    """The coordinator on the head, a stream on each worker node: the network between the nodes is
    measured first (`train.min_bus_bandwidth`, gloo across the two nodes), the drafters' process
    group meets at rank 0's node, not the coordinator's, and 3 steps of 2 streams train with the
    drafter in the layout `auto` takes (hsdp: a node each, so replicated across the two). The run
    then resumes from step 3's checkpoint with the drafter sharded over both nodes' ranks (fsdp)."""
    address, env = three_nodes
    out = str(tmp_path / "two-nodes")
    workers = {"127.0.0.2", "127.0.0.3"}
    settings = SETTINGS + [
        f"ray.address={address}",
        "train.node_resource=train_node",
        "ray.head_resource=head_node",
        "train.actor_cpus=1",  # a node per stream
        "train.min_bus_bandwidth=0.001",
    ]
    args = ["train", "--data", data, "--target", target, "--output", out, "--stop-after-step", "3"]
    summary = _cli(args, settings, env, timeout=800)
    assert summary["step"] == 3 and set(summary["stream_nodes"]) == workers, summary
    pair = summary["network"]["slowest_pair"]  # the one pair: a rank on each node
    assert set(pair["nodes"]) == workers and not pair["within_node"] and pair["bus_gbs"] >= 0.001, summary
    assert summary["rendezvous"].split(":")[0] in workers, summary
    assert summary["coordinator_node"] not in workers, summary  # the head (it reports the machine's address)
    assert summary["layout"] == {"kind": "hsdp", "rows": [[0], [1]]}, summary
    resumed = _cli([*args[:-2], "--resume"], [*settings, "train.layout=fsdp"], env, timeout=800)
    assert resumed["layout"] == {"kind": "fsdp", "rows": [[0, 1]]}, resumed
    assert resumed["step"] == resumed["total_steps"] == 8 and resumed["restarts"] == 0, resumed
    rows = [json.loads(x) for x in storage.read_text(out + "/metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # steps 4-8 went on from step 3's checkpoint


@pytest.mark.timeout(900)
def test_elastic_streams_a_lost_node_costs_a_stream_until_it_returns_and_the_run_grows_back(
    three_nodes,
    target,  # noqa: F811
    data,  # noqa: F811
    tmp_path,
):
    """Two streams, one on each training node; one node's raylet is killed while they train. The
    restart cannot place the second stream (no node left has room for it) and, after
    train.placement_timeout_s, goes on with one (train.min_streams=1), which takes the lost
    stream's batches beside its own (train.lost_streams=stand_in): the same steps. Its placement stays asked for; once the run is
    seen on one stream the node is started again, and at the next checkpoint the run grows back to
    two streams, without a failure. Each training sample is taken once an epoch, at the step and
    learning rate of a run that lost nothing; the summary names the lost node and the return."""
    from dflash_ray.train.workers import lr_at

    cluster = three_nodes
    address, env = cluster
    out = str(tmp_path / "elastic")
    settings = SETTINGS + [
        f"ray.address={address}",
        "ray.head_resource=head_node",
        "train.node_resource=train_node",
        "train.actor_cpus=1",  # a node per stream
        "train.epochs=12",
        # a step takes ~0.4 s on the GPU's clock (2.4 s for 3,072 tokens, 512 here: one length bucket),
        # whatever the machine: the fault, 19 s after the stream actors first show up, lands in training
        "train.clocks.scale=1",
        "train.clocks.drafter_step_s=2.4",
        "train.clocks.compile_s=1",
        "train.min_streams=1",
        "train.lost_streams=stand_in",
        "train.placement_timeout_s=15",
        "train.max_restarts=4",
        "chaos.faults=[node@24]",
        "chaos.seed=6",  # 19 s after the stream actors first show up
    ]
    returned: list[str] = []

    def give_the_node_back() -> None:  # once the run is seen on one stream (its rows, at each checkpoint)
        history = tmp_path / "elastic" / "metrics"
        while not returned:
            rows = [r for f in history.glob("*.jsonl") for r in f.read_text().splitlines()]
            if cluster.lost() and any(json.loads(r).get("streams") == 1 for r in rows):
                lost = cluster.lost()[0]
                cluster.add(lost, 2, {"train_node": 4})
                returned.append(lost)
            time.sleep(0.5)

    helper = threading.Thread(target=give_the_node_back, daemon=True)
    helper.start()
    summary = _cli(["train", "--data", data, "--target", target, "--output", out], settings, env, timeout=800)
    (tmp_path / "summary.json").write_text(json.dumps(summary, indent=1))  # what the drill did, to read after
    drill = summary["chaos"]
    assert drill["injected"] == 1 and drill["faults"][0]["kind"] == "node", drill
    lost = drill["faults"][0]["victim"].removeprefix("node ")
    assert [x["node"] for x in summary["lost_nodes"]] == [lost] and returned == [lost], (summary, returned)
    assert summary["restarts"] >= 1 and summary["steps_on_fewer_streams"] > 0, summary
    assert summary["restarts"] == len(summary["failures"]), summary  # the return is not a failure
    assert summary["grew_back"] and summary["grew_back"][-1]["streams"] == summary["streams"] == 2, summary
    assert summary["seconds_lost"] > 0, summary
    taken = summary["samples"]  # 16 samples, 12 epochs: each taken 12 times
    assert taken["distinct"] == taken["of"] == 16 and taken["min_times"] == taken["max_times"] == 12, taken
    rows = [json.loads(x) for x in storage.read_text(out + "/metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows] == list(range(1, summary["step"] + 1)) and summary["step"] == 12 * 8
    # two streams, then one, then two again (one throughout the first part, on a machine slow enough
    # that the node went while the actors were still starting)
    streams = [r["streams"] for r in rows]
    assert streams[-1] == 2 and 1 in streams and streams.index(1) < len(streams) - streams[::-1].index(1)
    # every step's rate is that of a run that lost nothing: 2 samples a step, 192 in all
    expected = [lr_at(2 * (r["step"] - 1), 2 * 12 * 8, 3e-3, 0.04, 2) for r in rows]
    assert max(abs(r["lr"] - e) for r, e in zip(rows, expected)) < 1e-6


@pytest.mark.timeout(1500)  # last in this file: it takes a node of the shared cluster down
def test_a_pipeline_whose_actors_are_killed_and_that_loses_a_worker_node_finishes_as_an_undisturbed_one(
    three_nodes, inputs, calm, tmp_path
):
    """A generator, a tokenize worker, a target and a drafter are killed, and one worker node's raylet
    (the node and every process on it) while the run uses it: the run finishes on the nodes left, as
    the undisturbed one did."""
    address, env = three_nodes
    # a fault fires at the first moment past its seeded delay (seed 3: 1.4, 0.5, 3.0, 9.7 and 6.3 s
    # after its first victim's process started) that finds a victim: each stage outlasts its delay on
    # any machine (an actor's start alone takes seconds; the training's 32 steps and the restart the
    # target's death costs outlast 9.7 s), so all five fire, wherever they land; the node goes while
    # the generation runs, as a node would that a fleet of generators keeps busy
    faults = ["generator@6", "tokenize@1", "target@8", "drafter@16", "node@10"]
    settings = _settings(tmp_path, inputs) + [
        f"ray.address={address}",
        "ray.head_resource=head_node",
        f"chaos.faults=[{', '.join(faults)}]",
        "chaos.seed=3",
    ]
    summary = _cli(["pipeline"], settings, env, timeout=1300)
    drill = summary["chaos"]
    assert drill["injected"] == drill["recovered"] == len(faults) and not drill["not_fired"], drill
    assert [f["kind"] for f in drill["faults"]] == [f.split("@")[0] for f in faults], drill
    assert drill["faults"][-1]["victim"] in ("node 127.0.0.2", "node 127.0.0.3", "node 127.0.0.4"), drill
    assert drill["restarts"]["generate"] >= 1 and drill["restarts"]["train"] >= 2, drill
    assert drill["seconds_lost"]["train"] > 0, drill
    _same_as_calm(summary, tmp_path, calm)

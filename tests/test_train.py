"""Online training on a local Ray cluster with a tiny target: gradient averaging, exact resume,
recovery from killed actors."""

import io
import json
import sys
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch

from conftest import checkpoint_weights
from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from dflash_ray.tiny_models import tiny_qwen3
from dflash_ray.train import checkpoint
from dflash_ray.train.shape import drafter_config
from dflash_ray.stages.train import run_train
from dflash_ray.train.fsdp import full, optimizer_bytes
from dflash_ray.train.target_worker import TargetWorker
from dflash_ray.train.workers import DrafterWorker

# every paired run here sends its features under NCCL's rules (`p2p`): a wait that would hang on GPUs
# raises after collective_timeout_s instead
SETTINGS = [
    "train.actor_cpus=0.5",
    "train.num_layers=1",
    "train.target_layer_ids=[0,1,2]",
    "train.num_anchors=16",
    "train.lr=3e-3",
    "train.checkpoint_every=3",
    "train.epochs=1",
    "train.collective_timeout_s=60",
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("target"), num_layers=4, hidden_size=64, vocab_size=512)


def _tokenized(folder: str, sequences: list[list[int]], prefix: str = "s") -> str:
    """A tokenized dataset of 48-token sequences, the first 12 tokens a prompt."""
    rows = [
        {
            "id": f"{prefix}{i}",
            "source": "x",
            "input_ids": seq,
            "loss_mask": [0] * 12 + [1] * 36,
            "seq_len": 48,
            "truncated": False,
        }
        for i, seq in enumerate(sequences)
    ]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes(storage.join(folder, "part-0.parquet"), buf.getvalue())
    manifest.write_manifest(folder, kind="tokenized", files=[{"name": "part-0.parquet", "rows": len(rows)}], summary={})
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    return _tokenized(
        str(tmp_path_factory.mktemp("data")),
        [torch.randint(0, 490, (12,), generator=g).repeat(4).tolist() for _ in range(16)],
    )


@pytest.fixture(scope="module")
def motif_data(tmp_path_factory):
    """One 12-token motif, each sample a rotation of it repeated: a drafter can learn what follows."""
    motif = torch.randint(0, 490, (12,), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    return _tokenized(
        str(tmp_path_factory.mktemp("motif")),
        [motif.roll(-int(torch.randint(0, 12, (), generator=g))).repeat(4).tolist() for _ in range(16)],
        prefix="m",
    )


@pytest.fixture(scope="module")
def alone(ray_cluster, target, data, tmp_path_factory):
    """(output, summary) of one undisturbed run of SETTINGS to its end, which several tests compare
    their runs with bit for bit."""
    out = str(tmp_path_factory.mktemp("alone") / "run")
    return out, run_train(target, data, out, load_config(None, SETTINGS), progress=False)


def test_two_streams_learn_on_the_ray_path(ray_cluster, target, motif_data, tmp_path):
    """Two data-parallel streams (gloo), each a colocated target and drafter (the paired path's
    numbers are the same, bit for bit: see the checkpoint test below): the loss falls and the
    held-out tau rises well past the untrained start's (which matches about 1 draft token in 500)."""

    # every motif sample has one length, so length balancing would only draw another order of the same
    # samples; 24 steps on this seed learn the motif in the windowed order, less in some others (the
    # test is of the Ray path, not of one order's luck: the order itself is tested in test_file_cache.py).
    # Every valid anchor (35 a sample), so no draw's luck either: at lr 2e-2 the run is chaotic enough
    # that one draw of 32 of them ended at tau 1.35, another at 1.72
    cfg = load_config(
        None,
        SETTINGS
        + [
            "train.lr=2e-2",
            "train.epochs=4",
            "train.num_anchors=35",
            "train.heldout=4",
            "train.eval_every=4",
            "train.checkpoint_every=100",
            "train.length_group=0",
            "train.colocate=true",
        ],
    )
    summary = run_train(target, motif_data, str(tmp_path / "out"), cfg, progress=False)
    metrics = [
        json.loads(x) for x in storage.read_text(storage.join(str(tmp_path / "out"), "metrics.jsonl")).splitlines()
    ]
    losses = [m["loss"] for m in metrics]
    assert summary["step"] == len(metrics) == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    start, end = summary["heldout_tau_start"], summary["heldout_tau"]
    assert start is not None and start < 1.1, start  # untrained: next to no draft token accepted
    assert end > 1.4 and end > start + 0.3, (start, end, [m.get("heldout_tau") for m in metrics])


def flat_grad(worker: DrafterWorker) -> torch.Tensor:
    """Every parameter's whole gradient, flattened (collective when sharded)."""
    return torch.cat(
        [full(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in worker.drafter.parameters()]
    )


def flat_weights(worker: DrafterWorker) -> torch.Tensor:
    """Every parameter whole, flattened (collective when sharded)."""
    return torch.cat([full(p.detach()).flatten() for p in worker.drafter.parameters()])


def _final_weights(output):
    return checkpoint_weights(output)


def test_a_sharded_step_equals_one_process_on_the_union_and_halves_the_optimizer_state(ray_cluster, target, data):
    """Two drafter actors (FSDP2 over gloo), each with half the batch: the same gradient and the same
    weights after an optimizer step as one process given the whole batch, and each rank holding
    half the optimizer state that process holds."""

    from dflash_ray.train.streams import free_port

    cfg = load_config(None, SETTINGS + ["train.num_anchors=64"])  # every valid position: same anchors
    drafter_json = json.dumps(drafter_config(target, cfg))
    feats = TargetWorker(target, [0, 1, 2], cfg.train)
    a = feats.features([(f"{data}/part-0.parquet", 0)])
    b = feats.features([(f"{data}/part-0.parquet", 5)])
    union = feats.features([(f"{data}/part-0.parquet", 0), (f"{data}/part-0.parquet", 5)])

    actor = ray.remote(DrafterWorker).options(num_cpus=0.5)
    workers = [actor.remote(target, drafter_json, "target", cfg.train, rank, 2) for rank in range(2)]
    port = free_port()
    ray.get([w.init_group.remote("127.0.0.1", port) for w in workers])
    ray.get([w.averaged_gradients.remote(batch) for w, batch in zip(workers, (a, b))])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probes below run in the actors
    grads = ray.get([w.__ray_call__.remote(flat_grad) for w in workers])
    ray.get([w.train_step.remote(0, batch) for w, batch in zip(workers, (a, b))])
    weights = ray.get([w.__ray_call__.remote(flat_weights) for w in workers])
    shard_bytes = ray.get([w.__ray_call__.remote(lambda w: optimizer_bytes(w.opt)) for w in workers])
    for w in workers:
        ray.kill(w)

    single = DrafterWorker(target, drafter_json, "target", cfg.train, 0, 1)
    before = flat_weights(single).clone()
    single.averaged_gradients(union)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], flat_grad(single), rtol=1e-5, atol=1e-7)
    single.train_step(0, union)
    assert not torch.equal(flat_weights(single), before)  # the step moved the weights
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
    # AdamW's first step moves each weight by about lr·g/(|g| + eps): where a gradient is near eps, its
    # last bits (which the summation order sets) move that weight by a share of lr, so the weights
    # agree to 1% of lr, still far below the lr a missing or different step would show
    torch.testing.assert_close(weights[0], flat_weights(single), rtol=1e-5, atol=1e-2 * cfg.train.lr)
    whole = optimizer_bytes(single.opt)
    assert whole > 0 and all(abs(b - whole / 2) <= 0.05 * whole for b in shard_bytes), (shard_bytes, whole)


def test_a_run_checkpoints_sharded_and_trains_alike_colocated_or_through_the_object_store(
    ray_cluster, target, data, tmp_path, alone
):
    """The undisturbed run's checkpoint: a file per rank and its data's print; a colocated stream and
    features through Ray's object store train the same weights, bit for bit. (A resume that is exact:
    `test_training_with_target_and_output_on_s3_resumes_and_exports_there`.)"""
    whole_dir, whole = alone
    assert whole["step"] == whole["total_steps"] == 8
    assert whole["trackers"] == {}  # none unless train.trackers (test_trackers)
    # sharded: one file per rank, none holding the whole optimizer state, and no whole-model file
    assert sorted(checkpoint.read_manifest(whole_dir, 8)["files"]) == [
        "drafter/config.json",
        "shards/.metadata",
        "shards/__0_0.distcp",
        "shards/__1_0.distcp",
        "state.json",
    ]
    # the data's print, which a resume compares with the data it is given (test_train_guards)
    state = json.loads(storage.read_text(storage.join(checkpoint.step_dir(whole_dir, 8), "state.json")))
    assert state["data_print"] == manifest.fingerprint(data)
    step_a, weights_a = _final_weights(whole_dir)
    assert step_a == 8
    assert whole["rendezvous"].startswith(ray.util.get_node_ip_address() + ":")  # drafter rank 0's node

    # a colocated stream (target and drafter in one actor, features never copied) trains the same weights
    # (one step traced by the profiler: the trace changes nothing in the computation)
    colocated = run_train(
        target,
        data,
        str(tmp_path / "colocated"),
        load_config(None, SETTINGS + ["train.colocate=true", "train.profile_steps=[3]"]),
        progress=False,
    )
    assert colocated["step"] == 8
    assert _final_weights(str(tmp_path / "colocated")) == (8, weights_a)  # bitwise
    traces = sorted(storage.basename(f) for f in storage.list_files(str(tmp_path / "colocated" / "profile")))
    assert traces == ["step-000003-stream-0.json", "step-000003-stream-1.json"]
    trace = json.loads(storage.read_text(str(tmp_path / "colocated" / "profile" / traces[0])))
    assert any("aten::" in e.get("name", "") for e in trace["traceEvents"])
    # the features through Ray's object store instead of send/recv: the same weights too
    stored = run_train(
        target,
        data,
        str(tmp_path / "stored"),
        load_config(None, SETTINGS + ["train.feature_transport=object_store", "train.profile_steps=[2]"]),
        progress=False,
    )
    assert stored["step"] == 8
    assert _final_weights(str(tmp_path / "stored")) == (8, weights_a)  # bitwise
    assert sorted(storage.basename(f) for f in storage.list_files(str(tmp_path / "stored" / "profile"))) == [
        f"step-000002-{role}-{rank}.json" for role in ("drafter", "target") for rank in (0, 1)
    ]


def test_features_go_from_target_to_drafter_by_send_and_recv_with_only_their_shapes_through_ray(
    ray_cluster, target, data
):
    """`handoff`: the target posts the batch's tensors to its drafter and returns their shapes alone
    (under 2 KB through Ray, where the features are tens of KB); the drafter receives exactly what
    the target computed, twice in a row (messages in order), and trains on it."""
    import pickle

    from conftest import joined_stream
    from dflash_ray.train import handoff

    cfg = load_config(None, SETTINGS + ["train.num_streams=1"])
    samples = [[(f"{data}/part-0.parquet", 0), (f"{data}/part-0.parquet", 3)], [(f"{data}/part-0.parquet", 7)]]
    expected = [TargetWorker(target, [0, 1, 2], cfg.train).features(b) for b in samples]
    with joined_stream(target, cfg, "target") as (sender, receiver, layout):
        refs = [sender.send_features.remote(b, [layout.drafter(0, 0)]) for b in samples]  # both posted at once
        metas = ray.get(refs)
        received = ray.get(
            [receiver.__ray_call__.remote(lambda w, m: handoff.taken(m, w.source, w.place.device), m) for m in metas]
        )
        stats = ray.get(receiver.train_step.remote(0, ray.get(sender.send_features.remote(samples[0], [1]))))
    for meta, got, want in zip(metas, received, expected):
        assert len(pickle.dumps(meta)) < 2048 < want["features"].numel() * 4
        assert meta["bytes"] == sum(
            want[k].numel() * want[k].element_size() for k in ("features", "input_ids", "loss_mask")
        )
        for key in ("input_ids", "loss_mask", "features"):
            assert torch.equal(got[key], want[key]), key
    assert stats["handoff_seconds"] > 0 and stats["loss"] > 0


def test_two_drafters_from_one_target_pass_each_train_as_alone(ray_cluster, target, data, tmp_path, alone):
    """`train.drafters`: a DFlash drafter and a DSpark one on other target layers, fed by one target
    pass per batch over two streams, stopped between checkpoints and resumed. The DFlash one ends
    bitwise where it ends trained alone (its layers picked out of the union the target captured),
    the DSpark one trains, and each folder is a run of its own that exports."""

    from dflash_ray.stages.export import run_export

    teams = (
        "train.drafters=[{name: flash}, {name: spark, drafter: dspark, family: {markov_rank: 16}, block_size: 6, "
        "target_layer_ids: [1, 3]}]"
    )
    cfg = load_config(None, SETTINGS + ["train.distill_top_k=8", "train.actor_cpus=0.3", teams])  # 6 actors on 2 CPUs
    out = str(tmp_path / "both")
    assert run_train(target, data, out, cfg, progress=False, stop_after_step=5)["step"] == 5
    both = run_train(target, data, out, cfg, progress=False)
    assert both["step"] == both["total_steps"] == 8 and set(both["drafters"]) == {"flash", "spark"}
    resolved = both["resolved"]  # what ran, as the driver resolved it once
    assert resolved["placement"] == {"device": "cpu", "attention": "sdpa", "dtype": "float32", "backend": "gloo"}
    assert [(d["name"], d["family"], d["block_size"], d["target_layer_ids"]) for d in resolved["drafters"]] == [
        ("flash", "dflash", 16, [0, 1, 2]),
        ("spark", "dspark", 6, [1, 3]),
    ]
    assert [d["start"] for d in resolved["drafters"]] == [both["drafters"][n]["start"] for n in ("flash", "spark")]
    alone_dir, alone = alone
    assert (
        alone["resolved"]["drafters"][0]["start"] == alone["start"] and "name" not in alone["resolved"]["drafters"][0]
    )
    assert alone["step"] == 8 and alone["checkpoint"] == checkpoint.step_dir(alone_dir, 8)
    assert _final_weights(storage.join(out, "flash")) == _final_weights(alone_dir)  # bitwise
    spark, flash = _metrics(storage.join(out, "spark")), _metrics(storage.join(out, "flash"))
    assert [m["step"] for m in spark] == [m["step"] for m in flash] == list(range(1, 9))
    assert [m["loss"] for m in flash] == [m["loss"] for m in _metrics(alone_dir)]
    assert spark[-1]["loss"] < spark[0]["loss"] and spark[0]["loss"] != flash[0]["loss"]
    for name, arch in (("flash", "DFlashDraftModel"), ("spark", "DSparkDraftModel")):
        assert both["drafters"][name]["checkpoint"] == checkpoint.step_dir(storage.join(out, name), 8)
        run_export(both["drafters"][name]["checkpoint"], str(tmp_path / f"export-{name}"), dtype="float32")
        assert json.loads((tmp_path / f"export-{name}" / "config.json").read_text())["architectures"] == [arch]
    assert storage.exists(storage.join(out, "spark", "metrics.png"))


def _corrupt_same_size(output: str, step: int, name: str) -> None:
    uri = storage.join(checkpoint.step_dir(output, step), name)
    body = bytearray(storage.read_bytes(uri))
    body[len(body) // 2] ^= 0xFF  # only its checksum can tell
    storage.write_bytes(uri, bytes(body))


def test_resume_passes_over_a_corrupt_checkpoint_and_continues_exactly(ray_cluster, target, data, tmp_path, alone):
    """The drafters check what they load themselves: a corrupt newest checkpoint gives way to the one
    before it, rotation keeps what a resume needs, and a checkpoint of another target is refused."""
    import re
    import shutil

    from dflash_ray.errors import DFlashError

    # colocated streams: the drafters' state, shards and weights are the paired run's (`alone`'s)
    colocated = SETTINGS + ["train.colocate=true"]
    cfg = load_config(None, colocated)
    out = str(tmp_path / "run")
    shutil.copytree(alone[0], out)  # a finished run of these settings
    assert checkpoint.complete_steps(out) == [3, 6, 8]
    reference = _final_weights(out)
    storage.delete_tree(checkpoint.step_dir(out, 8))  # as if the run had stopped after step 6 ...
    _corrupt_same_size(out, 6, "shards/__1_0.distcp")  # ... whose rank-1 shard only its checksum shows corrupt

    resumed = run_train(target, data, out, load_config(None, colocated + ["train.keep_checkpoints=1"]), progress=False)
    assert resumed["step"] == 8 and resumed["restarts"] == 0
    assert checkpoint.complete_steps(out) == [8]  # step 6 rewritten from 3 on, then rotated like 3
    assert _final_weights(out) == reference  # bitwise: resumed from 3, as if never interrupted

    other = shutil.copytree(target, tmp_path / "another-target")  # the same weights under another name
    with pytest.raises(DFlashError, match=re.escape(f"target (checkpoint: {target}, now: {other})")):
        run_train(str(other), data, out, cfg, progress=False)

    _corrupt_same_size(out, 8, "shards/__0_0.distcp")
    with pytest.raises(DFlashError, match=r"no checkpoint verifies \(step 8: \S+__0_0.distcp: its sha256"):
        run_train(target, data, out, cfg, progress=False)
    assert checkpoint.complete_steps(out) == [8]  # refused, nothing overwritten


def _metrics(output: str) -> list[dict]:

    return [json.loads(x) for x in storage.read_text(storage.join(output, "metrics.jsonl")).splitlines()]


def _train_and_kill(target, data, output: str, cfg, name: str, roles: list[str]) -> dict:
    """Train in a thread and kill stream 1's actor of each role of `roles` in turn (`target`,
    `drafter`, or a colocated run's `stream`), each mid-training:
    the first once a checkpoint exists, each later one only once it is an actor of the restarted run
    (none of stream 1's actors alive at the kill before) and that run has taken a checkpoint of its
    own. The run's summary, or its error under "error"."""
    result = {}

    def train():
        try:
            result.update(run_train(target, data, output, cfg, progress=False, run_name=name))
        except Exception as e:
            result["error"] = e

    def actor(role: str):
        try:
            return ray.get_actor(f"{name}-{role}-1")
        except ValueError:
            return None

    thread = threading.Thread(target=train)
    thread.start()
    stale: set = set()  # stream 1's actors alive at the last kill
    for role in roles:
        victim, newest = None, None
        while thread.is_alive() and victim is None:
            candidate = actor(role)
            if candidate is not None and candidate._actor_id not in stale:
                steps = checkpoint.complete_steps(output) or [0]
                if newest is None:  # first seen: the checkpoints so far are the run's before the kill
                    newest = steps[-1] if stale else 0
                if steps[-1] > newest:
                    victim = candidate
            thread.join(timeout=0.2)
        assert victim is not None, f"the run ended before the {role} could be killed"
        stale |= {a._actor_id for a in map(actor, ("target", "drafter", "stream")) if a is not None}
        ray.kill(victim)
    thread.join(timeout=300)
    return result


def test_run_survives_a_killed_target_and_a_killed_drafter(ray_cluster, target, data, tmp_path):
    """Stream 1's target is killed after the first checkpoint, then, after the restart, its drafter
    after a later one: the run takes every step, one restart a death."""
    cfg = load_config(None, SETTINGS + ["train.epochs=3"])  # 24 steps: the kills land after checkpoints (3 each)
    result = _train_and_kill(target, data, str(tmp_path / "out"), cfg, "kill", ["target", "drafter"])
    assert result["step"] == result["total_steps"] == 24
    assert result["restarts"] == 2


def test_an_error_on_one_rank_restarts_the_run_instead_of_hanging_the_other(ray_cluster, target, data, tmp_path, alone):
    """Drafter rank 1 raises at step 4 (as an out-of-memory error would) while rank 0 waits for it in
    the all-reduce, right after the step-3 checkpoint was taken (its files may still be uploading:
    they are committed before the restart, not lost): every stream restarts from step 3, each step
    is taken once, and the weights are an undisturbed run's, bit for bit."""

    faulty = run_train(
        target,
        data,
        str(tmp_path / "faulty"),
        load_config(None, SETTINGS + ["train.fault_step=4", "train.collective_timeout_s=120"]),
        progress=False,
    )
    assert faulty["step"] == 8 and faulty["restarts"] == 1 and faulty["resumed_from"] == [3]
    assert "injected fault at step 4 on drafter rank 1" in faulty["failures"][0], faulty["failures"]
    rows = [json.loads(x) for x in storage.read_text(str(tmp_path / "faulty" / "metrics.jsonl")).splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert _final_weights(str(tmp_path / "faulty")) == _final_weights(alone[0])


def test_streams_not_placed_in_time_are_refused_naming_the_setting_and_leave_no_placement_group(ray_cluster):
    from ray.util import placement_group_table

    from dflash_ray.errors import DFlashError
    from dflash_ray.train.elastic import place_streams

    tcfg = load_config(None, ["train.placement_timeout_s=1"]).train
    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(DFlashError, match="2 of 2 streams' actors") as e:
        place_streams(tcfg, [{"CPU": 64.0}])  # more than the node has
    assert e.value.field == "train.placement_timeout_s" and "free" in str(e.value)
    assert {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"} == before


def test_elastic_placement_goes_on_with_the_streams_placed_down_to_min_streams(ray_cluster):
    """Three streams asked for on a 2-CPU node that holds two: with train.min_streams=2 the run goes
    on with the two placed after the timeout, the third still asked for (the autoscaler's demand,
    the run's way back); with min_streams=3 none is kept."""
    from ray.util import placement_group_table
    from ray.util.placement_group import remove_placement_group

    from dflash_ray.errors import DFlashError
    from dflash_ray.train.elastic import place_streams, placed

    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    settings = ["train.placement_timeout_s=2", "train.num_streams=3"]
    groups = place_streams(load_config(None, settings + ["train.min_streams=2"]).train, [{"CPU": 1.0}])
    try:
        assert len(groups) == 3 and len(placed(groups)) == 2
        [waiting] = [g for g in groups if g not in placed(groups)]
        assert placement_group_table(waiting)["state"] == "PENDING"
    finally:
        for g in groups:
            remove_placement_group(g)
    with pytest.raises(DFlashError, match="1 of 3 streams"):
        place_streams(load_config(None, settings + ["train.min_streams=3"]).train, [{"CPU": 1.0}])
    assert {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"} == before


def test_streams_the_cluster_cannot_hold_are_refused_before_any_actor_with_the_numbers():
    from dflash_ray.errors import DFlashError
    from dflash_ray.train.devices import check_resources

    cfg = load_config(None, []).train  # 2 streams of a target and a drafter, 1 CPU each
    with pytest.raises(DFlashError) as e:
        check_resources(cfg, [{"CPU": 2.0, "memory": 1e10}])
    assert e.value.field == "train.actor_cpus" and "need 2 CPU each" in str(e.value)
    assert "have 2 CPU: room for 1" in str(e.value) and "train.colocate=true" in str(e.value)
    check_resources(cfg, [{"CPU": 2.0}, {"CPU": 3.0}])  # one stream on each node
    check_resources(load_config(None, ["train.colocate=true"]).train, [{"CPU": 2.0}])
    gpu = load_config(None, ["train.actor_gpus=1", "train.target_gpus=2"]).train
    check_resources(gpu, [{"CPU": 64.0, "GPU": 8.0}])  # 2 streams of 3 GPUs (target 2, drafter 1) on 8
    with pytest.raises(DFlashError, match="need 2 CPU, 3 GPU each"):
        check_resources(gpu, [{"CPU": 64.0, "GPU": 4.0}])
    with pytest.raises(DFlashError) as e:
        load_config(None, ["train.actor_gpus=1", "train.target_gpus=2", "train.colocate=true"])
    assert e.value.field == "train.target_gpus"


def test_train_on_a_cluster_too_small_exits_2_at_once_naming_the_cpus(ray_cluster, target, data, tmp_path, capsys):
    import time

    from dflash_ray.cli import main

    started = time.monotonic()
    code = main(["train", "--data", data, "--target", target, "--output", str(tmp_path / "out"), "--json"])
    error = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and time.monotonic() - started < 30
    assert "need 2 CPU each" in error and "have 2 CPU" in error, error
    assert not (tmp_path / "out").exists()


def test_a_death_past_the_restart_budget_fails_the_run_with_a_clear_error(ray_cluster, target, data, tmp_path):
    from dflash_ray.errors import DFlashError

    cfg = load_config(None, SETTINGS + ["train.epochs=6", "train.max_restarts=0", "train.colocate=true"])
    result = _train_and_kill(target, data, str(tmp_path / "out"), cfg, "kill-budget", ["stream"])
    error = result.get("error")
    assert isinstance(error, DFlashError), result
    assert error.field == "train.max_restarts" and "over the budget of 0 restarts" in str(error)
    assert "killed by `ray.kill`" in str(error) and "\n" not in str(error)  # the cause, in one line
    assert checkpoint.complete_steps(str(tmp_path / "out"))  # what was trained is kept for a resume


def test_training_with_target_and_output_on_s3_resumes_and_exports_there(
    ray_cluster, target, data, s3_bucket, alone, capsys
):
    """The target read from `s3://`, checkpoints written there, a resume from them, the export to S3.
    The run stops at step 5, between its every-3 checkpoints (the stop takes one of its own), and the
    resume is exact: the undisturbed run's weights, bit for bit."""
    from dflash_ray.stages.export import run_export

    storage.upload_tree(target, f"{s3_bucket}/target")
    out = f"{s3_bucket}/run"
    cfg = load_config(None, SETTINGS + ["train.colocate=true"])  # trains as the paired `alone` does
    assert run_train(f"{s3_bucket}/target", data, out, cfg, progress=False, stop_after_step=5)["step"] == 5
    capsys.readouterr()
    resumed = run_train(f"{s3_bucket}/target", data, out, cfg, progress=True)
    assert resumed["step"] == 8 and resumed["checkpoint"].startswith(out)
    # one line per step on stderr, each step once: the figures a person watches
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["6/8", "7/8", "8/8"], lines
    assert all(" loss " in x and " tok/s" in x for x in lines), lines
    assert _final_weights(out) == _final_weights(alone[0])  # bitwise
    assert storage.exists(storage.join(out, "metrics.png"))
    run_export(resumed["checkpoint"], f"{s3_bucket}/drafter", dtype="float32")
    names = {storage.basename(f) for f in storage.list_files(f"{s3_bucket}/drafter", (".json", ".safetensors"))}
    assert {"config.json", "model.safetensors"} <= names
    step, weights = _final_weights(out)
    assert step == 8 and len(weights) > 0


def test_ctrl_c_stops_training_cleanly_naming_the_checkpoint_to_resume_from(
    ray_cluster, target, data, tmp_path, capsys
):
    import os
    import signal
    import threading
    import time

    from dflash_ray.cli import main
    from dflash_ray.train import checkpoint

    out = str(tmp_path / "cli")
    args = [
        "train",
        "--data",
        data,
        "--target",
        target,
        "--output",
        out,
        "--json",
        *[x for s in SETTINGS for x in ("--set", s)],
        *("--set", "train.epochs=100", "--set", "train.num_streams=1", "--set", "train.colocate=true"),
    ]

    def interrupt_after_a_checkpoint():
        while not checkpoint.complete_steps(out):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it

    threading.Thread(target=interrupt_after_a_checkpoint, daemon=True).start()
    assert main(args) == 130
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert not summary["ok"] and summary["exit_code"] == 130 and "Traceback" not in captured.err
    last = checkpoint.complete_steps(out)[-1]
    assert f"last checkpoint is step {last}" in summary["error"] and "--resume" in summary["error"]
    assert main(args + ["--resume", "--stop-after-step", str(last + 1)]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == last + 1


def test_a_bad_data_setting_reaches_the_driver_as_its_own_error(ray_cluster, target, data, tmp_path):
    from dflash_ray.errors import DFlashError

    with pytest.raises(DFlashError) as e:  # raised in the coordinator actor, not a dead-actor error
        run_train(target, data, str(tmp_path / "x"), load_config(None, SETTINGS + ["train.heldout=16"]), progress=False)
    assert e.value.field == "train.heldout"


def test_a_ragged_batch_trains_as_its_samples_do_alone(target, tmp_path):
    """batch_size > 1 with different lengths: padding changes neither the target's features nor the
    loss; the batch's loss and gradient are its samples' weighted together."""

    g = torch.Generator().manual_seed(3)
    rows = []
    for i, n in enumerate((23, 48, 31)):
        ids = torch.randint(0, 490, (n,), generator=g).tolist()
        rows.append(
            {
                "id": f"r{i}",
                "source": "x",
                "input_ids": ids,
                "loss_mask": [0] * 7 + [1] * (n - 7),
                "seq_len": n,
                "truncated": False,
            }
        )
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    part = str(tmp_path / "part-0.parquet")
    storage.write_bytes(part, buf.getvalue())

    cfg = load_config(None, SETTINGS + ["train.num_anchors=64", "train.batch_size=3"])  # every valid anchor
    drafter_json = json.dumps(drafter_config(target, cfg))
    feats = TargetWorker(target, [0, 1, 2], cfg.train)
    worker = DrafterWorker(target, drafter_json, "target", cfg.train, 0, 1)
    together = feats.features([(part, i) for i in range(3)])
    _, loss, weight = worker.averaged_gradients(together)
    grad = flat_grad(worker).clone()
    losses, weights, grads = [], [], []
    for i in range(3):
        alone = feats.features([(part, i)])
        n = rows[i]["seq_len"]
        torch.testing.assert_close(together["features"][i, :n], alone["features"][0, :n])
        _, loss_i, weight_i = worker.averaged_gradients(alone)
        losses.append(loss_i), weights.append(weight_i), grads.append(flat_grad(worker).clone())
    assert weight == pytest.approx(sum(weights))
    assert loss == pytest.approx(sum(l * w for l, w in zip(losses, weights)) / weight, rel=1e-5)
    torch.testing.assert_close(grad, sum(gr * w for gr, w in zip(grads, weights)) / weight, rtol=1e-4, atol=1e-6)


def test_bf16_training_keeps_fp32_master_weights(target, data):

    cfg = load_config(None, SETTINGS + ["train.dtype=bfloat16"])
    worker = DrafterWorker(target, json.dumps(drafter_config(target, cfg)), "random", cfg.train, 0, 1)
    batch = TargetWorker(target, [0, 1, 2], cfg.train).features([(f"{data}/part-0.parquet", 0)])
    assert batch["features"].dtype == torch.bfloat16
    before = [p.detach().clone() for p in worker.drafter.parameters()]
    stats = worker.train_step(0, batch)
    assert all(p.dtype == torch.float32 for p in worker.drafter.parameters())
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, worker.drafter.parameters()))


def test_distillation_sends_the_targets_top_k_and_trains_on_it(target, data):

    cfg = load_config(None, SETTINGS + ["train.distill=0.5", "train.distill_top_k=4"])
    batch = TargetWorker(target, [0, 1, 2], cfg.train).features([(f"{data}/part-0.parquet", 0)])
    assert batch["teacher_ids"].shape == (1, 48, 4) and batch["teacher_probs"].dtype == torch.float16
    # the distribution of token p + 1 sits at p: the last position and the prompt carry none
    assert batch["teacher_probs"][0, 11:47].sum(-1).gt(0).all() and not batch["teacher_probs"][0, 47].any()
    worker = DrafterWorker(target, json.dumps(drafter_config(target, cfg)), "random", cfg.train, 0, 1)
    hard = DrafterWorker(
        target, json.dumps(drafter_config(target, cfg)), "random", load_config(None, SETTINGS).train, 0, 1
    )
    soft_stats, hard_stats = worker.train_step(0, batch), hard.train_step(0, batch)
    assert torch.isfinite(torch.tensor(soft_stats["loss"])) and soft_stats["grad_norm"] > 0
    assert soft_stats["loss"] != hard_stats["loss"]  # the same anchors, another target


def test_heldout_takes_whole_prompts(data):
    from dflash_ray.train.schedule import dataset_samples, sample_prompts, split_heldout

    samples = dataset_samples(data)
    assert sample_prompts(samples) == [f"s{i}" for i in range(16)]
    unique = split_heldout(samples, 3, seed=0, prompts=sample_prompts(samples))
    assert unique == split_heldout(samples, 3, seed=0) and len(unique[0]) == 3
    prompts = [f"p{i // 3}" for i in range(16)]  # three completions of each prompt
    held, train = split_heldout(samples, 4, seed=0, prompts=prompts)
    held_prompts = {prompts[samples.index(s)] for s in held}
    assert len(held) == 6 and len(held) + len(train) == 16
    assert not held_prompts & {prompts[samples.index(s)] for s in train}


def test_drafter_shape_settings_reach_the_config_and_bad_ones_name_the_field(target):
    from dflash_ray.errors import DFlashError

    cfg = load_config(
        None,
        SETTINGS
        + [
            "train.num_layers=2",
            "train.block_size=8",
            "train.sliding_window=16",
            'train.layer_types=["sliding_attention","full_attention"]',
        ],
    )
    hf = drafter_config(target, cfg)
    assert hf["block_size"] == 8 and hf["layer_types"] == ["sliding_attention", "full_attention"]
    assert hf["sliding_window"] == 16
    with pytest.raises(DFlashError) as e:
        drafter_config(
            target, load_config(None, SETTINGS + ['train.layer_types=["sliding_attention"]', "train.num_layers=2"])
        )
    assert "layer_types" in str(e.value) and "train" in str(e.value)


def test_token_ids_past_the_targets_embedding_are_a_clear_error_not_a_restart_loop(target, tmp_path):
    """Data tokenized for another model (ids past the target's table): the target names the file,
    record and field at once, an error of the input (no restart repeats it)."""
    from dflash_ray.errors import DFlashError

    part = str(tmp_path / "part-0.parquet")
    rows = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [5, 600, 7], "loss_mask": [0, 1, 1]}]
    pq.write_table(pa.Table.from_pylist(rows), part)
    feats = TargetWorker(target, [0, 1, 2], load_config(None, SETTINGS).train)
    with pytest.raises(DFlashError, match="token id 600 is past the target's 512-entry embedding") as e:
        feats.features([(part, 0), (part, 1)])
    assert (e.value.file, e.value.record, e.value.field) == (part, 2, "input_ids")


def test_a_loss_mask_of_another_length_than_its_ids_is_named_by_the_target(target, tmp_path):
    """Padding would hide a mask shorter than its sample's ids (the loss then lands on other tokens,
    or a shape error surfaces after the restarts): the target names the file, record and field."""
    from dflash_ray.errors import DFlashError

    part = str(tmp_path / "part-0.parquet")
    rows = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [5, 6, 7], "loss_mask": [0, 1]}]
    pq.write_table(pa.Table.from_pylist(rows), part)
    feats = TargetWorker(target, [0, 1, 2], load_config(None, SETTINGS).train)
    with pytest.raises(DFlashError, match="2 loss_mask entries for 3 input_ids") as e:
        feats.features([(part, 0), (part, 1)])
    assert (e.value.file, e.value.record, e.value.field) == (part, 2, "loss_mask")


def test_a_kept_batch_is_served_again_without_a_forward_and_bitwise_as_computed(target, data):
    """`train.feature_cache_gb`: a batch the target computed comes back from its host copy, equal to
    the last bit to what the forward gives, and a change the taker makes in place does not reach the
    copy; a budget too small for a batch keeps nothing."""
    extra = ["train.distill=0.5", "train.distill_top_k=4"]
    cached = TargetWorker(
        target, [0, 1, 2], load_config(None, SETTINGS + extra + ["train.feature_cache_gb=0.01"]).train
    )
    batch = [(f"{data}/part-0.parquet", 0), (f"{data}/part-0.parquet", 3)]
    first = cached.features(batch)
    forwards = []
    cached.model.model.register_forward_pre_hook(lambda *_: forwards.append(1))  # the decoder stack
    again = cached.features(batch)
    assert forwards == [] and again["read_bytes"] == 0
    fresh = TargetWorker(target, [0, 1, 2], load_config(None, SETTINGS + extra).train)
    expected = fresh.features(batch)
    tensors = ("input_ids", "loss_mask", "features", "teacher_ids", "teacher_probs")
    for key in tensors:
        assert torch.equal(again[key], expected[key]) and torch.equal(first[key], expected[key]), key
    again["features"].zero_()
    assert torch.equal(cached.features(batch)["features"], expected["features"])
    assert forwards == []
    cached.features(batch[:1])  # another batch: computed
    assert forwards == [1]

    tiny = TargetWorker(target, [0, 1, 2], load_config(None, SETTINGS + ["train.feature_cache_gb=1e-9"]).train)
    tiny.model.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    tiny.features(batch), tiny.features(batch)
    assert forwards == [1, 1, 1] and tiny.cache.used == 0

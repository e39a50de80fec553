"""`dflash-ray plan`: each GPU role simulated at the real shape (memory, FLOPs, step time, fits or
refused), GPUs counted from the cluster file, measured rates used as given, the offline-storage
figure, and every preflight a run makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ray.cli import main
from dflash_ray.errors import DFlashError

ROOT = Path(__file__).resolve().parents[1]


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def small_target(tmp_path) -> list[str]:
    """A small target's config.json: the workload's projection, not the 27B's simulation."""
    from transformers import Qwen3Config

    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            Qwen3Config(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
            ).to_dict()
        )
    )
    return [
        "--set",
        f"plan.target_config={path}",
        "--set",
        "tokenize.max_seq_len=512",
        "--set",
        "generate.max_tokens=384",
        "--set",
        "train.length_bucket=64",
    ]


@pytest.mark.slow
def test_plan_counts_the_cluster_gpus_and_projects_the_seed_workload(capsys, small_target):
    out = _plan(capsys, "--cluster", str(ROOT / "cluster.yaml"), "--set", "train.num_streams=8", *small_target)
    # gen_b200 + gen_h200: 4 nodes x 8 GPUs each; train_h200: 2 nodes x 8 GPUs, which 8 paired streams fill
    assert out["generation"]["gpus"] == 64 and out["generation"]["engines"] == 64 and out["training"]["gpus"] == 16
    # every stage's GPUs held from its start to its end; the job sums its stages
    for name in ("generation", "training"):
        assert abs(out[name]["gpu_hours"] - out[name]["wall_hours"] * out[name]["gpus"]) <= 0.01 * out[name]["gpus"]
    assert set(out["stages"]) == {"generation", "tokenization", "training", "evaluation", "export"}
    assert out["job"]["gpu_hours"] == pytest.approx(sum(s["gpu_hours"] for s in out["stages"].values()), abs=0.2)
    assert out["training"]["rate_source"].startswith("simulated step") and "dollars" not in out["job"]
    # 1.87B tokens x the one captured layer (of a 4-layer target) x the target's width (64) x 2 bytes
    assert out["offline_storage_avoided_tb"] == round(1.87e9 * 1 * 64 * 2 / 1e12, 1)
    assert out["offline_storage_note"].startswith("captured layers (1) x hidden 64")
    assert out["target"]["layers"] == 4 and out["target"]["hidden_size"] == 64


def test_every_preset_plans_its_own_target_and_a_fallback_says_so():
    """The presets name their targets, bundled with the project (Qwen3-8B by name or by Hub id);
    a config naming none plans the seed's target with a warning."""
    from dflash_ray.config import load_config
    from dflash_ray.train.shape import drafter_config_of
    from dflash_ray.planning import fallback_warning, target_config, target_summary

    for preset, layers, width in (("qwen3-8b", 36, 4096), ("mix-example", 36, 4096), ("qwen3.6-27b", 64, 5120)):
        cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"), [])
        hf, source = target_config(cfg)
        shape = target_summary(hf, 16.4)
        assert (shape["layers"], shape["hidden_size"]) == (layers, width) and "bundled" in source
        assert fallback_warning(cfg) == []
        drafter_config_of(hf, cfg)  # the preset's drafter builds on its target
    eight = target_config(load_config(str(ROOT / "configs" / "qwen3-8b.yaml"), []))[0]
    assert (eight.num_attention_heads, eight.num_key_value_heads, eight.vocab_size) == (32, 8, 151936)
    bare = load_config(str(ROOT / "configs" / "qwen3-8b.yaml"), ["plan.target_config="])
    assert target_config(bare)[0].num_hidden_layers == 64
    assert "falls back to Qwen/Qwen3.6-27B" in fallback_warning(bare)[0]


@pytest.mark.slow
def test_measured_rates_replace_the_simulated_ones(capsys, small_target):
    out = _plan(
        capsys,
        "--set",
        "plan.training_tokens_per_s_per_gpu=5000",
        "--set",
        "plan.generation_tokens_per_s_per_gpu=400",
        "--set",
        "train.num_streams=4",
        *small_target,
    )
    training, generation = out["training"], out["generation"]
    # the GPUs the layout holds (4 streams of a target and a drafter), not the 16 of plan.training_gpus
    assert training["rate_source"].startswith("measured") and training["gpus"] == 8
    assert training["seconds"]["steps"] * 8 / 3600 == pytest.approx(1.87e9 * 6 / 5000 / 3600, rel=0.01)
    assert generation["rate_source"].startswith("measured")
    busy_s = (generation["wall_hours"] * 3600 - generation["start_s"]) * 32
    assert busy_s == pytest.approx(generation["output_tokens"] / 400, rel=0.01)


@pytest.mark.slow
def test_generation_is_simulated_from_the_engines_settings_and_the_lengths(capsys, small_target, tmp_path):
    """Its time grows with generate.max_tokens (fewer responses cut), follows plan.dataset's lengths
    (a completions dataset; one the dataset shows cut continues past its cut under a larger cap), and
    tensor parallelism makes fewer engines of more GPUs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def generation(*extra: str) -> dict:
        return _plan(capsys, *small_target, *extra)["generation"]

    base = generation()
    longer = generation(
        "--set",
        "generate.max_tokens=1536",
        "--set",
        "generate.max_model_len=2048",
        "--set",
        "tokenize.max_seq_len=2048",
    )
    assert base["lengths"]["response_max"] == 384 and longer["lengths"]["response_max"] == 1536
    assert longer["output_tokens"] > 2 * base["output_tokens"]
    assert longer["wall_hours"] > base["wall_hours"] and longer["gpu_hours"] > base["gpu_hours"]
    engine = base["engine"]
    assert engine["batch"] == 64 and engine["decode_bound"] in ("memory bandwidth", "compute")

    short = tmp_path / "completions.parquet"
    rows = {"num_prompt_tokens": [50, 70] * 50, "num_output_tokens": [100, 300] * 50, "finish_reason": ["stop"] * 100}
    pq.write_table(pa.table(rows), short)
    read = generation("--set", f"plan.dataset={short}")
    assert read["lengths"]["source"].startswith("plan.dataset (completions, 100 rows")
    assert read["lengths"]["response_max"] == 300 and read["lengths"]["prompt_mean"] == pytest.approx(60, abs=2)
    assert read["output_tokens"] < base["output_tokens"] and read["wall_hours"] < base["wall_hours"]
    # a folder as generate leaves it: its rejected answers (here cut at the dataset's own 300 tokens)
    # were written by the engine too, and continue past their cut under the plan's larger cap
    folder = tmp_path / "completions"
    folder.mkdir()
    pq.write_table(pa.table(rows), folder / "completions-0.parquet")
    cut = {"num_prompt_tokens": 60, "num_output_tokens": 300, "finish_reason": "length"}
    (folder / "rejected-0.jsonl").write_text(json.dumps({"id": "a", "kind": "truncated", "record": cut}) + "\n")
    both = generation("--set", f"plan.dataset={folder}")
    assert both["lengths"]["source"].startswith("plan.dataset (completions, 101 rows, 1.0% cut")
    assert both["lengths"]["response_max"] > 300

    split = generation("--set", "generate.tensor_parallel_size=2")
    assert split["engines"] == 16 and split["gpus"] == 32


def test_a_generation_engine_on_a_measured_device_and_its_dtype():
    """The engine model takes any device's peaks (a CPU's measured ones, bench/generation_model.py)
    and the engine's value width: an fp32 engine moves twice the bytes for the same FLOPs."""
    from types import SimpleNamespace

    from dflash_ray.config import GenerateConfig
    from dflash_ray.simulate_generation import engine_of

    text = SimpleNamespace(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64
    )
    cpu = SimpleNamespace(memory_gb=24.0, bandwidth_tbs=0.04, bf16_tflops=0.2)
    g = GenerateConfig(batch_size=16)
    parameters = 134_515_008
    bf16 = engine_of(text, parameters * 2, cpu, g, 0.5)
    fp32 = engine_of(text, parameters * 4, cpu, g, 0.5, value_bytes=4)
    assert bf16.flops_per_token == fp32.flops_per_token == 2 * parameters
    assert bf16.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2 and fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token
    # batch 1 reads the weights (bandwidth-bound); batch 16 on a CPU's low FLOP/byte is compute-bound
    step_1, bound_1 = bf16.step_seconds(1, 100)
    assert bound_1 == "memory bandwidth" and step_1 == pytest.approx((parameters * 2 + 100 * 23040) / 0.02e12)
    assert bf16.step_seconds(16, 1600)[1] == "compute"
    assert fp32.step_seconds(1, 100)[0] == pytest.approx(2 * step_1)


def test_the_job_prices_the_bus_restarts_and_dollars_and_the_traffic_a_layout_sends_across_nodes(capsys, small_target):
    """The drafters' traffic across nodes is in the step at the bus bandwidth (plan.bus_bandwidth,
    else train.min_bus_bandwidth): with the weights sharded over two nodes' ranks (train.layout=fsdp),
    a slower bus, a longer training; a price gives dollars per stage."""
    common = [
        *small_target,
        "--set",
        "train.num_streams=4",
        "--set",
        "train.layout=fsdp",
        "--set",
        "plan.gpus_per_node=4",
        "--set",
        "train.eval_every=100",
        "--set",
        "train.heldout=8",
    ]
    fast = _plan(
        capsys,
        *common,
        "--set",
        "plan.bus_bandwidth=1000",
        "--set",
        "plan.dollars_per_gpu_hour=3.5",
        "--set",
        "plan.failures_per_gpu_hour=0.5",
    )
    slow = _plan(capsys, *common, "--set", "train.min_bus_bandwidth=0.001")
    step = slow["training"]["step"]
    assert step["bound"] == "traffic not hidden" and step["bus_gb_per_s"] == 0.001, step
    assert step["traffic_exposed_share"] > 0.9 and set(step["traffic_gb"]) == {"shard"}, step
    assert slow["training"]["wall_hours"] > fast["training"]["wall_hours"]
    assert any("waits" in w and "drafters' traffic" in w for w in slow["warnings"]), slow["warnings"]
    seconds = fast["training"]["seconds"]
    assert seconds["compile"] > 0 and seconds["evaluations"] > 0 and fast["training"]["checkpoints"] > 0
    assert fast["training"]["expected_restarts"] > 0 and {"weights_load", "restarts"} <= set(seconds)
    assert fast["job"]["dollars"] == pytest.approx(fast["job"]["gpu_hours"] * 3.5, abs=2)
    assert fast["stages"]["generation"]["dollars"] > 0 and "dollars" not in slow["job"]
    assert fast["throughput"]["samples_per_s"] > slow["throughput"]["samples_per_s"]
    assert fast["throughput"]["published"][0]["samples_per_s"] == 10.65


@pytest.mark.slow
def test_plan_prices_the_step_with_one_gpu_and_one_node_lost(capsys, small_target):
    """4 streams on two nodes of 2, hsdp (2 x 2). Under train.lost_streams=stand_in (the global batch
    kept), one GPU lost: 3 placed, 2 and 1 a node; one row of the 2 on one node trains (two passes
    for the 4 streams' batches, as 3 rows of one rank would make) and the third stays idle; one node
    lost: 2 placed, one row of 2, two passes: each step dearer than the calm one. Under shrink (the
    default) every placed rank trains a batch in one pass: 3 rows of one rank, then one row of 2, a
    step about the calm one's and a smaller global batch. Under train.min_streams=3 a lost node
    stops the run, saying so."""
    common = [*small_target, "--set", "train.num_streams=4", "--set", "plan.gpus_per_node=2"]
    common += ["--set", "train.layout=hsdp", "--set", "train.colocate=true", "--set", "train.min_streams=2"]
    out = _plan(capsys, *common, "--set", "train.lost_streams=stand_in")
    training = out["training"]
    calm, lost = training["step"]["step_s"], training["degraded"]
    assert training["layout"]["mesh"] == {"replicas": 2, "shard": 2}
    gpu, node = lost["one_gpu_lost"], lost["one_node_lost"]
    assert (gpu["streams_placed"], gpu["streams_training"], gpu["mesh"]) == (3, 2, {"replicas": 1, "shard": 2})
    assert (node["streams_placed"], node["streams_training"], node["mesh"]) == (2, 2, {"replicas": 1, "shard": 2})
    for case in (gpu, node):
        assert case["goes_on"] and case["fits"] and case["passes"] == 2 and case["step_s"] > calm
        assert case["over_calm"] == pytest.approx(case["step_s"] / calm, rel=0.01)
        assert case["global_batch"] == 4 and case["samples_per_s"] == pytest.approx(4 / case["step_s"], rel=0.01)
    shrunk = _plan(capsys, *common)["training"]["degraded"]
    gpu, node = shrunk["one_gpu_lost"], shrunk["one_node_lost"]
    assert (gpu["streams_training"], gpu["mesh"], gpu["global_batch"]) == (3, {"replicas": 3, "shard": 1}, 3)
    assert (node["streams_training"], node["mesh"], node["global_batch"]) == (2, {"replicas": 1, "shard": 2}, 2)
    for case in (gpu, node):
        assert case["goes_on"] and case["passes"] == 1 and case["over_calm"] < 1.25, case
        assert case["samples_per_s"] == pytest.approx(case["global_batch"] / case["step_s"], rel=0.01)
    strict = _plan(capsys, *common, "--set", "train.min_streams=3")["training"]["degraded"]
    assert strict["one_gpu_lost"]["goes_on"] and strict["one_gpu_lost"]["streams_training"] == 3
    assert not strict["one_node_lost"]["goes_on"] and "train.min_streams=3" in strict["one_node_lost"]["why"]


PRESET = ["--config", str(ROOT / "configs" / "qwen3.6-27b.yaml")]
# the preset with its target and drafter on GPUs of their own, the drafter sharded over all 8 ranks
PAIRED = [
    *PRESET,
    *("--set", "train.colocate=false", "--set", "train.num_streams=8"),
    *("--set", "train.layout=fsdp", "--set", "train.keep_gathered=false"),
]


@pytest.mark.slow
def test_plan_simulates_each_gpu_role_of_the_preset_at_its_real_shape(capsys):
    """Per role: memory by category with a total, FLOPs counted, a step time and whether it fits an
    H200; the target's bf16 27B weights, the drafter's FSDP2 shard beside the frozen head and its
    activations at 12,288 tokens and 512 anchors."""
    out = _plan(capsys, *PAIRED)
    roles = out["roles"]
    assert set(roles) == {"target", "drafter", "generator"} and out["gpu"]["name"] == "H200"
    target, drafter = roles["target"], roles["drafter"]
    assert target["memory_gb"]["parameters"] >= 50 and target["memory_gb"]["gradients"] == 0
    assert drafter["parameters"] > 1.5e9  # the reference drafter, 1.73B
    # an eighth of the fp32 weights, and the bf16 layer gathered at the peak: well under the whole
    assert drafter["memory_gb"]["parameters"] < drafter["parameters"] * 4 / 1e9 / 2
    assert drafter["memory_gb"]["frozen_embedding_and_head"] > 5 and drafter["memory_gb"]["activations"] > 1
    # the steady state: AdamW's two fp32 moments of the rank's shard are alive at the peak
    assert drafter["memory_gb"]["optimizer"] >= round(drafter["parameters"] * 8 / 8 / 1e9, 2) - 0.01
    for role in (target, drafter):
        total = role["memory_gb"]["total"]
        assert abs(total - sum(v for k, v in role["memory_gb"].items() if k != "total")) < 0.05
        assert role["flops_per_step"] > 1e13 and role["step_seconds"] > 0 and role["fits"]
    # the longest sequence costs more than the mean one; DFlash's 512 x 16 block positions cost nearly the same
    assert target["flops_per_step"] > 4 * target["flops_per_step_at_mean"]
    assert drafter["flops_per_step"] < 1.3 * drafter["flops_per_step_at_mean"]
    assert out["shapes"]["longest"]["seq_len"] == 12288 and out["training"]["rate_source"].startswith("simulated")
    assert roles["generator"]["sequences_at_max_model_len"] >= 1 and "estimator" in out


@pytest.mark.slow
def test_plan_refuses_a_role_above_the_gpus_memory(capsys):
    """One stream at 4,096 anchors: its first step fits (130 GB), its warm steps (AdamW's moments
    alive through the forward) do not."""
    one = ("--set", "train.num_streams=1", "--set", "train.min_streams=1")
    error = _refused(capsys, *PAIRED, *one, "--set", "train.num_anchors=4096")
    assert "drafter role" in error and "H200" in error and "train.num_anchors" in error
    assert "GB" in error and "tokenize.max_seq_len" in error and "optimizer 13.8" in error
    peak = float(error.split("needs ")[1].split(" GB")[0])
    assert 135.6 < peak < 150


@pytest.mark.slow
def test_the_drafter_step_is_simulated_warm_with_zero_grad_where_the_worker_puts_it():
    """AdamW's moments are alive at the simulated peak; the worker frees last step's gradients
    before the forward, the code as measured on the H200 kept them (zeroed) through it."""
    from conftest import small_qwen3_config
    from dflash_ray.drafter.config import from_target
    from dflash_ray.simulate import Sample, drafter_step

    target = small_qwen3_config(
        vocab_size=2048,
        hidden_size=1024,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
    )
    dcfg = from_target(target, mask_token_id=2047, num_layers=2, target_layer_ids=[1, 2], sliding_window=64)
    step = dict(num_anchors=256, world=1, tied_head=False, teacher_k=0, distill=0.0, gamma=7.0, length_bucket=64)
    now = drafter_step(dcfg, dcfg.family, Sample(1024, 128), **step)
    kept = drafter_step(dcfg, dcfg.family, Sample(1024, 128), zero_grad_first=False, **step)
    weights = now["parameters"] * 4 / 1e9
    assert now["memory_gb"]["optimizer"] >= round(2 * weights, 2) - 0.01
    assert abs(kept["memory_gb"]["gradients"] - weights) < 0.01
    assert kept["memory_gb"]["total"] > now["memory_gb"]["total"]


@pytest.mark.parametrize("world", [1, 2])
def test_the_peak_only_tracker_finds_the_stock_trackers_peak(world, monkeypatch):
    """The simulation's trackers skip the per-module peaks; the step's peak, by category, is the
    stock tracker's to the byte, for a whole drafter and one sharded over a fake group."""
    from conftest import small_qwen3_config
    from dflash_ray import simulate
    from dflash_ray.drafter.config import from_target

    target = small_qwen3_config()
    dcfg = from_target(target, mask_token_id=511, num_layers=2, target_layer_ids=[1, 2], sliding_window=16)
    step = dict(num_anchors=8, world=world, tied_head=False, teacher_k=0, distill=0.0, gamma=7.0, length_bucket=16)
    trimmed = simulate.peak_only
    peaks: dict[bool, list[dict]] = {False: [], True: []}

    def recording(tracker_class, trim: bool):
        class Recording(trimmed(tracker_class) if trim else tracker_class):  # type: ignore[misc, valid-type]
            def get_tracker_snapshot(self, type="current"):
                out = super().get_tracker_snapshot(type)
                if type == "peak":  # the simulation's one read (the trackers read "current" themselves)
                    peaks[trim].append(out)
                return out

        return Recording

    for trim in (False, True):
        monkeypatch.setattr(simulate, "peak_only", lambda tracker_class: recording(tracker_class, trim))
        simulate.drafter_step(dcfg, dcfg.family, simulate.Sample(64, 16), **step)
        simulate.target_forward(target, [1, 2], simulate.Sample(64, 16), top_k=0)
    assert len(peaks[True]) == 2 and all(peaks[True]) and peaks[True] == peaks[False]


def test_a_targets_attention_is_counted_where_the_flop_counter_sees_none():
    """SDPA on fake CPU tensors has no rule in FlopCounterMode: the causal pairs are counted."""
    from conftest import small_qwen3_config
    from dflash_ray.simulate import Sample, causal_attention_flops, target_forward

    cfg = small_qwen3_config(num_hidden_layers=2)
    attention = 4 * (256 * 257 / 2) * 4 * 16  # a layer's: 4 heads of 16
    linear = 2 * 256 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # a layer's q, o, k, v (2 kv heads), MLP
    assert causal_attention_flops(cfg, 256) == 2 * attention
    # the capture stops after the last captured layer: layer 0's attention only
    assert target_forward(cfg, [0], Sample(256, 64), top_k=0)["flops_per_step"] == linear + attention
    assert target_forward(cfg, [1], Sample(256, 64), top_k=0)["flops_per_step"] == 2 * (linear + attention)


@pytest.mark.slow
def test_dspark_and_dflash2_presets_count_what_their_losses_add():
    """DSpark's target also runs its head for the top-k it sends; DFlash2's drafter walks the head's
    full-vocabulary top-K: the simulation counts them from their code. Each preset's roles at its
    longest sequence, in the layout `auto` takes here (hsdp), as the plan simulates them, fit."""
    from dflash_ray.config import load_config
    from dflash_ray.planning import fitting, samples, sharding_of, simulate_roles, target_config

    def roles(preset: str) -> dict:
        cfg = load_config(str(ROOT / "configs" / preset), ["train.layout=hsdp"])
        hf, _ = target_config(cfg)
        out = simulate_roles(cfg, hf, samples(cfg)[0], sharding=sharding_of(cfg))
        fitting(cfg, out)  # raises for a role past the GPU's room
        return out

    dflash = roles("qwen3.6-27b.yaml")
    for preset in ("qwen3.6-27b-dspark.yaml", "qwen3.6-27b-dflash2.yaml"):
        found = roles(preset)
        assert all(r["fits"] for r in found.values())
        if "dspark" in preset:  # the colocated stream's forward
            assert found["stream"]["target_flops"] > dflash["stream"]["target_flops"]
        else:
            assert found["stream"]["parameters"] > dflash["stream"]["parameters"]  # its convolutions and selector


@pytest.mark.slow
def test_the_simulated_gpu_check_is_within_a_tenth_of_the_h200_measurement():
    """bench.simulate: the GPU check's colocated step (54.5 GB of max_memory_allocated measured on an
    H200 over six steps) simulated warm at its exact shapes by the plan's own code, zero_grad where the
    code measured had it."""
    from bench.simulate import MEASURED, simulate_check

    sim = simulate_check(zero_grad_first=False)
    assert 0.9 <= sim["peak_gb"] / MEASURED["peak_gb"] <= 1.1 and sim["memory_gb"]["optimizer"] > 13
    assert 0.95 <= sim["step_seconds"] / MEASURED["step_seconds"] <= 1.05


@pytest.mark.slow
def test_train_refuses_a_gpu_run_whose_drafter_would_not_fit_before_any_actor(tmp_path):
    import shutil

    import pytest

    from dflash_ray.config import load_config
    from dflash_ray.errors import DFlashError
    from dflash_ray.stages.train import run_train

    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(ROOT / "dflash_ray" / "assets" / "targets" / "qwen3.6-27b.json", target / "config.json")
    cfg = load_config(str(ROOT / "configs" / "qwen3.6-27b.yaml"), ["train.num_anchors=8192"])
    with pytest.raises(DFlashError) as e:  # no weights, no cluster: refused at the desk
        run_train(str(target), str(tmp_path / "data"), str(tmp_path / "out"), cfg, progress=False)
    assert e.value.field == "train.num_anchors" and "stream role" in str(e.value)  # the colocated stream


def test_a_cluster_file_without_stage_node_types_is_refused(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("available_node_types: {head: {resources: {CPU: 0}}}\n")
    assert main(["plan", "--cluster", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


def _refused(capsys, *args: str) -> str:
    assert main(["plan", "--json", *args]) == 2
    return json.loads(capsys.readouterr().out)["error"]


@pytest.mark.slow
def test_plan_runs_every_preflight_a_run_makes(capsys):
    """The preset itself passes, and goes on at about its step with a GPU or a node lost; a bucket that gives its compiled attention more graphs than it may
    hold is refused naming both fields, and so is generation's length rule (which `pipeline` runs)."""
    preset = ["--config", str(ROOT / "configs" / "qwen3.6-27b.yaml")]
    out = _plan(capsys, *preset)
    assert out["warnings"] == []  # its drafters' traffic hides behind their layers (train.layout: hsdp)
    # a GPU lost of 16: two rows of 7 train a batch each in one pass, a step about the calm one's
    calm, gpu = out["training"]["step"]["step_s"], out["training"]["degraded"]["one_gpu_lost"]
    assert gpu["goes_on"] and gpu["mesh"] == {"replicas": 2, "shard": 7} and gpu["step_s"] <= 1.25 * calm, gpu
    assert out["training"]["degraded"]["one_node_lost"]["goes_on"]
    error = _refused(capsys, *preset, "--set", "train.length_bucket=64")
    assert "train.length_bucket=64" in error and "tokenize.max_seq_len=12288" in error and "192 padded" in error
    error = _refused(capsys, *preset, "--set", "generate.max_tokens=16384")
    assert "generate.max_tokens" in error and "tokenize.max_seq_len" in error


def test_train_refuses_a_bucket_past_the_compile_limit_before_any_actor(tmp_path):
    import pytest

    from dflash_ray.config import load_config
    from dflash_ray.errors import DFlashError
    from dflash_ray.stages.train import run_train

    cfg = load_config(str(ROOT / "configs" / "qwen3.6-27b.yaml"), ["train.length_bucket=64"])
    with pytest.raises(DFlashError) as e:  # before Ray is even reached: no cluster in this test
        run_train("no-such-target", str(tmp_path / "data"), str(tmp_path / "out"), cfg, progress=False)
    assert e.value.field == "train.length_bucket" and "tokenize.max_seq_len" in str(e.value)


def test_a_hybrid_target_on_cuda_without_its_fast_kernels_is_refused(tmp_path, monkeypatch):
    """The check a target actor makes at its start, on a CUDA placement: the Gated-DeltaNet kernel
    lookup resolving to transformers' torch fallback is refused naming the package and the setting;
    allowed, it reports what is missing; on the CPU (the fallback is all there is) nothing."""
    import pytest
    from transformers import AutoModelForCausalLM

    from dflash_ray.errors import DFlashError
    from dflash_ray.target_model import fastpath
    from dflash_ray.tiny_models import tiny_qwen3, tiny_qwen35

    hybrid = AutoModelForCausalLM.from_pretrained(tiny_qwen35(tmp_path / "h", vocab_size=512))
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen3(tmp_path / "p", vocab_size=512))
    assert fastpath.linear_attention_layers(hybrid) == 3 and fastpath.linear_attention_layers(plain) == 0
    monkeypatch.setattr(fastpath, "missing_kernels", lambda: ["flash-linear-attention"])
    with pytest.raises(DFlashError) as e:
        fastpath.check(hybrid, "cuda:0", allow_slow=False)
    assert "flash-linear-attention" in str(e.value) and e.value.field == "train.allow_slow_target"
    assert fastpath.check(hybrid, "cuda:0", allow_slow=True) == ["flash-linear-attention"]
    assert fastpath.check(hybrid, "cpu", allow_slow=False) == []
    assert fastpath.check(plain, "cuda:0", allow_slow=False) == []
    monkeypatch.setattr(fastpath, "missing_kernels", lambda: [])
    assert fastpath.check(hybrid, "cuda:0", allow_slow=False) == []


def test_a_target_config_plan_cannot_read_is_one_line_naming_it(tmp_path, capsys):
    """A config.json without `model_type`, with one transformers does not know, and a folder with no
    config.json: each refused naming the file (the folder was a traceback)."""
    (tmp_path / "a.json").write_text('{"hidden_size": 8}')
    (tmp_path / "b.json").write_text('{"model_type": "no-such-model"}')
    (tmp_path / "empty").mkdir()
    for name, says in (("a.json", "needs a `model_type`"), ("b.json", "no-such-model"), ("empty", "config.json")):
        error = _refused(capsys, "--set", f"plan.target_config={tmp_path / name}")
        assert error.startswith(str(tmp_path / name)) and says in error and len(error) < 400


def test_plan_prices_the_cold_start_from_the_storage_rate_and_a_restart_with_its_warm_up():
    """The preset's training around its steps: the node's fetch at `plan.storage_gb_per_s`, each
    GPU's load, every compile; a restart pays a fetch, a load and a warm-up from the saved artifacts."""
    from dflash_ray.config import load_config
    from dflash_ray.simulate import Sample
    from dflash_ray.simulate_job import CACHED_COMPILE_S_PER_SHAPE, plan_training

    def planned(*settings: str) -> dict:
        cfg = load_config(str(ROOT / "configs" / "qwen3.6-27b.yaml"), list(settings))
        step = {"step_s": 0.5}
        return plan_training(cfg, step, Sample(seq_len=3072, prompt_len=300), 1, 54e9, 1_700_000_000, 0.3)

    s3, slow = planned(), planned("plan.storage_gb_per_s=0.1")
    assert s3["seconds"]["weights_fetch"] == 54.0 and slow["seconds"]["weights_fetch"] == 540.0
    assert slow["cold_start_s"] - s3["cold_start_s"] == pytest.approx(486, abs=0.2)
    warm = s3["compiled_shapes"] * CACHED_COMPILE_S_PER_SHAPE
    redone = 500 * 0.5 / 2  # half a checkpoint interval (the preset's 500 steps)
    fetch_and_load = s3["seconds"]["weights_fetch"] + s3["seconds"]["weights_load"]
    assert s3["restart_s"] == pytest.approx(fetch_and_load + warm + redone, abs=0.2), s3
    assert s3["cold_start_s"] == pytest.approx(fetch_and_load + s3["seconds"]["compile"], abs=0.2)
    assert slow["seconds"]["restarts"] > s3["seconds"]["restarts"] > 0


def test_every_plan_number_has_both_bounds_and_an_absurd_value_is_refused_naming_it(capsys):
    """1e-300 GB/s planned a wall time of null with no warning: every number of the section is
    bounded on both sides, refused at the settings before any simulation, naming the field."""
    import dataclasses

    from dflash_ray.config import load_config
    from dflash_ray.settings.plan import PlanConfig

    preset = ["--config", str(ROOT / "configs" / "qwen3.6-27b.yaml")]
    error = _refused(capsys, *preset, "--set", "plan.storage_gb_per_s=1e-300")
    assert "field 'plan.storage_gb_per_s'" in error and "[0.001, 1000]" in error
    numbers = [f for f in dataclasses.fields(PlanConfig) if f.type in ("int", "float")]
    assert len(numbers) == 20
    for f in numbers:
        absurd = ["1" + "0" * 300] if f.type == "int" else ["1e300", "1e-300"]
        for value in absurd:
            with pytest.raises(DFlashError) as e:
                load_config(None, [f"plan.{f.name}={value}"])
            assert e.value.field == f"plan.{f.name}" and "out of range" in str(e.value), (f.name, value)
        load_config(None, [f"plan.{f.name}={getattr(PlanConfig(), f.name)}"])  # the default is in range


def test_a_plan_figure_that_is_no_number_is_refused_naming_the_settings_it_is_figured_from():
    import math

    from dflash_ray.config import load_config
    from dflash_ray.stages.plan import finite

    cfg = load_config(None, ["plan.storage_gb_per_s=0.001"])
    plan = {"training": {"wall_hours": 1.5}, "job": {"wall_hours": 2.0}}
    assert finite(cfg, plan) is plan
    with pytest.raises(DFlashError) as e:
        finite(cfg, {"training": {"wall_hours": math.inf}})
    assert e.value.field == "plan.storage_gb_per_s" and "training.wall_hours comes out inf" in str(e.value)
    with pytest.raises(DFlashError) as e:  # the job sums both stages: every setting of either, defaults too
        finite(load_config(), {"stages": {"evaluation": {"wall_hours": math.nan}}, "job": {}})
    assert e.value.field is None and "plan.generation_roofline_share=0.5" in str(e.value)


def test_a_mean_sample_longer_than_the_targets_context_is_refused(capsys):
    """plan.train_tokens over plan.prompts past the target's context simulated the steps at 1.87e9
    tokens a sample, for hours."""
    error = _refused(capsys, "--set", "plan.prompts=1")
    assert "field 'plan.train_tokens'" in error and "max_position_embeddings=262144" in error


@pytest.mark.parametrize(
    "node, field, says",
    [
        ("{max_workers: 2, resources: {GPU: .inf, gen_node: 1}}", "resources.GPU", "whole number"),
        ("{max_workers: 2, resources: {GPU: .nan, gen_node: 1}}", "resources.GPU", "whole number"),
        ("{max_workers: 2, resources: {GPU: 0.5, gen_node: 1}}", "resources.GPU", "whole number"),
        ("{max_workers: 2, resources: {GPU: true, gen_node: 1}}", "resources.GPU", "whole number"),
        ("{max_workers: 2, resources: {GPU: 1000000, gen_node: 1}}", "resources.GPU", "<= 64"),
        ("{max_workers: 1000000000000, resources: {GPU: 8, gen_node: 1}}", "max_workers", "<= 100000"),
        ("{max_workers: 2.5, resources: {GPU: 8, gen_node: 1}}", "max_workers", "whole number"),
    ],
)
def test_a_cluster_file_takes_whole_gpus_and_workers_in_range_naming_the_key(node, field, says, tmp_path):
    from dflash_ray.planning import cluster_gpus

    path = tmp_path / "cl.yaml"
    path.write_text(
        f"available_node_types:\n  gen: {node}\n  tr: {{max_workers: 2, resources: {{GPU: 8, train_node: 1}}}}\n"
    )
    with pytest.raises(DFlashError, match=says) as e:
        cluster_gpus(str(path))
    assert e.value.file == str(path) and e.value.field == f"available_node_types.gen.{field}"


def test_a_cluster_file_too_deep_too_large_or_no_file_is_refused_naming_it(tmp_path, capsys):
    from dflash_ray.planning import cluster_gpus

    path = tmp_path / "cl.yaml"
    path.write_text("available_node_types: " + "[" * 20000 + "]" * 20000 + "\n")
    assert main(["plan", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cl.yaml" in err and "nested" in err and "internal error" not in err
    many = "{max_workers: 100000, resources: {GPU: 64, %s: 1}}"
    path.write_text(f"available_node_types:\n  gen: {many % 'gen_node'}\n  tr: {many % 'train_node'}\n")
    with pytest.raises(DFlashError, match="1000000") as e:  # 6.4 million GPUs: more than a plan counts
        cluster_gpus(str(path))
    assert e.value.file == str(path)
    with pytest.raises(DFlashError, match="not a regular file"):
        cluster_gpus("/dev/zero")
    path.write_text(
        "available_node_types:\n  gen: {max_workers: 4, resources: {GPU: 8.0, gen_node: 1}}\n"
        "  tr: {max_workers: 2, resources: {GPU: 8, train_node: 1}}\n"
    )
    assert cluster_gpus(str(path)) == (32, 16)  # 8.0 is a whole number

"""Every benchmark with a `main` runs in its smallest form in the suite, so that the command beside a
figure in bench/RESULTS.md still runs: a tiny model or SmolLM2 for a step or two, one prompt, a few
new tokens, in this process (a bench's own subprocesses aside). Each checks that its `--json` output
parses and holds the figures its RESULTS.md section reports. A bench that cannot run here (it needs a
GPU, a vLLM engine or the peers' virtualenvs) runs its CPU form or its `--help`, and its row says why.
A bench module with a `main` that the table does not list fails the suite."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Smoke:
    """A bench's smallest run: its arguments (`{work}`: a small demo workdir, `{tmp}`: a folder of the
    test's own), the figures its --json output must hold (dotted paths into any of its JSON lines),
    the figures that are None by design, and what it needs: `ray` (a local cluster) or `workdir`.
    `help_only`: why it runs its --help alone."""

    argv: tuple[str, ...] = ()
    figures: tuple[str, ...] = ()
    unmeasured: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    help_only: str = ""


DEMO = ("--workdir", "{work}")
SHORT_EVALUATION = ("--set", "evaluate.max_new_tokens=4")  # the demo's 256 new tokens are a minute a prompt
# a few anchors, and fp32: a CPU without AVX512-BF16 emulates the demo's bf16 matmuls, 8x slower; one
# colocated stream: two actors a run, not five (an actor's start, mostly imports, is seconds of CPU)
SMALL_STEPS = ("--set", "train.num_anchors=4", "--set", "train.dtype=float32") + (
    ("--set", "train.num_streams=1", "--set", "train.colocate=true")
)
SETS = ("kept_aside", "unseen")
TABLE: dict[str, Smoke] = {
    "balance": Smoke(
        ("--samples", "256", "--streams", "2"), ("unbalanced", "balanced", "unbalanced_over_balanced", "mean_length")
    ),
    "checkpoint": Smoke(
        ("--hidden", "128", "--layers", "1", "--iters", "1"),
        ("whole_to_rank0_s", "sharded_async_s", "whole_over_sharded", "largest_file_over_state"),
    ),
    "copy_prompts": Smoke(("--count", "3", "--output", "{tmp}/copy.jsonl"), ("passages", "prompts")),
    "demo_step": Smoke(
        ("--repeats", "1", "--tokens", "24", "--set", "train.num_anchors=4", "--set", "train.dtype=float32"),
        tuple(
            f"{case}.{figure}"
            for case in (
                "dspark_loss_recomputed_over_kept",
                "target_forward_over_cache",
                "drafter_step_fp32_over_bf16",
                "block_head_product_over_head_first",
                "hard_label_step_target_distribution_over_skipped",
                "hard_label_target_last_hidden_over_features_alone",
            )
            for figure in ("old_s", "new_s", "ratio")
        ),
    ),
    "dflash2_choices": Smoke(
        ("--steps", "2"),
        ("dflash.heldout_tau", "drop.heldout_tau", "swap.heldout_tau", "drop_undetached.heldout_tau")
        + ("swap.label_in_top_k", "swap.head_argmax_acc", "swap.walk_acc"),
    ),
    # the demo evaluates greedily: the sampled figures are reported as not measured, never divided
    "distill": Smoke(
        (*DEMO, "--steps", "2", *SMALL_STEPS, *SHORT_EVALUATION),
        ("drafter", "distill", "tau", "tau_ngram", "lossless", "ratio", "value"),
        unmeasured=("tau_sampled",),
        needs=("workdir",),
    ),
    "drafters": Smoke(
        ("--steps", "3", "--seq-len", "32", "--anchors", "4"),
        ("together_s", "separate_s", "wall_separate_over_together")
        + ("step_s_together", "step_s_separate", "step_separate_over_together"),
        needs=("ray",),
    ),
    "engine_start": Smoke(help_only="starts four vLLM engines in processes of their own, minutes on 2 cores"),
    "families": Smoke(
        help_only="the whole demo (vLLM generation of the bundled prompts, three drafters trained and evaluated); "
        "its parts run here through distill, drafters and speculative"
    ),
    "first_position": Smoke(
        ("--data", "{work}/tokenized", "--eval", "{work}/prompts-eval", "--unseen", "{work}/prompts-unseen")
        + ("--workdir", "{tmp}/fp", "--steps", "2", "--max-new-tokens", "4")
        + ("--variant", "base:train.num_anchors=4,train.dtype=float32"),
        ("variant", "settings")
        + tuple(f"{s}.{f}" for s in SETS for f in ("tau", "first_position", "by_position", "blocks")),
        needs=("workdir",),
    ),
    "generate": Smoke(help_only="four vLLM and transformers generator fleets on Ray, minutes on 2 cores"),
    "generation_model": Smoke(
        help_only="a vLLM engine started and stepped; the model's side runs in tests/test_plan.py"
    ),
    # the CPU twin of the GPU check (tests/test_gpu_check.py runs every check of it)
    "gpu": Smoke(
        ("--device", "cpu", "--tiny", "--only", "fused_ce", "train_step"),
        ("loss_rel_err", "grad_rel_err", "time_ratio_naive_over_fused", "tokens_per_s", "step_seconds"),
        unmeasured=("mfu",),
    ),
    "handoff": Smoke(
        ("--tokens", "16", "--hidden", "32", "--iters", "1"),
        ("object_store_s", "direct_s", "object_store_over_direct")
        + ("bytes_through_ray_object_store", "bytes_through_ray_direct"),
        needs=("ray",),
    ),
    "loss": Smoke(
        ("--positions", "64", "--error-positions", "32", "--cases", "64x512"),
        ("peak_memory_ratio", "time_ratio", "fused_peak_mb", "naive_peak_mb", "loss_rel_err", "grad_rel_err"),
    ),
    "onesample": Smoke(
        ("--set", "onesample.steps=2", "--set", "onesample.blocks=1"),
        tuple(
            f"{kind}.{figure}"
            for kind in ("intact", "layers_reversed", "other_mask_token", "layers_shifted_by_one")
            for figure in ("accepted_per_block", "feature_drift", "passed")
        ),
    ),
    # ours alone: SpecForge and speculators train in the peers' virtualenvs (bench/peers_install.sh); no
    # kept-aside set: the small workdir's one kept-aside prompt is a training sample's, which it refuses.
    # One seed (a second took the test from 48 s to 84 s): the seed SD is None by design;
    # tests/test_peers_scoring.py checks it and the intervals over seeds
    "peers": Smoke(
        (*DEMO, "--out", "{tmp}/peers", "--trainers", "target", "--seeds", "1", "--steps", "2", "--anchors", "4")
        + ("--batch", "1")  # one stream: three actors, not five
        + ("--max-new-tokens", "4", "--sets", "unseen,unseen_kinds,copy", "--max-prompts", "1"),
        ("trainer", "seeds", "steps", "step_s", "loss", "samples_a_step", "prompts.copy")
        + tuple(f"{f}_{s}" for f in ("tau", "first") for s in ("unseen", "unseen_kinds", "copy"))
        + tuple(f"intervals.target_over_lookup_unseen.{f}" for f in ("ratio", "low", "high", "verdict")),
        unmeasured=tuple(f"sd_{s}" for s in ("unseen", "unseen_kinds", "copy")),
        needs=("workdir", "ray"),
    ),
    "pretrain": Smoke(
        (*DEMO, "--reuse-data", "--steps", "2", "--pretrain-steps", "2", "--arms", "none,prompts", "--sets", "unseen")
        + SMALL_STEPS
        + SHORT_EVALUATION,
        ("arm", "train_loss", "tau_unseen", "first_position_unseen", "tau_ngram_unseen", "pretrain_loss")
        + ("pretrain_tokens", "prompts_over_none_unseen"),
        needs=("workdir", "ray"),
    ),
    "scaling": Smoke(
        (*DEMO, "--reuse-data", "--sizes", "2", "--steps", "2", *SMALL_STEPS, *SHORT_EVALUATION),
        ("samples", "tokens", "steps", "tau_unseen", "first_position", "train_s", "a", "b_per_doubling"),
        unmeasured=("crossing_samples",),
        needs=("workdir", "ray"),
    ),
    "simulate": Smoke(
        (),
        ("simulated_as_measured.peak_gb", "simulated_now.peak_gb", "simulated_as_measured.step_seconds")
        + ("peak_memory_simulated_over_measured", "step_time_simulated_over_measured"),
    ),
    "speculative": Smoke(
        ("--prompts", "1", "--max-new-tokens", "4"),
        ("prompts", "tau", "tau_ngram", "tokens_per_s", "target_tokens_per_s", "speedup", "lossless"),
    ),
    "start": Smoke(
        ("--data", "{work}/tokenized", "--steps", "2", "--heldout", "1", *SMALL_STEPS),
        ("heldout_tau_random", "heldout_tau_target", "target_over_random"),
        needs=("workdir",),
    ),
    "stream": Smoke(help_only="one vLLM engine kept full and run in lock-step, minutes on 2 cores"),
    "tokenize": Smoke(
        ("--samples", "16"),
        ("tokens", "tokens_per_s", "baseline_tokens_per_s", "ratio", "tokens_per_s_per_core", "per_core_vs_seed"),
        needs=("ray",),
    ),
    "topk_mass": Smoke(
        ("--prompts", "1", "--tokens", "4", "--k", "8", "32"),
        tuple(f"by_k.{k}.{q}" for k in (8, 32) for q in ("mean", "p50", "p90", "p99")),
    ),
    "train": Smoke(
        ("--steps", "3", "--seq-len", "32", "--anchors", "4"),
        ("t_target_s", "t_drafter_s", "ideal_steps_per_s", "pipelined_steps_per_s", "sequential_steps_per_s")
        + ("fused_steps_per_s", "pipeline_efficiency", "sequential_efficiency", "fused_ratio"),
        needs=("ray",),
    ),
}


def benches_with_main() -> set[str]:
    return {p.stem for p in (ROOT / "bench").glob("*.py") if re.search(r"^def main\(", p.read_text(), re.M)}


def test_bench_smoke_table_lists_every_bench_with_a_main():
    found = benches_with_main()
    assert len(found) >= 26, found
    assert set(TABLE) == found, f"not in the table: {found - set(TABLE)}; no longer benches: {set(TABLE) - found}"


def test_a_benchs_scratch_folders_go_when_its_process_ends(monkeypatch, tmp_path):
    """Benches write data, checkpoints and drafters into folders of their own (hundreds of MB a run
    for bench.drafters): each takes them from `bench.scratch`, which removes them at the process's
    exit, or removes them itself; none is made with `tempfile.mkdtemp` and left behind."""
    import atexit
    import tempfile

    from bench.scratch import scratch

    at_exit = []
    monkeypatch.setattr(atexit, "register", at_exit.append)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = Path(scratch("bench-x-"))
    (folder / "part-0.parquet").write_bytes(b"x" * 1024)
    assert folder.parent == tmp_path and folder.name.startswith("bench-x-")
    for cleanup in at_exit:  # what the interpreter runs as it exits
        cleanup()
    assert not folder.exists()
    for path in sorted((ROOT / "bench").glob("*.py")):
        text = path.read_text()
        if path.name == "scratch.py" or "rmtree(" in text:  # the helper, or a bench that removes its own
            continue
        for number, line in enumerate(text.splitlines(), 1):
            assert "mkdtemp(" not in line, f"{path.name}:{number}: a scratch folder left behind; use bench.scratch"


def figure(rows: list[dict[str, Any]], path: str) -> Any:
    """The value at `path` (keys joined by dots) in the first JSON line that holds it."""
    for row in rows:
        value: Any = row
        for key in path.split("."):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            return value
    raise AssertionError(f"no {path!r} in the --json output: {rows}")


@pytest.fixture(scope="module")
def demo_workdir(tmp_path_factory) -> str:
    return small_demo_workdir(tmp_path_factory.mktemp("demo-run"))


def small_demo_workdir(work: Path) -> str:
    """What a finished demo's workdir holds that the benches read, from the bundled small prompt set:
    `prompts/` and `tokenized/` (its records' own answers, tokenized for SmolLM2, as the responses
    pipeline makes them), `prompts-eval/` and `prompts-unseen/` (one prompt each). Made in this
    process in seconds: no generation, no Ray."""
    import pyarrow.parquet as pq
    from importlib import resources

    from dflash_ray import manifest, storage
    from dflash_ray.config import load_config
    from dflash_ray.data.masking import TokenizeBatch
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.demo import UNSEEN_FILE, bundled_inputs
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.tokenize import to_table

    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}", f"tokenize.tokenizer={SMOLLM2}"])
    small = bundled_inputs(small=True)
    run_prompts(small, str(work / "prompts"), cfg, progress=False)
    run_prompts(small, str(work / "completions"), cfg, progress=False, responses=True)
    columns, _ = TokenizeBatch(cfg.tokenize)(manifest.read_rows(str(work / "completions"), None, 10_000))
    (work / "tokenized").mkdir()
    pq.write_table(to_table(columns), work / "tokenized" / "part-00000.parquet")
    rows = len(columns["id"])
    manifest.write_manifest(
        str(work / "tokenized"), kind="tokenized", files=[{"name": "part-00000.parquet", "rows": rows}], summary={}
    )
    for name, source in (("eval", small[0]), ("unseen", str(resources.files("dflash_ray.assets") / UNSEEN_FILE))):
        one = work / f"{name}.jsonl"
        one.write_text(storage.read_text(source).splitlines()[0] + "\n")
        run_prompts([str(one)], str(work / f"prompts-{name}"), cfg, progress=False)
    return str(work)


def run_bench(name: str, argv: list[str], capsys) -> tuple[list[dict[str, Any]], str]:
    """`bench.NAME`'s main on `argv` in this process: its JSON lines and its whole stdout. It computes
    on one torch thread whatever it asks for (the suite runs another test file on the other core,
    and two threads on a busy core wait on each other); the environment it sets is given back."""
    import torch

    threads, environment = torch.get_num_threads(), dict(os.environ)
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "set_num_threads", lambda n: None)
            code = importlib.import_module(f"bench.{name}").main(argv)
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environment)
    out = capsys.readouterr().out
    assert code in (None, 0), out[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], out


@pytest.mark.slow  # a model loaded or a run trained: seconds to a minute each (the table's test stays fast)
@pytest.mark.parametrize("name", sorted(TABLE))
def test_bench_smoke(name, request, tmp_path, capsys, monkeypatch):
    smoke = TABLE[name]
    monkeypatch.chdir(ROOT)  # a bench that runs `python -m bench.X` finds the package here
    if smoke.help_only:
        with pytest.raises(SystemExit) as done:
            importlib.import_module(f"bench.{name}").main(["--help"])
        assert done.value.code == 0 and "--json" in capsys.readouterr().out, smoke.help_only
        return
    if "ray" in smoke.needs:
        request.getfixturevalue("ray_cluster")
    work = request.getfixturevalue("demo_workdir") if "workdir" in smoke.needs else ""
    argv = [a.format(work=work, tmp=tmp_path) for a in smoke.argv] + ["--json"]
    rows, out = run_bench(name, argv, capsys)
    assert rows, f"bench.{name} printed no JSON line: {out[-3000:]}"
    for path in smoke.figures:
        assert figure(rows, path) is not None, (path, rows)
    for path in smoke.unmeasured:
        assert figure(rows, path) is None, (path, rows)
    CHECKS.get(name, lambda rows, tmp_path: None)(rows, tmp_path)


def _balance(rows, tmp_path):
    assert figure(rows, "balanced") < figure(rows, "unbalanced")


def _copy_prompts(rows, tmp_path):
    written = [json.loads(x) for x in (tmp_path / "copy.jsonl").read_text().splitlines()]
    assert len(written) == figure(rows, "prompts") == 3 and all(r["messages"][0]["role"] == "user" for r in written)


def _distill(rows, tmp_path):
    drafters = [r for r in rows if "drafter" in r]
    assert [r["drafter"] for r in drafters] == ["hard", "distill", "mix"] and all(r["tau"] >= 1 for r in drafters)
    ratios = {r["ratio"]: r["value"] for r in rows if "ratio" in r}
    assert set(ratios) == {f"{n}_over_hard_{k}" for n in ("distill", "mix") for k in ("tau", "tau_sampled")}
    assert ratios["mix_over_hard_tau_sampled"] is None and ratios["mix_over_hard_tau"] > 0, ratios


def _first_position(rows, tmp_path):
    assert [r["variant"] for r in rows] == ["base", "prompt lookup"], rows


def _peers(rows, tmp_path):
    assert [r["trainer"] for r in rows if "trainer" in r] == ["dflash-ray (target init)", "prompt lookup"]


CHECKS = {
    "balance": _balance,
    "copy_prompts": _copy_prompts,
    "distill": _distill,
    "first_position": _first_position,
    "peers": _peers,
}

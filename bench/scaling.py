"""How a drafter's acceptance on prompts of kinds it never saw grows with its regenerated samples.

The demo's target and drafter (its settings, `stages/demo.py`) on its own pipeline up to the
validation gate, with `--self-prompts` prompts the target writes itself beside the bundled ones;
then, for each size in `--sizes`, a nested subset of the samples (a seeded order, the smaller sizes
inside the larger) trains the drafter afresh for the same `--steps` optimizer steps (so the same
samples seen: the smaller sizes see theirs more often), or with `--epochs E` for E passes over its
own samples (the steps grow with the size, as a real run's would), and the exported drafter is scored by real
speculative decoding on the unseen prompts (`demo_unseen.jsonl` and `bench/unseen_kinds.jsonl`:
never generated for, trained on or tuned on), n-gram prompt lookup beside it. A fit of tau against
log(samples) says where the drafter crosses prompt lookup.

Printed, a row per size: samples, their tokens, tau on the unseen prompts (and per source), the
first draft position's acceptance, seconds of training; then the fit and the crossing. `scaling.png`
(in the work folder) draws it; `--copy-png` also writes it where given (bench/scaling.png).

    .venv/bin/python -m bench.scaling [--workdir DIR] [--sizes 125,250,500,1000] [--steps 500 | --epochs 1]
        [--reuse-data] [--json]

Run it on a target of your own: `--set` takes any setting (`pipeline.target=...`,
`pipeline.inputs=[...]`, `pipeline.unseen_prompts=[...]`), as `dflash-ray pipeline` does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from dflash_ray import manifest, storage

UNSEEN_MORE = str(Path(__file__).with_name("unseen_kinds.jsonl"))


def subset(tokenized: str, out: str, size: int, seed: int) -> dict[str, int]:
    """The first `size` samples of a seeded order of `tokenized`, as a tokenized dataset at `out`
    (nested: a smaller size's samples are all in a larger one's)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.concat_tables(
        pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in manifest.dataset_files(tokenized)
    )
    size = min(size, table.num_rows)  # a largest size past what was generated takes every sample (said in its row)
    ids = table.column("id").to_pylist()
    order = sorted(range(len(ids)), key=lambda i: hashlib.sha256(f"{seed}:{ids[i]}".encode()).hexdigest())
    part = table.take(order[:size])
    sink = io.BytesIO()
    pq.write_table(part, sink)
    storage.write_bytes(storage.join(out, "tokenized-00000.parquet"), sink.getvalue())
    tokens = int(pa.compute.sum(pa.compute.list_value_length(part.column("input_ids"))).as_py())
    summary = {"samples": size, "tokens": tokens}
    files = [{"name": "tokenized-00000.parquet", "rows": size, **manifest.file_entry(sink.getvalue())}]
    manifest.write_manifest(out, kind="tokenized", files=files, summary=summary)
    return summary


def prepare(cfg, progress: bool) -> tuple[Any, dict[str, Any]]:
    """The pipeline's stages before training (self-prompts, prompts, generation, tokenization, the
    gate) on `cfg`; finished outputs of an earlier run with the same settings are reused."""
    from dflash_ray.preflight import preflight
    from dflash_ray.stages import PipelineRun, pipeline_stages
    from dflash_ray.stages.pipeline import with_target_tokenizer

    cfg = with_target_tokenizer(cfg)
    preflight(cfg, generating=True)
    run = PipelineRun(cfg, progress)
    for stage in pipeline_stages():
        if stage.name == "train":
            break
        assert stage.step is not None
        run.summary.update(stage.step(run) or {})
    return run, run.summary


def finished(cfg, progress: bool, folders: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
    """The run over a workdir whose `folders` are finished datasets (a demo's `tokenized/`,
    `prompts-eval/`, ...), read as they are whatever settings made them: no stage runs."""
    from dflash_ray.stages import PipelineRun
    from dflash_ray.stages.pipeline import with_target_tokenizer

    run = PipelineRun(with_target_tokenizer(cfg), progress)
    missing = [f for f in folders if manifest.read_manifest(run.at(f)) is None]
    if missing:
        raise SystemExit(f"--reuse-data: {cfg.pipeline.workdir} has no finished {', '.join(missing)}")
    return run, {}


def one_size(run, size: int, references: dict, progress: bool, epochs: float | None = None) -> dict[str, Any]:
    """Train, export and score the drafter on the first `size` samples (for `epochs` passes over
    them when given, else for `train.max_steps` steps)."""
    import dataclasses

    from dflash_ray.stages.evaluate import first_position, run_evaluate
    from dflash_ray.stages.export import run_export
    from dflash_ray.stages.pipeline import clear_training
    from dflash_ray.stages.train import run_train

    cfg, folder = run.cfg, run.at(f"scaling/n{size}")
    data = subset(run.at("tokenized"), storage.join(folder, "tokenized"), size, cfg.seed)
    if epochs is not None:
        per_step = cfg.train.num_streams * cfg.train.batch_size
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, max_steps=steps_for(epochs, data["samples"], per_step))
        )
    clear_training(storage.join(folder, "train"), cfg)
    started = time.time()
    trained = run_train(
        cfg.pipeline.target, storage.join(folder, "tokenized"), storage.join(folder, "train"), cfg, progress=progress
    )
    train_s = time.time() - started
    run_export(trained["checkpoint"], storage.join(folder, "drafter"), dtype="float32")
    result = run_evaluate(
        storage.join(folder, "drafter"),
        cfg.pipeline.target,
        run.at("prompts-unseen"),
        cfg,
        sampled=False,
        reference_cache=references,
    )
    return {
        "samples": data["samples"],
        "tokens": data["tokens"],
        "steps": trained["step"],
        "epochs": round(trained["step"] * cfg.train.num_streams * cfg.train.batch_size / size, 2),
        "tau_unseen": result["tau"],
        "tau_ngram_unseen": result["tau_ngram"],
        "tau_per_source": result["tau_per_source"],
        "tau_ngram_per_source": result["tau_ngram_per_source"],
        "first_position": first_position(result["acceptance_by_position"]),
        "acceptance_by_position": result["acceptance_by_position"],
        "train_loss": trained["loss"],
        "train_s": round(train_s, 1),
        "lossless": result["lossless"],
    }


def steps_config(work: str, steps: int, overrides: list[str]):
    """The demo's settings for a benchmark in `work` that trains `steps` steps and asks none of the
    demo's gates (`overrides` last)."""
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.demo import demo_config

    return demo_config(
        None,
        [
            f"pipeline.workdir={work}",
            f"pipeline.target={SMOLLM2}",
            "train.epochs=1000",  # the steps decide
            f"train.max_steps={steps}",
            "train.eval_every=0",
            "pipeline.vllm_evaluate=false",
            "pipeline.min_tau_gain=0",  # the bench trains; the demo's gates are not its question
            "pipeline.beat_ngram=false",
            *overrides,
        ],
    )


def steps_for(epochs: float, samples: int, per_step: int) -> int:
    """Optimizer steps that pass over `samples` `epochs` times, `per_step` samples a step."""
    return max(1, math.ceil(epochs * samples / per_step))


def fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """tau = a + b ln(samples) by least squares, and the samples at which it meets prompt lookup's
    tau (None when it does not rise); then the same for each source of unseen prompts (their
    answers differ: lookup is strongest where the target repeats itself)."""
    line = _fit_line(rows, lambda r: r["tau_unseen"], rows[0]["tau_ngram_unseen"])
    line["tau_ngram_unseen"] = line.pop("tau_ngram")
    by_source = rows[0].get("tau_ngram_per_source") or {}
    line["per_source"] = {
        source: _fit_line(rows, lambda r, s=source: r["tau_per_source"][s], ngram)
        for source, ngram in by_source.items()
        if ngram is not None
    }
    return line


def _fit_line(rows: list[dict[str, Any]], tau, ngram: float) -> dict[str, Any]:
    xs = [math.log(r["samples"]) for r in rows]
    ys = [tau(r) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    crossing = math.exp((ngram - a) / b) if b > 0 else None
    largest = max(r["samples"] for r in rows)
    return {
        "a": round(a, 4),
        "b_per_doubling": round(b * math.log(2), 4),
        "tau_ngram": ngram,
        "crossing_samples": None if crossing is None else round(crossing),
        # measured: the largest size already beats lookup; else the fit's extrapolation
        "crossing_measured": any(y > ngram for y in ys),
        "crossing_within_sizes": crossing is not None and crossing <= largest,
    }


def plot(rows: list[dict[str, Any]], line: dict[str, Any], path: str) -> None:
    from dflash_ray.plots import png_figure

    with png_figure(1, (6.5, 4.2)) as (_, (ax,), buf):
        xs = [r["samples"] for r in rows]
        ax.plot(xs, [r["tau_unseen"] for r in rows], "o-", label="drafter (unseen kinds)", color="#1f77b4")
        ax.axhline(line["tau_ngram_unseen"], color="#c0504d", linestyle="--", label="prompt lookup")
        # the fit drawn to the crossing, or to 100x the largest size when the crossing lies past that
        crossing = line["crossing_samples"]
        near = crossing is not None and crossing <= 100 * max(xs)
        top = crossing * 1.3 if near else max(xs) * 100
        grid = [min(xs) * (top / min(xs)) ** (i / 50) for i in range(51)]
        ax.plot(
            grid,
            [line["a"] + line["b_per_doubling"] / math.log(2) * math.log(x) for x in grid],
            ":",
            color="gray",
            label="fit a + b ln n",
        )
        if near:
            ax.axvline(crossing, color="gray", alpha=0.4)
        for (source, own), color in zip(line.get("per_source", {}).items(), ("#2ca02c", "#9467bd", "#8c564b")):
            ax.plot(xs, [r["tau_per_source"][source] for r in rows], ".-", color=color, alpha=0.7, label=source)
            ax.axhline(own["tau_ngram"], color=color, linestyle=":", alpha=0.7, label=f"lookup, {source}")
        ax.set_xscale("log")
        ax.set(xlabel="regenerated samples", ylabel="acceptance length (tau)", title="tau on prompts of unseen kinds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    storage.write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="scaling-run", help="work folder (its generation is reused)")
    parser.add_argument("--sizes", default="125,250,500,1000", help="samples per run, comma-separated")
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps of every run")
    parser.add_argument(
        "--epochs", type=float, help="passes over each size's samples instead (steps grow with the samples)"
    )
    parser.add_argument(
        "--self-prompts", type=int, default=1400, help="candidates the target writes (selfprompt.count)"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--copy-png", metavar="PATH", help="also write the plot here")
    parser.add_argument(
        "--reuse-data",
        action="store_true",
        help="read the workdir's tokenized/ and prompts-unseen/ as they are (a finished demo's): no self-prompting or "
        "generation",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from importlib import resources

    from dflash_ray.cli import summary_stdout
    from dflash_ray.stages.demo import DEMO_FILES, UNSEEN_FILE

    sizes = sorted(int(s) for s in args.sizes.split(","))
    assets = resources.files("dflash_ray.assets")
    work = str(Path(args.workdir).absolute())
    cfg = steps_config(
        work,
        args.steps,
        [
            f"pipeline.inputs=[{','.join(str(assets / f) for f in DEMO_FILES)}]",
            f"pipeline.unseen_prompts=[{assets / UNSEEN_FILE},{UNSEEN_MORE}]",
            f"selfprompt.count={args.self_prompts}",
            "train.heldout=0",
            *args.overrides,
        ],
    )
    started = time.time()
    storage.require_folder(work)
    with summary_stdout(args.json) as out:  # Ray's worker logs to stderr: stdout holds the rows alone
        if args.reuse_data:
            run, data = finished(cfg, not args.json, ("tokenized", "prompts-unseen"))
        else:
            run, data = prepare(cfg, progress=not args.json)
        references: dict = {}  # the target's own outputs on the unseen prompts, decoded once
        rows = []
        for size in sizes:
            rows.append(one_size(run, size, references, progress=not args.json, epochs=args.epochs))
            shown = json.dumps(rows[-1]) if args.json else "  ".join(f"{k}={v}" for k, v in rows[-1].items())
            print(shown, file=out, flush=True)
    line = fit(rows)
    figure = storage.join(work, "scaling.png")
    plot(rows, line, figure)
    if args.copy_png:
        plot(rows, line, args.copy_png)
    done = {
        **line,
        "samples_generated": data.get("samples"),
        "self_prompts": data.get("self_prompts"),
        "generation_s": run.timings.get("generate"),
        "plot": figure,
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps(done) if args.json else "  ".join(f"{k}={v}" for k, v in done.items()))


if __name__ == "__main__":
    main()

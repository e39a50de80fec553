"""Hard labels against online distillation from the target's own distribution, and their mix, at
equal steps and data: real acceptance length on prompts kept out of everything, greedy and sampled.

The drafters train side by side on the same batches with the same anchors (one drafter worker each,
the production `train_step`), on the features and top-k distributions of one SmolLM2 target worker;
then each is exported and evaluated with real speculative decoding (`dflash-ray evaluate`'s code) on
a pipeline's kept-aside prompts. Needs a demo or pipeline workdir (its `tokenized/` and
`prompts-eval/`).

    .venv/bin/python -m bench.distill --workdir demo-run [--steps 400] [--json]

Prints one line per drafter, then one ratio per line (distillation or mix over hard labels). The demo
evaluates greedily (`evaluate.temperature=0`): the sampled figures and their ratios are then None, not
measured; `--set evaluate.temperature=0.6` measures them.
"""

from __future__ import annotations

import argparse
import json
import tempfile

VARIANTS = {"hard": 0.0, "distill": 1.0, "mix": 0.5}


def ratio(value: float | None, base: float | None) -> float | None:
    """`value / base`, or None (not measured) when either is: the sampled figures exist only when the
    evaluation samples (`evaluate.temperature` above 0; the demo's settings are greedy only)."""
    return round(value / base, 4) if value is not None and base else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="a demo or pipeline workdir (file:// or s3://)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more settings")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch
    from bench.side_by_side import train_side_by_side
    from dflash_ray import storage
    from dflash_ray.stages.demo import DFLASH_SETTINGS, demo_config
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.stages.evaluate import run_evaluate
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.train.shape import drafter_config, drafter_init
    from dflash_ray.train.schedule import Schedule, dataset_samples
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    # the demo's settings with its one-layer DFlash drafter (the one measured in bench/RESULTS.md); the
    # target worker sends its top-k whenever any variant distills
    base = demo_config(None, [*DFLASH_SETTINGS, "train.torch_threads=2", *args.set])
    cfgs = {
        name: demo_config(None, [*DFLASH_SETTINGS, "train.torch_threads=2", *args.set, f"train.distill={share}"])
        for name, share in VARIANTS.items()
    }
    samples = dataset_samples(storage.join(args.workdir, "tokenized"))
    schedule = Schedule(samples, 1, args.batch, base.train.seed)
    dcfg = drafter_config(SMOLLM2, base)
    target = TargetWorker(SMOLLM2, dcfg["dflash_config"]["target_layer_ids"], cfgs["distill"].train)
    init = drafter_init(SMOLLM2, base)
    drafters = {name: DrafterWorker(SMOLLM2, json.dumps(dcfg), init, cfg.train, 0, 1) for name, cfg in cfgs.items()}
    train_side_by_side(target, drafters, schedule, args.steps, "train all")

    rows, references = {}, {}  # the target's own outputs, decoded once for all drafters
    for name, worker in drafters.items():
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(worker.drafter.cpu(), tmp, dtype=torch.float32)
            out = run_evaluate(
                tmp, SMOLLM2, storage.join(args.workdir, "prompts-eval"), base, reference_cache=references
            )
        rows[name] = {
            "drafter": name,
            "distill": VARIANTS[name],
            "steps": args.steps,
            "batch": args.batch,
            "samples": len(samples),
            "prompts": out["prompts"],
            "tau": out["tau"],
            "tau_sampled": out["tau_sampled"],
            "sampling": out["sampling"],
            "tau_ngram": out["tau_ngram"],
            "lossless": out["lossless"],
        }
        print(json.dumps(rows[name]), flush=True)
    for name in ("distill", "mix"):
        for key in ("tau", "tau_sampled"):
            print(json.dumps({"ratio": f"{name}_over_hard_{key}", "value": ratio(rows[name][key], rows["hard"][key])}))


if __name__ == "__main__":
    main()

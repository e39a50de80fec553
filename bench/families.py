"""The three drafter families side by side on the demo's data: DFlash, DFlash2 and DSpark trained by
one demo run from one target pass (`train.drafters`), so they see the same batches for the same
steps from the same start, then each evaluated on the demo's kept-aside prompts at `--max-new-tokens`
new tokens, greedy and sampled, with n-gram prompt lookup beside it.

Printed, a row per family: tau greedy and sampled, prompt lookup's tau at the same draft count, the
ratio of each family's greedy tau to DFlash's, acceptance by draft position, the median step time
and the drafter's parameter count (embedding and head are the target's). `families.png` in the work
folder plots acceptance by position. The demo's generated data is reused when `--workdir` holds it.

    .venv/bin/python -m bench.families [--workdir DIR] [--max-new-tokens 256] [--num-layers 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from dflash_ray import storage

# the published shapes of DFlash2 and DSpark (blocks of 8 and 7, top-16 selector) with the
# low-rank parts scaled to a small drafter of a 576-wide target; DFlash keeps its block 16 (the demo's before)
FAMILIES = [
    {"name": "dflash", "drafter": "dflash", "block_size": 16},
    {
        "name": "dflash2",
        "drafter": "dflash2",
        "block_size": 8,
        "family": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_top_k": 16, "selector_rank": 64},
    },
    {"name": "dspark", "drafter": "dspark", "block_size": 7, "family": {"markov_rank": 64}},
]


def plot(results: dict[str, dict], path: str) -> None:
    from matplotlib.ticker import MaxNLocator

    from dflash_ray.plots import png_figure

    with png_figure(2, (11, 3.6)) as (_, axes, buf):
        for ax, key, title in zip(
            axes, ("acceptance_by_position", "acceptance_by_position_sampled"), ("greedy", "sampled")
        ):
            for name, result in results.items():
                rates = result[key]
                ax.plot(
                    range(1, len(rates) + 1),
                    [r if r is not None else float("nan") for r in rates],
                    marker="o",
                    label=f"{name} (tau {result['tau_trained' if title == 'greedy' else 'tau_trained_sampled']})",
                )
            ax.set(
                title=f"acceptance by draft position, {title}",
                xlabel="draft position",
                ylabel="accepted | every earlier one accepted",
                ylim=(0, 1),
            )
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    storage.write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="demo-run", help="the demo's work folder (its generation is reused)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=1, help="every family's drafter layers")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dflash_ray.drafter.export import load_drafter
    from dflash_ray.stages.demo import demo_config, run_demo

    teams = json.dumps(FAMILIES).replace('"', "")
    # 2 streams of a target and three drafter actors on the demo's 2 CPUs
    cfg = demo_config(
        None,
        [
            f"train.drafters={teams}",
            f"train.num_layers={args.num_layers}",
            "train.actor_cpus=0.25",
            f"evaluate.max_new_tokens={args.max_new_tokens}",
            "pipeline.min_tau_gain=0",
            "pipeline.beat_ngram=false",
            "pipeline.vllm_evaluate=false",
        ],
    )
    summary = run_demo(args.workdir, cfg, progress=not args.json)
    base = summary["drafters"]["dflash"]["tau_trained"]
    rows = []
    for name, result in summary["drafters"].items():
        metrics = [
            json.loads(x)
            for x in storage.read_text(storage.join(summary["workdir"], "train", name, "metrics.jsonl")).splitlines()
        ]
        params = sum(p.numel() for p in load_drafter(result["drafter"]).parameters())
        rows.append(
            {
                "family": name,
                "steps": summary["training_steps"],
                "new_tokens": args.max_new_tokens,
                "tau": result["tau_trained"],
                "tau_sampled": result["tau_trained_sampled"],
                "tau_ngram": result["tau_ngram"],
                "tau_over_dflash": round(result["tau_trained"] / base, 3),
                "heldout_tau_start": result["heldout_tau_start"],
                "step_s": round(statistics.median(m["step_seconds"] for m in metrics[2:]), 3),
                "params_m": round(params / 1e6, 2),
                "acceptance_by_position": result["acceptance_by_position"],
                "acceptance_by_position_sampled": result["acceptance_by_position_sampled"],
            }
        )
    figure = storage.join(summary["workdir"], "families.png")
    plot(summary["drafters"], figure)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
    print(json.dumps({"plot": figure}) if args.json else f"plot: {figure}")


if __name__ == "__main__":
    main()

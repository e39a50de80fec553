"""What the one-sample gate sees: drafts accepted per block, intact and with one convention broken
on the training side, side by side on the packaged SmolLM2 (a one-layer DFlash drafter, 4-token
blocks). Each line is the broken chain's acceptance over the intact one's (1.0: acceptance alone
cannot see the break) and the served features' largest difference from the trained ones.

    .venv/bin/python -m bench.onesample [--set KEY=VALUE] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
from typing import Iterator

from dflash_ray.config import load_config
from dflash_ray.errors import GateFailed
from dflash_ray.registry import SMOLLM2


@contextlib.contextmanager
def broken(kind: str) -> Iterator[None]:
    """One convention changed on the training side (or in the export) for the block's duration."""
    from dflash_ray.drafter import export
    from dflash_ray.target_model import capture

    captured, saved = capture.target_outputs, export.save_drafter

    def layers(change):
        return lambda model, ids, layer_ids, **kw: captured(model, ids, change(layer_ids), **kw)

    def other_mask(drafter, folder, **kw):
        out = saved(drafter, folder, **kw)
        path = pathlib.Path(folder) / "config.json"
        config = json.loads(path.read_text())
        nested = config.get("dflash_config") or {}
        (nested if "mask_token_id" in nested else config)["mask_token_id"] -= 1
        path.write_text(json.dumps(config))
        return out

    if kind == "layers_reversed":
        capture.target_outputs = layers(lambda ids: ids[::-1])
    elif kind == "layers_shifted_by_one":
        capture.target_outputs = layers(lambda ids: [i + 1 for i in ids])
    elif kind == "other_mask_token":
        export.save_drafter = other_mask
    try:
        yield
    finally:
        capture.target_outputs, export.save_drafter = captured, saved


def main(argv: list[str] | None = None) -> int:
    from dflash_ray.stages.onesample import run_onesample

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more settings (onesample.steps=2: a smoke run)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = load_config(None, ["train.num_layers=1", "train.block_size=4", *args.set])
    accepted = {}
    for kind in ("intact", "layers_reversed", "other_mask_token", "layers_shifted_by_one"):
        with broken(kind):
            try:
                summary = run_onesample(SMOLLM2, cfg)
            except GateFailed as e:
                summary = e.summary
        accepted[kind] = {
            "accepted_per_block": summary["accepted_per_block"],
            "feature_drift": summary["feature_drift"],
            "passed": summary["passed"],
        }
    for kind, figures in accepted.items():
        if kind != "intact":
            intact = accepted["intact"]["accepted_per_block"]
            # an intact chain that accepts nothing (too few steps to memorize) gives no ratio
            ratio = f"{figures['accepted_per_block'] / intact:.3f}" if intact else "none"
            verdict = "passes" if figures["passed"] else "fails"
            print(f"{kind}_over_intact: {ratio} (feature drift {figures['feature_drift']:.3g}, gate {verdict})")
    if args.json:
        print(json.dumps(accepted))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

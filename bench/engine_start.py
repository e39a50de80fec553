"""A CPU vLLM engine's start and first greedy pass with its engine core in the caller's process
against a process of its own (vLLM's default), side by side in one run, alternating.

Each case is one fresh `python -m dflash_ray.drafter.vllm_check` process (what evaluation runs):
import, engine start, a few greedy prompts. The in-process engine imports vLLM and torch once.

    .venv/bin/python -m bench.engine_start [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _one(target: str, prompts_file: str, multiprocessing: str) -> float:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ray.drafter.vllm_check",
            "--target",
            target,
            "--prompts-json",
            prompts_file,
            "--max-tokens",
            "16",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if "VLLM_RESULT " not in done.stdout:
        raise SystemExit(done.stderr[-3000:])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from dflash_ray.registry import SMOLLM2, resolve

    target = resolve(SMOLLM2)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, f)
    seconds: dict[str, list[float]] = {"own_process": [], "in_process": []}
    try:
        for _ in range(args.rounds):  # alternating, so a noisy minute hits both
            seconds["own_process"].append(_one(target, f.name, "1"))
            seconds["in_process"].append(_one(target, f.name, "0"))
    finally:
        os.unlink(f.name)
    best = {k: min(v) for k, v in seconds.items()}
    ratio = round(best["own_process"] / best["in_process"], 2)
    if args.json:
        print(json.dumps({"bench": "engine_start", "seconds": seconds, "own_over_in_process": ratio}))
    else:
        print(
            f"own_over_in_process {ratio}  (best of {args.rounds}: {best['own_process']:.1f} s against "
            f"{best['in_process']:.1f} s)"
        )


if __name__ == "__main__":
    main()

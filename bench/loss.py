"""Fused linear + weighted CE against the naive reference (full fp32 logits), side by side.

Each implementation runs forward + backward in a fresh subprocess; its peak memory is the highest
resident set a sampling thread sees above the resident set once the inputs exist. Errors (loss and gradient, relative to the
reference) are measured in one process on the same inputs, at `--error-positions` rows.

    .venv/bin/python -m bench.loss [--positions 8192] [--cases 576x49152,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CASES = "576x49152,1024x49152,576x151936,1024x151936"  # hidden x vocabulary: SmolLM2's and Qwen3's heads


def _inputs(n: int, hidden: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    head = torch.randn(vocab, hidden, generator=g) * hidden**-0.5  # frozen, as in training
    labels = torch.randint(0, vocab, (n,), generator=g)
    k = torch.arange(n) % 16
    weights = torch.where(k > 0, torch.exp(-(k - 1) / 7.0), torch.zeros(()))
    return h, head, labels, weights


def _loss_fn(impl: str):
    if impl == "naive":
        from dflash_ray.drafter.loss import naive_loss

        return naive_loss
    from dflash_ray.kernels.fused_ce import fused_linear_weighted_ce

    return fused_linear_weighted_ce


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_one(impl: str, n: int, hidden: int, vocab: int) -> dict:
    import threading

    import torch

    torch.set_num_threads(2)
    h, head, labels, weights = _inputs(n, hidden, vocab)
    fn = _loss_fn(impl)
    base = _rss()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    loss, _ = fn(h, head, labels, weights)
    loss.backward()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return {"seconds": seconds, "peak_bytes": max(peak[0] - base, 1)}


def errors(n: int, hidden: int, vocab: int) -> tuple[float, float]:

    out = {}
    for impl in ("naive", "fused"):
        h, head, labels, weights = _inputs(n, hidden, vocab)
        loss, _ = _loss_fn(impl)(h, head, labels, weights)
        loss.backward()
        out[impl] = (loss.detach(), h.grad)
    (l_ref, g_ref), (l, g) = out["naive"], out["fused"]
    return (abs(l - l_ref) / abs(l_ref)).item(), ((g - g_ref).abs().max() / g_ref.abs().max()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--error-positions", type=int, default=2048)
    parser.add_argument("--cases", default=CASES, help="HIDDENxVOCAB, comma-separated")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", nargs=4, metavar=("IMPL", "N", "H", "V"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        impl, n, h, v = args.one
        print(json.dumps(run_one(impl, int(n), int(h), int(v))))
        return
    for hidden, vocab in (map(int, case.split("x")) for case in args.cases.split(",")):
        res = {}
        for impl in ("fused", "naive"):
            done = subprocess.run(
                [sys.executable, "-m", "bench.loss", "--one", impl, str(args.positions), str(hidden), str(vocab)],
                capture_output=True,
                text=True,
            )
            res[impl] = json.loads(done.stdout) if done.returncode == 0 else None
        loss_err, grad_err = errors(args.error_positions, hidden, vocab)
        row = {
            "case": f"N{args.positions}_H{hidden}_V{vocab}",
            "positions": args.positions,
            "hidden": hidden,
            "vocab": vocab,
            "loss_rel_err": loss_err,
            "grad_rel_err": grad_err,
            "error_positions": args.error_positions,
        }
        if res["naive"] and res["fused"]:
            row.update(
                peak_memory_ratio=round(res["fused"]["peak_bytes"] / res["naive"]["peak_bytes"], 4),
                time_ratio=round(res["fused"]["seconds"] / res["naive"]["seconds"], 3),
                fused_peak_mb=round(res["fused"]["peak_bytes"] / 2**20),
                naive_peak_mb=round(res["naive"]["peak_bytes"] / 2**20),
                fused_s=round(res["fused"]["seconds"], 2),
                naive_s=round(res["naive"]["seconds"], 2),
            )
        else:
            row["note"] = "the naive reference ran out of memory" if res["fused"] else "failed"
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()

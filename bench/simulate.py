"""The plan's simulation against the one GPU measurement there is: the GPU check's colocated training
step on an H200 (bench/RESULTS.md, 2026-11-30: Qwen3.6-27B's width with six target layers, the
reference drafter, 512 anchors, block 16, 3,072-token sequences; 0.369 s a step, and 54.5 GB of
`torch.cuda.max_memory_allocated` over six steps, the target's weights included), simulated at
those exact shapes by `dflash-ray plan`'s own code (`planning.simulate_roles`).

    .venv/bin/python -m bench.simulate [--json]

What is compared: the measured figure is the caching allocator's peak of live tensors over six
steps, so it holds AdamW's moments (made at the first step) and sees neither the CUDA context nor
fragmentation. The simulation's steady-state step is run twice: as the worker's code was when it was
measured (b9fea40: `zero_grad(set_to_none=False)` after the forward, so the previous step's gradients
were alive, zeroed, through the next forward) -- the figure the ratio is taken on -- and as the
worker's code is now (`zero_grad(set_to_none=True)` before the forward), a prediction no GPU has
checked yet. The step time's utilisation is calibrated on this very measurement, so its ratio shows
the calibration holds, not an independent check; the memory's is independent.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

MEASURED = {
    "peak_gb": 54.5,  # torch.cuda.max_memory_allocated over 2 warm-up and 4 timed steps
    "step_seconds": 0.369,
    "gpu": "H200",
    "date": "2026-11-30",
    "code": "b9fea40: zero_grad(set_to_none=False) after the forward",
}


def check_config(
    folder: Path,
    *,
    hidden: int = 5120,
    intermediate: int = 17408,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    vocab: int = 248320,
    target_layers: int = 6,
    layer_ids: list[int] | None = None,
    drafter_layers: int = 5,
    sliding_window: int = 2048,
    anchors: int = 512,
    seq_len: int = 3072,
    length_bucket: int = 512,
):
    """The GPU check's colocated stream as a run config (its target's config.json written to
    `folder`): one GPU, the drafter after the target's forward, a quarter of each sequence prompt."""
    from transformers import Qwen3Config

    from dflash_ray.config import load_config

    target = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=target_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=True,
    )
    path = folder / "config.json"
    path.write_text(json.dumps(target.to_dict()))
    layer_ids = layer_ids or list(range(1, target_layers))
    types = ["sliding_attention"] * (drafter_layers - 1) + ["full_attention"]
    return load_config(
        None,
        [
            f"plan.target_config={path}",
            "train.colocate=true",
            "train.num_streams=1",
            "train.actor_gpus=1",
            f"train.num_layers={drafter_layers}",
            f"train.layer_types={json.dumps(types)}",
            f"train.sliding_window={sliding_window}",
            f"train.target_layer_ids={json.dumps(layer_ids)}",
            "train.init=random",
            f"train.num_anchors={anchors}",
            f"train.length_bucket={length_bucket}",
            f"train.mask_token_id={vocab - 1}",
            f"tokenize.max_seq_len={seq_len}",
            f"generate.max_tokens={seq_len - seq_len // 4}",
            "generate.max_model_len=" + str(seq_len),
        ],
    )


def simulate_check(zero_grad_first: bool = True, **shape) -> dict:
    """The simulated steady-state peak (GB) and step seconds of the GPU check's colocated step at
    `shape`; `zero_grad_first=False`: the worker's code as it was measured."""
    from dflash_ray.planning import samples, simulate_roles, target_config

    with tempfile.TemporaryDirectory() as tmp:
        cfg = check_config(Path(tmp), **shape)
        hf, _ = target_config(cfg)
        longest, _ = samples(cfg)
        stream = simulate_roles(cfg, hf, longest, zero_grad_first=zero_grad_first)["stream"]
    return {
        "peak_gb": stream["memory_gb"]["total"],
        "memory_gb": stream["memory_gb"],
        "step_seconds": stream["step_seconds"],
        "tflops_per_step": round(stream["flops_per_step"] / 1e12, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    as_measured = simulate_check(zero_grad_first=False)
    now = simulate_check()
    ratios = {
        "peak_memory_simulated_over_measured": round(as_measured["peak_gb"] / MEASURED["peak_gb"], 3),
        "step_time_simulated_over_measured": round(as_measured["step_seconds"] / MEASURED["step_seconds"], 3),
    }
    for name, value in ratios.items():
        print(f"{name}: {value}")
    print(f"peak with the worker's code as measured: {as_measured['peak_gb']} GB; as it is now: {now['peak_gb']} GB")
    if args.json:
        print(json.dumps({"simulated_as_measured": as_measured, "simulated_now": now, "measured": MEASURED, **ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

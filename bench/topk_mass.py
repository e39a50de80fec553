"""How much DSpark's target distribution loses to its top-k: the target's probability mass outside
its top-k at the positions a drafter trains on, on the target's own answers.

DSpark's total-variation loss and confidence label use the target's top-k (`train.distill_top_k`),
renormalized. For any drafter distribution q, the TV against the renormalized top-k differs from the
TV against the whole distribution p by at most the mass m outside the top-k (|Σ_top |q - p/(1-m)| -
Σ_top |q - p|| <= m and |Σ_rest q - Σ_rest |q - p|| <= m, halved and summed), and the confidence
label (1 - TV) by the same. So the mass outside the top-k bounds the bias, whatever the drafter.

The packaged SmolLM2-135M-Instruct answers the demo's prompts (sampled at temperature 0.6, as the
presets regenerate), then its whole next-token distribution at every answer position is read.

    .venv/bin/python -m bench.topk_mass [--prompts 32] [--tokens 96] [--k 32] [--json]
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

import torch


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from dflash_ray.registry import load_tokenizer, resolve

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, nargs="*", default=[8, 32, 64])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    path = resolve("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lines = resources.files("dflash_ray.assets").joinpath("demo_mix.jsonl").read_text().splitlines()
    outside = {k: [] for k in args.k}
    with torch.no_grad():
        for line in lines[: args.prompts]:
            messages = [m for m in json.loads(line)["messages"] if m["role"] != "assistant"]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
            out = model.generate(
                ids,
                do_sample=True,
                temperature=0.6,
                top_p=0.95,
                max_new_tokens=args.tokens,
                pad_token_id=tok.eos_token_id,
            )
            probs = model(out).logits[0, ids.shape[1] - 1 : -1].float().softmax(-1)  # the answer's positions
            for k in args.k:
                outside[k] += (1 - probs.topk(k, -1).values.sum(-1)).tolist()
    figures = {}
    for k, values in outside.items():
        t = torch.tensor(values)
        figures[k] = {
            "positions": len(values),
            "mean": round(float(t.mean()), 4),
            "p50": round(float(t.quantile(0.5)), 4),
            "p90": round(float(t.quantile(0.9)), 4),
            "p99": round(float(t.quantile(0.99)), 4),
        }
        print(f"top{k}_mass_outside_mean: {figures[k]['mean']}")
    if args.json:
        print(json.dumps({"target": "smollm2-135m-instruct", "temperature_sampled": 0.6, "by_k": figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

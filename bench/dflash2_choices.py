"""DFlash2's two loss choices on a motif dataset: a true token outside the top-K dropped from the
selector's CE or swapped in for the weakest candidate, and the selector's inputs detached or not.

Sequences are random concatenations of a few fixed motifs (distinct tokens), so inside a motif every
token follows from the anchor, and after a motif boundary only the token drafted before tells which
motif the block went on with: the case the selector's pairwise term is for. Context features come
from a tiny random Qwen3 target; every variant trains from the same start on the same anchors, then
scores held-out sequences with the same anchors (simulated tau of the selector's walk, which under
greedy verification is the walk until its first miss). DFlash with the same backbone is the baseline.

    .venv/bin/python -m bench.dflash2_choices [--steps 200] [--json]
"""

from __future__ import annotations

import argparse
import json

from bench.scratch import scratch


def motif_sequences(num: int, length: int, num_motifs: int, motif_len: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    motifs = torch.randperm(400, generator=g)[: num_motifs * motif_len].view(num_motifs, motif_len)
    picks = torch.randint(0, num_motifs, (num, -(-length // motif_len)), generator=g)
    return motifs[picks].flatten(1)[:, :length]


def run(steps: int, seed: int = 0, skip: tuple[str, ...] = ()) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_ray.drafter import dflash2, families
    from dflash_ray.drafter.config import from_target
    from dflash_ray.target_model.capture import load_embed_and_head, target_outputs
    from dflash_ray.tiny_models import tiny_qwen3

    torch.set_num_threads(2)
    path = tiny_qwen3(scratch("bench-dflash2-"), num_layers=4, hidden_size=64, vocab_size=512, seed=3)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    seqs = motif_sequences(40, 96, num_motifs=12, motif_len=5, seed=seed)
    layer_ids = [0, 1, 2]
    feats = target_outputs(target, seqs, layer_ids)[0]
    mask = torch.ones_like(seqs)
    held = slice(32, 40)  # rows 0..31 train
    variants = {
        "dflash": ("dflash", {}),
        "drop": ("dflash2", {"rule": "drop", "detach_selector": True}),
        "swap": ("dflash2", {"rule": "swap", "detach_selector": True}),
        "drop_undetached": ("dflash2", {"rule": "drop", "detach_selector": False}),
    }
    variants = {k: v for k, v in variants.items() if k not in skip}
    results = {}
    for name, (family_name, options) in variants.items():
        cfg = from_target(
            target.config,
            mask_token_id=511,
            num_layers=1,
            target_layer_ids=layer_ids,
            block_size=8,
            family=family_name,
            settings={"selector_rank": 32, "selector_top_k": 8} if family_name == "dflash2" else None,
        )
        family = families.get(family_name)
        torch.manual_seed(seed)
        drafter = family.build(cfg)
        opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            rows = torch.randperm(32, generator=g)[:8]  # the same minibatches for every variant
            out = family.forward_loss(
                drafter, embed, head, feats[rows], seqs[rows], mask[rows], num_anchors=16, generator=g, **options
            )
            opt.zero_grad()
            out.loss.loss.backward()
            opt.step()
        with torch.no_grad():
            out = family.forward_loss(
                drafter,
                embed,
                head,
                feats[held],
                seqs[held],
                mask[held],
                num_anchors=64,
                generator=torch.Generator().manual_seed(1),
                **options,
            )
        results[name] = {"heldout_tau": round(float(out.tau.mean()), 3)}
        print(name, results[name], flush=True)
        if family_name == "dflash2":
            with torch.no_grad():  # how often the walk's label was among the candidates at all
                blk = out.blocks
                from dflash_ray.drafter.forward import attention_masks
                import torch.nn.functional as F

                h = drafter(
                    feats[held],
                    F.embedding(blk.token_ids, embed),
                    blk.positions,
                    attention_masks(drafter, blk.anchors, seqs.shape[1], "sdpa"),
                )
                ids = dflash2.top_candidates(h.reshape(-1, cfg.hidden_size), head, cfg.settings.selector_top_k)
                valid = blk.weights.reshape(-1) > 0
                found = (ids == blk.labels.reshape(-1, 1)).any(-1)
                argmax = (h.reshape(-1, cfg.hidden_size) @ head.t()).argmax(-1) == blk.labels.reshape(-1)
            results[name]["label_in_top_k"] = round(float(found[valid].float().mean()), 3)
            results[name]["head_argmax_acc"] = round(float(argmax[valid].float().mean()), 3)
            results[name]["walk_acc"] = round(float(out.loss.correct.reshape(-1)[valid].float().mean()), 3)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", nargs="*", default=[], help="variants to leave out (e.g. dflash)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = run(args.steps, args.seed, tuple(args.skip))
    if args.json:
        print(json.dumps(results))
    else:
        for name, r in results.items():
            print(f"{name:>14}  " + "  ".join(f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()

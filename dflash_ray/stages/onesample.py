"""`dflash-ray onesample`: will the served drafter see what the trainer saw? Found in minutes.

A drafter of the run's own `train` settings (family, shape, captured layers, init) is trained on one
answer of the target's own until it has memorized it, exported, loaded back as a server loads it,
and run on that answer's prompt with real speculative decoding. A drafter that has memorized the
sequence is accepted almost whole by any correct chain of train → export → serve; anything less is
a convention that differs somewhere in it (the captured layers off by one, a RoPE or mask position,
a thinking template, how blocks are assembled, verified and advanced) that a good training loss
hides. The target's features that decoding gives the served drafter must also equal, token for
token, those training gave it: a memorized sample can be accepted on the features of a neighbouring
layer, and this says so directly. With `--engine vllm` (where vLLM serves the family) vLLM's own
acceptance of the export on the same prompt must agree with ours.

The check runs in one process on one device, with no Ray and no data: the target's answer is
decoded greedily here, so the drafter learns exactly what it will be asked to draft.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from typing import Any

from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError, GateFailed
from dflash_ray.stages import Stage

PROMPT = "Explain in two sentences why the sky is blue."
# features decoded step by step (a KV cache) against one whole forward: the same up to float rounding
FEATURE_TOLERANCE = 1e-3


def _prompt_ids(tokenizer, text: str, enable_thinking: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, enable_thinking=enable_thinking
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def overfit(
    drafter,
    family,
    embed_VH,
    head_VH,
    features_1SF,
    ids_1S,
    mask_1S,
    teacher,
    *,
    steps: int,
    lr: float,
    seed: int,
    settle: int = 3,
) -> tuple[list[float], list[float]]:
    """AdamW on every anchor of the one sample until every drafted position is predicted right for
    `settle` steps in a row (memorized; a loss with terms that never reach 0, as DSpark's, cannot say
    so); the losses and the top-1 accuracies."""
    import torch

    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    accuracies: list[float] = []
    for _ in range(steps):
        out = family.forward_loss(
            drafter,
            embed_VH,
            head_VH,
            features_1SF,
            ids_1S,
            mask_1S,
            num_anchors=ids_1S.shape[1],
            generator=generator,
            attention="sdpa",
            teacher=teacher,
            length_bucket=1,
        )
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
        valid = out.blocks.weights > 0
        losses.append(float(out.loss.loss.detach()))
        accuracies.append(float((out.loss.correct & valid).sum() / valid.sum().clamp_min(1)))
        if not math.isfinite(losses[-1]) or (len(accuracies) >= settle and min(accuracies[-settle:]) == 1.0):
            break
    return losses, accuracies


def _target_answer(model, prompt: list[int], drafts: int, ocfg, eos: set[int]) -> list[int]:
    """The target's own greedy answer, cut to whole blocks: the prefill's token, then blocks of the
    drafts and the target's own token. A memorized answer ends on a block, so this project's count
    and vLLM's are of the same steps."""
    from dflash_ray.drafter.speculative import target_decode

    length = len(prompt) + 1 + ocfg.blocks * (drafts + 1)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and length > positions:
        raise DFlashError(
            f"{ocfg.blocks} blocks of {drafts + 1} tokens after a {len(prompt)}-token prompt make {length} "
            f"positions, past the target's {positions}",
            field="onesample.blocks",
        )
    answer = target_decode(model, prompt, 1 + ocfg.blocks * (drafts + 1), eos).token_ids
    answer = answer[: 1 + (len(answer) - 1) // (drafts + 1) * (drafts + 1)]
    if len(answer) < drafts + 2:
        raise DFlashError(
            f"the target's answer ends before one whole block of {drafts} drafts: give a prompt with a longer answer",
            field="onesample.prompt",
        )
    return answer


def _serve(
    summary: dict[str, Any],
    drafter,
    family,
    model,
    target_dir: str,
    embed,
    head,
    features,
    prompt: list[int],
    answer: list[int],
    eos: set[int],
    engine: str,
) -> None:
    """The drafter exported and loaded back as a server loads it, then decoded with: what it
    accepts, whether the output is the target's, and how far the features it was served are from
    those it was trained on."""
    import torch

    from dflash_ray.drafter.export import load_drafter, save_drafter
    from dflash_ray.drafter.speculative import speculative_decode

    with tempfile.TemporaryDirectory(prefix="dflash-onesample-") as folder:
        save_drafter(drafter, folder, dtype=torch.float32)  # what a server loads
        served = load_drafter(folder).eval()
        with torch.no_grad():
            spec = speculative_decode(model, served, embed, head, prompt, len(answer), eos)
        summary["tau"] = round(sum(spec.acceptance) / len(spec.acceptance), 4)
        summary["accepted_per_block"] = round(summary["tau"] - 1, 4)  # drafts accepted per verify step
        summary["lossless"] = spec.token_ids == answer
        # the features decoding gave the served drafter against those training gave it, same tokens: a
        # layer taken off by one or in another order differs here even where a memorized sample hides it
        assert spec.context is not None  # speculative decoding keeps them
        trained = features[:, : spec.context.shape[1]]
        drift = float((spec.context - trained).abs().max() / trained.abs().max().clamp_min(1e-12))
        summary["feature_drift"] = round(drift, 6)
        if engine == "vllm":
            _serve_vllm(summary, family, target_dir, folder, prompt, answer)


def _serve_vllm(
    summary: dict[str, Any], family, target_dir: str, folder: str, prompt: list[int], answer: list[int]
) -> None:
    """vLLM's own acceptance of the same export on the same prompt: the gate holds it to ours."""
    import torch

    from dflash_ray.drafter.vllm_check import vllm_decode

    if not family.vllm_on_cpu and not torch.cuda.is_available():
        raise DFlashError(
            f"vLLM serves {family.name} on a GPU only: run it there, or without --engine vllm", field="--engine"
        )
    result = vllm_decode(target_dir, folder, [prompt], len(answer))
    summary["tau_vllm"] = result["acceptance_length"]
    summary["vllm_outputs_equal"] = result["outputs"] == [answer]


def _failures(summary: dict[str, Any], ocfg, drafts: int, engine: str) -> list[str]:
    """Each way the gate fails, said with what to change where a setting can help."""
    failed = []
    if summary["accuracy"] < 1.0:
        failed.append(
            f"the drafter did not memorize the sample: {summary['accuracy']:.1%} of its predictions right "
            f"after {summary['steps']} steps (raise onesample.steps or onesample.lr)"
        )
    if not summary["lossless"]:
        failed.append("speculative output differs from the target's own")
    if summary["feature_drift"] > FEATURE_TOLERANCE:
        failed.append(
            f"the target's features served to the drafter differ from those it was trained on (by "
            f"{summary['feature_drift']:.3g} of their largest value): the captured layers, their order or "
            "their positions differ between training and serving"
        )
    if summary["accepted_per_block"] < summary["accepted_required"]:
        failed.append(
            f"{summary['accepted_per_block']} drafts accepted per block, below "
            f"{summary['accepted_required']} ({ocfg.min_share} x {drafts} drafts) on the sample it memorized"
        )
    vllm_tau = summary.get("tau_vllm")
    if engine == "vllm" and (vllm_tau is None or abs(vllm_tau - summary["tau"]) > ocfg.vllm_tolerance * summary["tau"]):
        failed.append(f"vLLM accepts {vllm_tau} where this project's decoding accepts {summary['tau']}")
    return failed


def run_onesample(target: str, cfg: RunConfig, *, engine: str = "hf") -> dict[str, Any]:
    """Overfit, export, serve and verify (see the module docstring); `GateFailed` (exit 3) unless
    the served drafter is accepted almost whole (`onesample.min_share` of its drafts per block) and
    losslessly."""
    import torch

    from dflash_ray import hf_load
    from dflash_ray.drafter import families
    from dflash_ray.drafter.export import from_hf_config
    from dflash_ray.drafter.init import initial_drafter
    from dflash_ray.train.shape import drafter_config, drafter_init
    from dflash_ray.registry import load_tokenizer, resolve, stop_token_ids
    from dflash_ray.target_model.capture import load_embed_and_head, target_outputs

    ocfg = cfg.onesample
    started = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    serving = drafter_config(target, cfg)  # the run's drafter, checked against the target first
    target_dir = resolve(target)
    tokenizer = load_tokenizer(target)
    model = hf_load.causal_lm(target_dir, dtype=torch.float32).eval()
    eos = set(stop_token_ids(tokenizer))
    prompt = _prompt_ids(tokenizer, ocfg.prompt or PROMPT, cfg.evaluate.enable_thinking)

    drafter = initial_drafter(from_hf_config(serving), target_dir, drafter_init(target, cfg), cfg.train.seed)
    family = families.get(drafter.cfg.family)
    drafts = drafter.cfg.block_size - family.first_prediction
    answer = _target_answer(model, prompt, drafts, ocfg, eos)
    # in the float32 the target runs in here, as training casts them to its compute dtype (a bf16
    # product on a CPU without bf16 units takes seconds a step)
    embed, head = (t.float() for t in load_embed_and_head(target_dir))
    ids = torch.tensor([prompt + answer])
    mask = torch.zeros_like(ids)
    mask[0, len(prompt) :] = 1
    with torch.no_grad():
        features, _, _, hidden = target_outputs(
            model, ids, drafter.cfg.target_layer_ids, last_hidden=drafter.cfg.settings.wants_target_distribution()
        )
    losses, accuracies = overfit(
        drafter, family, embed, head, features, ids, mask, hidden, steps=ocfg.steps, lr=ocfg.lr, seed=cfg.train.seed
    )

    summary: dict[str, Any] = {
        "stage": "onesample",
        "target": target,
        "family": family.name,
        "prompt_tokens": len(prompt),
        "answer_tokens": len(answer),
        "steps": len(losses),
        "loss_start": round(losses[0], 4),
        "loss_end": round(losses[-1], 4),
        "accuracy": round(accuracies[-1], 4),
        "drafts_per_block": drafts,
        "accepted_required": round(ocfg.min_share * drafts, 3),
    }
    _serve(summary, drafter, family, model, target_dir, embed, head, features, prompt, answer, eos, engine)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    failed = _failures(summary, ocfg, drafts, engine)
    summary["passed"] = not failed
    if failed:
        raise GateFailed(
            "one-sample gate failed: " + "; ".join(failed) + ". A memorized sample must be accepted "
            "whole: some convention differs between training and serving"
        ).with_summary(summary)
    return summary


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="vllm: vLLM's acceptance must agree too")


STAGES = (
    Stage(
        name="onesample",
        help="overfit a drafter of the train settings on one answer; serving must accept it whole",
        command=lambda args, cfg: run_onesample(args.target, cfg, engine=args.engine),
        arguments=_arguments,
        section="onesample",
        order=80,
    ),
)

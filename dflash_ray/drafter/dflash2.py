"""The DFlash2 family: the DFlash backbone with a grouped dynamic convolution around every sublayer,
and a candidate selector over the target head's top-K (z-lab / Inco AI; served by vLLM 0.32 as
`DFlash2DraftModel`, `qwen3_dflash2.py`).

Shapes: B sequences, S positions, A anchor slots, K block size, Q = A*K queries, H hidden, V vocab,
T taps, G groups of g = conv_group_size channels, r selector rank, C candidates (selector_top_k),
D = K - 1 drafts.

Block, positions and labels are DFlash's: `[x_a, MASK x K-1]`, position k predicts x[a+k], k = 0 is
no prediction. Each attention and MLP sublayer runs inside a convolution pair: with u the normed
sublayer input, δ = kernel_projection(u) viewed [2, T, G]; the sublayer reads conv₀(u) and the
residual receives conv₁(sublayer output), where conv_s(x)[i, c] = Σ_t (base[s, t, c] + δ[i, s, t, c//g])
· x[i-t, c], a tap t counting only when i - t is in the same block. Identity start (vLLM applies the
kernel as is, no residual around it): base tap 0 = 1, other taps 0, kernel_projection = 0, so an
untrained DFlash2 computes exactly what DFlash does with the same backbone weights.
vLLM takes the convolution's block as 1 + `num_speculative_tokens`: serve with block_size - 1 drafts,
or the taps are masked at other positions than in training.

Candidate selector: per drafted position, the target head's top-C tokens with their logits as unary
scores; predecessor p → candidate c scores `unary[c] + Σ_r A[p, r] · (W h)_r · B[c, r]` (A, B the
predecessor and successor codebooks, W the hidden projection, h the final-normed hidden state). The
walk starts at the verified anchor and takes the best candidate given the one chosen before (greedy),
or samples from the softmax over the C scores (q is zero off the candidates, so speculative sampling
stays exact). W starts at zero: untrained, the walk is DFlash's argmax.

Loss: DFlash's (weighted CE over the full vocabulary, trains backbone and convolutions) plus a C-way
CE for the selector with the TRUE previous token as predecessor, on the same position weights. A true
token outside the top-C: `MISSING_TRUE_TOKEN` "drop" leaves that row out of the selector's CE (it
cannot be drafted there, and the DFlash CE already pushes it up); "swap" puts it in place of the
weakest candidate, with its own logit as unary. On the motif set of `bench/dflash2_choices.py`
(200 steps, one seed, 512 held-out anchors) the simulated tau was 3.13 with drop, 3.20 with swap and
3.11 for DFlash alone: swap learned a little better, within what one seed tells apart, and drop stays
the default until more seeds say otherwise. The selector's inputs (hidden state and unary logits)
are detached (`DETACH_SELECTOR_INPUTS`): the selector re-ranks candidates the backbone proposes, its
CE through the unary logits only repeats the DFlash CE's push on the label, and through the hidden
state it pulled the backbone around: on the tiny worker test, undetached unit-scale codebooks made
the total loss jump mid-run (5.9 to 10.0) where the detached run fell smoothly (8.5 to 6.0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ray.drafter import families
from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.drafter.loss import LossOutput, acceptance_lengths, dflash_loss
from dflash_ray.drafter.model import DecoderLayer, DFlashDrafter, head_logits
from dflash_ray.drafter.speculative import Sampling, warp
from dflash_ray.drafter.forward import ForwardOutput, attention_masks, draft_blocks

MISSING_TRUE_TOKEN = "drop"  # or "swap" (see the module docstring)
DETACH_SELECTOR_INPUTS = True
MAX_CHUNK_LOGITS = 2**26  # fp32 logits per top-C chunk: [Q, V] never exists at once
CODEBOOK_STD = 1.0  # unit-scale codebooks: with W = 0 at the start, W's first steps set the pair term's size


@dataclass(frozen=True, kw_only=True)
class Settings(families.Settings):
    conv_kernel_size: int = 2  # taps T of the grouped convolution around each sublayer
    conv_group_size: int = 16  # channels g sharing one dynamic kernel offset (divides hidden_size)
    selector_rank: int = 256  # rank r of the candidate selector's codebooks [V, r]
    selector_top_k: int = 16  # candidates C per block position (the target head's top-C)
    selector_weight: float = 1.0  # the selector's CE beside the DFlash CE in the loss

    minimum = {
        "conv_kernel_size": 1,
        "conv_group_size": 1,
        "selector_rank": 1,
        "selector_top_k": 1,
        "selector_weight": 0,
    }

    def check(self, cfg: DrafterConfig) -> None:
        if cfg.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {cfg.hidden_size}")
        if not 1 <= self.selector_top_k <= cfg.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} outside 1..vocab_size {cfg.vocab_size}")


class GroupedConv(nn.Module):
    """The convolution pair around one sublayer: `base_kernel` [2, T, H], `kernel_projection` H → 2·T·G."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.group_size, self.block_size = taps, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1
        nn.init.zeros_(self.kernel_projection.weight)

    def deltas(self, u_BQH: torch.Tensor) -> torch.Tensor:
        """The dynamic kernel offsets [B, Q, 2, T, G] of the normed sublayer input."""
        return self.kernel_projection(u_BQH).unflatten(-1, (2, self.taps, self.num_groups))

    def convolve(self, x_BQH: torch.Tensor, delta_BQTG: torch.Tensor, side: int) -> torch.Tensor:
        """Σ_t (base + δ)·x[i - t] within each block of `block_size` consecutive queries."""
        B, Q, H = x_BQH.shape
        x = x_BQH.unflatten(-1, (self.num_groups, self.group_size))  # [B, Q, G, g]
        coef = self.base_kernel[side].view(self.taps, self.num_groups, self.group_size) + delta_BQTG[..., None]
        in_block_Q = torch.arange(Q, device=x.device) % self.block_size
        out = coef[:, :, 0] * x
        for t in range(1, min(self.taps, Q)):
            shifted = F.pad(x[:, :-t], (0, 0, 0, 0, t, 0))
            out = out + coef[:, :, t] * shifted * (in_block_Q >= t).view(1, Q, 1, 1)
        return out.flatten(-2).to(x_BQH.dtype)

    def around(self, sublayer, u_BQH: torch.Tensor) -> torch.Tensor:
        delta = self.deltas(u_BQH)
        return self.convolve(sublayer(self.convolve(u_BQH, delta[:, :, 0], 0)), delta[:, :, 1], 1)


class DFlash2Layer(DecoderLayer):
    not_in_target = ("attention_conv.", "mlp_conv.")  # `init.init_from_target` leaves them at identity

    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        args = (cfg.hidden_size, cfg.settings.conv_kernel_size, cfg.settings.conv_group_size, cfg.block_size)
        self.attention_conv = GroupedConv(*args)
        self.mlp_conv = GroupedConv(*args)

    def forward(self, x, ctx, rope_q, rope_kv, mask):
        attend = lambda u: self.self_attn(u, ctx, rope_q, rope_kv, mask)  # noqa: E731
        x = x + self.attention_conv.around(attend, self.input_layernorm(x))
        return x + self.mlp_conv.around(self.mlp, self.post_attention_layernorm(x))


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        nn.init.normal_(self.predecessor_codebook, std=CODEBOOK_STD)
        nn.init.normal_(self.successor_codebook, std=CODEBOOK_STD)
        nn.init.zeros_(self.hidden_projection.weight)

    def pair_scores(
        self, hidden_NH: torch.Tensor, pred_ids_NP: torch.Tensor, cand_ids_NC: torch.Tensor
    ) -> torch.Tensor:
        """Σ_r A[p, r]·(W h)_r·B[c, r] [N, P, C] (float32)."""
        wh = self.hidden_projection(hidden_NH).float()
        pred = self.predecessor_codebook[pred_ids_NP].float() * wh[:, None]
        return torch.einsum("npr,ncr->npc", pred, self.successor_codebook[cand_ids_NC].float())

    def edge_scores(
        self, hidden_DH: torch.Tensor, anchor: int, cand_ids_DC: torch.Tensor, unary_DC: torch.Tensor
    ) -> torch.Tensor:
        """Every edge of the walk [D, C, C]: row p of position l scores candidate p of position l - 1
        (the anchor, repeated, at l = 0) followed by each candidate of position l."""
        first = torch.full_like(cand_ids_DC[:1], anchor)
        pred = torch.cat([first, cand_ids_DC[:-1]])
        return unary_DC.float()[:, None] + self.pair_scores(hidden_DH, pred, cand_ids_DC)


class DFlash2Drafter(DFlashDrafter):
    layer_cls = DFlash2Layer

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(
            cfg.hidden_size, cfg.vocab_size, cfg.settings.selector_rank, cfg.settings.selector_top_k
        )

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)  # draws every Linear, the kernel projections among them: undo that
        for layer in cast("list[DFlash2Layer]", self.layers):
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        if hasattr(self, "candidate_selector"):
            self.candidate_selector.reset()


@torch.no_grad()
def top_candidates(hidden_NH: torch.Tensor, head_VH: torch.Tensor, top_k: int) -> torch.Tensor:
    """The target head's top-C token ids [N, C], in row chunks."""
    chunk = max(1, MAX_CHUNK_LOGITS // head_VH.shape[0])
    return torch.cat(
        [(h.to(head_VH.dtype) @ head_VH.t()).float().topk(top_k, -1).indices for h in hidden_NH.split(chunk)]
    )


def place_labels(cand_ids_NC: torch.Tensor, labels_N: torch.Tensor, rule: str):
    """The candidates the selector's CE runs over, each row's label index, and which rows count:
    a missing label is dropped, or swapped in for the weakest (last) candidate."""
    hit = cand_ids_NC == labels_N[:, None]
    found = hit.any(-1)
    target = hit.long().argmax(-1)
    if rule == "drop":
        return cand_ids_NC, target, found, found
    if rule != "swap":
        raise ValueError(f"missing-token rule '{rule}' is unknown; valid: drop, swap")
    ids = cand_ids_NC.clone()
    ids[~found, -1] = labels_N[~found]
    return ids, torch.where(found, target, ids.shape[1] - 1), torch.ones_like(found), found


def selector_loss(
    selector: CandidateSelector,
    hidden_NH: torch.Tensor,
    head_VH: torch.Tensor,
    prev_N: torch.Tensor,
    labels_N: torch.Tensor,
    weights_N: torch.Tensor,
    rule: str = MISSING_TRUE_TOKEN,
    detach: bool = DETACH_SELECTOR_INPUTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The C-way CE of the selector given the true previous token, and its hits [N] (label found
    among the real candidates and scored best)."""
    if detach:
        hidden_NH = hidden_NH.detach()
    ids, target, counted, found = place_labels(top_candidates(hidden_NH, head_VH, selector.top_k), labels_N, rule)
    unary = torch.einsum("nh,nch->nc", hidden_NH.to(head_VH.dtype), head_VH[ids]).float()
    scores = unary + selector.pair_scores(hidden_NH, prev_N[:, None], ids)[:, 0]
    ce = F.cross_entropy(scores, target, reduction="none")
    w = weights_N.float() * counted
    return (ce * w).sum() / w.sum().clamp_min(1e-12), found & (scores.argmax(-1) == target)


def forward_loss(
    drafter: DFlash2Drafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    features_BSF: torch.Tensor,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    *,
    num_anchors: int,
    generator: torch.Generator | None = None,
    attention: str = "sdpa",
    fused: bool = True,
    gamma: float | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    distill: float = 0.0,
    length_bucket: int = 1,
    rule: str = MISSING_TRUE_TOKEN,
    detach_selector: bool = DETACH_SELECTOR_INPUTS,
    anchor_seeds: torch.Tensor | None = None,
) -> ForwardOutput:
    """DFlash's training forward (its blocks, weights, distillation and padding) plus the selector's
    CE; hits and the simulated tau are the selector walk's with true predecessors, which is the
    greedy walk up to its first miss."""
    cfg = drafter.cfg
    drafted = draft_blocks(
        drafter,
        embed_VH,
        features_BSF,
        input_ids_BS,
        loss_mask_BS,
        num_anchors=num_anchors,
        generator=generator,
        attention=attention,
        gamma=gamma,
        teacher=teacher,
        distill=distill,
        length_bucket=length_bucket,
        anchor_seeds=anchor_seeds,
    )
    hidden, blocks, input_ids_BS = drafted.hidden_BQH, drafted.blocks, drafted.input_ids_BS
    B, S = input_ids_BS.shape
    backbone = dflash_loss(
        hidden,
        head_VH,
        blocks.labels,
        blocks.weights,
        fused=fused,
        soft_ids_BQm=blocks.soft_ids,
        soft_probs_BQm=blocks.soft_probs,
    )
    prev = torch.gather(input_ids_BS, 1, (blocks.positions - 1).clamp(0, S - 1))  # k = 0 carries no weight
    sel, correct = selector_loss(
        drafter.candidate_selector,
        hidden.reshape(-1, cfg.hidden_size),
        head_VH,
        prev.reshape(-1),
        blocks.labels.reshape(-1),
        blocks.weights.reshape(-1),
        rule,
        detach_selector,
    )
    out = LossOutput(backbone.loss + cfg.settings.selector_weight * sel, correct.view(B, -1), backbone.weight_sum)
    return ForwardOutput(out, blocks, acceptance_lengths(out.correct, blocks.weights, blocks.keep, cfg.block_size))


def walk(
    edges_DCC: torch.Tensor, cand_ids_DC: torch.Tensor, vocab_size: int, sampling: Sampling
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The selector's walk from the anchor: drafts [D] and, when sampled, q [D, V] (zero off the
    candidates), each row the distribution its draft was drawn from given the drafts before it."""
    argmax = sampling.greedy or sampling.greedy_drafts
    prev, drafts, qs = 0, [], []  # the anchor's row: every row of position 0 is the anchor's
    for scores, ids in zip(edges_DCC, cand_ids_DC):
        if argmax:
            prev = int(scores[prev].argmax())
        else:
            q_C = warp(scores[prev], sampling.temperature, sampling.top_p)
            qs.append(q_C.new_zeros(vocab_size).scatter_(0, ids, q_C))
            prev = int(torch.multinomial(q_C, 1, generator=sampling.generator))
        drafts.append(ids[prev])
    return torch.stack(drafts), None if argmax else torch.stack(qs)


class DFlash2:
    name = "dflash2"
    architecture = "DFlash2DraftModel"
    vllm_method = "dflash"  # vLLM tells the two apart by the architecture
    first_prediction = 1
    vllm_on_cpu = False  # vLLM's model for it runs on its GPU (V2) runner only
    hf_keys = frozenset({"dflash_config"})
    Settings = Settings
    _own_keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # vLLM reads these

    def build(self, cfg: DrafterConfig) -> DFlash2Drafter:
        return DFlash2Drafter(cfg)

    def forward_loss(self, drafter, *args, **kwargs) -> ForwardOutput:
        return forward_loss(drafter, *args, **kwargs)

    @torch.no_grad()
    def propose(
        self,
        drafter: DFlash2Drafter,
        context_1nF: torch.Tensor,
        last_token: int,
        embed_VH: torch.Tensor,
        head_VH: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K - 1 drafts: one backbone pass as DFlash's, the top-C per position, then the walk."""
        cfg = drafter.cfg
        device, n, K = context_1nF.device, context_1nF.shape[1], cfg.block_size
        dtype = next(drafter.parameters()).dtype
        block_ids = torch.full((1, K), cfg.mask_token_id, device=device)
        block_ids[0, 0] = last_token
        positions = torch.arange(n, n + K, device=device)[None]
        masks = attention_masks(drafter, torch.tensor([[n]], device=device), n, "sdpa")
        hidden = drafter(context_1nF.to(dtype), F.embedding(block_ids, embed_VH).to(dtype), positions, masks)[0, 1:]
        unary, ids = head_logits(hidden, head_VH).float().topk(cfg.settings.selector_top_k, -1)
        edges = drafter.candidate_selector.edge_scores(hidden, last_token, ids, unary)
        return walk(edges, ids, head_VH.shape[0], sampling)

    def hf_config(self, cfg: DrafterConfig) -> dict:
        own = {key: getattr(cfg.settings, key) for key in self._own_keys}
        return {
            "architectures": [self.architecture],
            "dflash_config": {
                "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids),
                **own,
            },
        }

    def read_hf_config(self, data: dict) -> dict:
        """Its `dflash_config` (`from_hf_config` has checked the fields every family shares)."""
        from dflash_ray.drafter.config_checks import MAX_BLOCK, MAX_RANK, Fields

        nested = Fields(data).section("dflash_config")
        hidden, vocab = data["hidden_size"], data["vocab_size"]
        group = nested.whole("conv_group_size", 1, hidden)
        if hidden % group:
            raise nested.bad("conv_group_size", f"a divisor of hidden_size {hidden}", group)
        return {
            "mask_token_id": nested.data["mask_token_id"],
            "target_layer_ids": list(nested.data["target_layer_ids"]),
            "settings": {
                "conv_kernel_size": nested.whole("conv_kernel_size", 1, MAX_BLOCK),
                "conv_group_size": group,
                "selector_rank": nested.whole("selector_rank", 1, MAX_RANK),
                "selector_top_k": nested.whole("selector_top_k", 1, vocab, note=" (at most vocab_size)"),
            },
        }


FAMILY = DFlash2()

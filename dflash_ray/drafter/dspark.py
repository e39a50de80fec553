"""The DSpark family: the DFlash backbone, the anchor as first prediction, a Markov head and a
confidence head (DeepSeek, arXiv 2607.05147; served by vLLM as `DSparkDraftModel`).

Shapes: B sequences, S positions, A anchor slots, K block size, Q = A*K queries, H hidden, V vocab,
r Markov rank, k top-k of the target's distribution.

Block `[x_a, MASK x K-1]` at positions a..a+K-1, as in DFlash, but every position is a prediction:
position k predicts x[a+k+1] (vLLM: `sample_from_anchor`), so a block drafts K tokens. Its logits are
`head(h_k) + W2 · W1[prev_k]`, with prev_k the token at position a+k: the anchor for k = 0, then the
token drafted before (the true token in training). Drafting is therefore left to right over one
backbone pass. The confidence head `σ(wᵀ[h_k; W1[prev_k]] + b)` estimates each position's acceptance.

Loss per position (weights `blocks.position_weights` with the first prediction at k = 0, so
exp(-k/gamma), gamma 4 unless `train.loss_decay`, on loss-masked labels): 0.1·CE(label) +
0.9·TV(p_d, p_t) + 1.0·BCE(confidence, 1 - TV) (`Settings`: ce_weight, tv_weight, bce_weight), with
TV = ½‖p_d - p_t‖₁ (so 1 - TV is the chance speculative sampling accepts the draft) and p_t the
target's whole next-token distribution there: the target sends its final-normed last hidden states
and the frozen head turns them into p_t here, chunk by chunk beside the draft's own logits (a top-k
renormalized would bias both terms by up to the mass outside it: 1% on average at k = 32 and 14% at
the 99th percentile of SmolLM2's own answers, `bench/topk_mass.py`). Without the target's
distribution the loss falls back to CE + BCE(confidence, [argmax = label]). With `tv_weight` 0 (hard
labels, for greedy serving) the target's distribution is not computed at all (nor its last hidden
states captured, sent or cached): CE weighs
`ce_weight` and the confidence learns greedy acceptance, [argmax = label], which is what greedy
decoding accepts (a step saves the target's head product, and its recompute in backward).
Parameter names match vLLM's `Qwen3DSparkModel`: the backbone's, then
`markov_head.markov_w{1,2}.weight` and `confidence_head.proj.{weight,bias}`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_ray.drafter import families
from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.drafter.loss import LossOutput
from dflash_ray.drafter.model import DFlashDrafter, head_logits
from dflash_ray.drafter.speculative import Sampling, warp
from dflash_ray.drafter.forward import ForwardOutput, attention_masks, draft_blocks
from dflash_ray.errors import DFlashError

GAMMA = 4.0  # the position weights' gamma unless `train.loss_decay` sets it
MAX_CHUNK_LOGITS = 2**26  # fp32 logits per loss chunk (256 MB): [Q, V] never exists at once


@dataclass(frozen=True, kw_only=True)
class Settings(families.Settings):
    markov_rank: int = 256  # rank r of the Markov head W1 [V, r] · W2 [r, V]
    confidence_head: bool = True  # a per-position acceptance estimate
    confidence_with_markov: bool = True  # the confidence head also reads W1[previous token]
    ce_weight: float = 0.1  # the loss terms' weights (see the module docstring)
    tv_weight: float = 0.9
    bce_weight: float = 1.0

    minimum = {"markov_rank": 1, "ce_weight": 0, "tv_weight": 0, "bce_weight": 0}

    def wants_target_distribution(self) -> bool:
        return self.tv_weight > 0  # hard labels alone read the target's greedy tokens only

    def __post_init__(self):
        super().__post_init__()
        if self.ce_weight + self.tv_weight <= 0:  # the BCE term trains the confidence head alone
            raise DFlashError(
                "ce_weight and tv_weight are both 0: nothing would teach the drafts; allowed: either above 0",
                field="ce_weight",
            )


class MarkovHead(nn.Module):
    """`markov_w1[prev]` [r] embeds the previous token; `markov_w2` [V, r] turns it into a logit bias."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(markov_embed)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """The acceptance logit (float32, as vLLM computes it)."""
        x = torch.cat([hidden.float(), markov_embed.float()], -1) if self.with_markov else hidden.float()
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The DFlash backbone (same parameters, same forward) plus the two heads."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        own = cfg.settings
        self.markov_head = MarkovHead(cfg.vocab_size, own.markov_rank)
        in_dim = cfg.hidden_size + (own.markov_rank if own.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(in_dim, own.confidence_with_markov) if own.confidence_head else None
        self._reset_heads()

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        if hasattr(self, "markov_head"):
            self._reset_heads(std)

    def _reset_heads(self, std: float = 0.02) -> None:
        # W2 = 0: training starts from the backbone's own logits; the confidence starts at 1/2
        nn.init.normal_(self.markov_head.markov_w1.weight, std=std)
        nn.init.zeros_(self.markov_head.markov_w2.weight)
        if self.confidence_head is not None:
            nn.init.zeros_(self.confidence_head.proj.weight)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def logits(self, hidden_NH: torch.Tensor, head_VH: torch.Tensor, prev_N: torch.Tensor) -> torch.Tensor:
        """Draft logits [N, V] (float32) of final hidden states whose previous tokens are `prev_N`."""
        markov = self.markov_head.embed(prev_N)
        return (hidden_NH.to(head_VH.dtype) @ head_VH.t()).float() + self.markov_head.bias(markov).float()

    def confidence(self, hidden_NH: torch.Tensor, prev_N: torch.Tensor) -> torch.Tensor:
        """σ(confidence logit) [N]: the estimated chance each position's draft is accepted."""
        assert self.confidence_head is not None  # asked only of a drafter with the head
        return torch.sigmoid(self.confidence_head(hidden_NH, self.markov_head.embed(prev_N)))


def _position_losses(hidden_NH, markov_Nr, conf_logit_N, head_VH, w2_Vr, labels_N, target_hidden_NH, own: Settings):
    """Per-position loss [N] and top-1 hits [N] (see the module docstring)."""
    logits = (hidden_NH.to(head_VH.dtype) @ head_VH.t()).float() + (markov_Nr.to(w2_Vr.dtype) @ w2_Vr.t()).float()
    logp = torch.log_softmax(logits, -1)
    ce = -logp.gather(1, labels_N[:, None])[:, 0]
    correct = logits.argmax(-1) == labels_N
    if target_hidden_NH is None or own.tv_weight == 0:  # the confidence learns greedy acceptance
        bce = F.binary_cross_entropy_with_logits(conf_logit_N, correct.float(), reduction="none")
        return (1.0 if target_hidden_NH is None else own.ce_weight) * ce + own.bce_weight * bce, correct
    with torch.no_grad():  # the target's distribution through the same frozen head
        pt = torch.softmax((target_hidden_NH.to(head_VH.dtype) @ head_VH.t()).float(), -1)
    tv = 0.5 * (logp.exp() - pt).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(conf_logit_N, (1 - tv).detach(), reduction="none")
    return own.ce_weight * ce + own.tv_weight * tv + own.bce_weight * bce, correct


def dspark_loss(
    drafter: DSparkDrafter,
    hidden_BQH: torch.Tensor,
    head_VH: torch.Tensor,
    prev_BQ: torch.Tensor,
    labels_BQ: torch.Tensor,
    weights_BQ: torch.Tensor,
    target_hidden_BQH: torch.Tensor | None = None,
) -> LossOutput:
    """sum(w * per-position loss) / sum(w), in row chunks whose logits are recomputed in backward
    when there are several (one chunk's activations are bounded by the chunk, and recomputing its
    two head products would cost the step two of its five)."""
    B, Q, H = hidden_BQH.shape
    hidden, prev = hidden_BQH.reshape(-1, H), prev_BQ.reshape(-1)
    labels, weights = labels_BQ.reshape(-1), weights_BQ.reshape(-1).float()
    markov = drafter.markov_head.embed(prev)
    if drafter.confidence_head is not None:
        conf_logit = drafter.confidence_head(hidden, markov)
    else:  # no head to train: a constant the loss cannot move
        conf_logit = torch.zeros(hidden.shape[0], device=hidden.device)
    t_hidden = target_hidden_BQH.reshape(-1, H) if target_hidden_BQH is not None else None
    # hard labels alone (tv_weight 0): the target's distribution is not computed
    with_target = t_hidden is not None and drafter.cfg.settings.tv_weight > 0
    w2 = drafter.markov_head.markov_w2.weight
    # two [chunk, V] fp32 buffers at once with the target's distribution beside the draft's
    chunk = max(1, MAX_CHUNK_LOGITS // head_VH.shape[0] // (2 if with_target else 1))
    total, hits = hidden.new_zeros((), dtype=torch.float32), []
    for s in range(0, hidden.shape[0], chunk):
        part = slice(s, s + chunk)
        args = (
            hidden[part],
            markov[part],
            conf_logit[part],
            head_VH,
            w2,
            labels[part],
            None if t_hidden is None else t_hidden[part],
            drafter.cfg.settings,
        )
        if torch.is_grad_enabled() and chunk < hidden.shape[0]:
            per, correct = checkpoint(_position_losses, *args, use_reentrant=False)
        else:
            per, correct = _position_losses(*args)
        total = total + (per * weights[part]).sum()
        hits.append(correct)
    loss = total / weights.sum().clamp_min(1e-12)
    return LossOutput(loss, torch.cat(hits).view(B, Q), weights_BQ.sum())


def acceptance_lengths(
    correct_BQ: torch.Tensor, weights_BQ: torch.Tensor, keep_BA: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Simulated acceptance length of every kept block: consecutive hits from k = 0, plus one."""
    B, A = keep_BA.shape
    hit = (correct_BQ & (weights_BQ > 0)).view(B, A, block_size)
    return (hit.long().cumprod(-1).sum(-1) + 1)[keep_BA].float()


def forward_loss(
    drafter: DSparkDrafter,
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
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    length_bucket: int = 1,
    anchor_seeds: torch.Tensor | None = None,
) -> ForwardOutput:
    """`teacher`: the target's final-normed last hidden states [B, S, H] (position p: the distribution
    of token p + 1 through the frozen head), which the TV term needs; None falls back to CE + BCE on
    hits. `fused` and `distill` are DFlash's (the TV term already learns the target's distribution).
    `length_bucket`: as DFlash's, padding the context so attention meets a bounded set of shapes."""
    K = drafter.cfg.block_size
    drafted = draft_blocks(
        drafter,
        embed_VH,
        features_BSF,
        input_ids_BS,
        loss_mask_BS,
        num_anchors=num_anchors,
        generator=generator,
        attention=attention,
        gamma=gamma if gamma is not None else GAMMA,
        teacher=teacher,
        distill=0.0,
        length_bucket=length_bucket,
        anchor_seeds=anchor_seeds,
        first_prediction=0,
    )
    blocks, input_ids_BS = drafted.blocks, drafted.input_ids_BS
    teacher = drafted.teacher if isinstance(drafted.teacher, torch.Tensor) else None  # padded as the batch
    S = input_ids_BS.shape[1]
    at = blocks.positions.clamp(max=S - 1)  # a + k: the previous token's position
    prev = torch.gather(input_ids_BS, 1, at)
    t_hidden = None
    if teacher is not None:  # the target's distribution at a + k, where the label's own is
        t_hidden = torch.gather(teacher, 1, at[..., None].expand(-1, -1, teacher.shape[-1]))
    out = dspark_loss(drafter, drafted.hidden_BQH, head_VH, prev, blocks.labels, blocks.weights, t_hidden)
    return ForwardOutput(out, blocks, acceptance_lengths(out.correct, blocks.weights, blocks.keep, K))


class DSpark:
    name = "dspark"
    architecture = "DSparkDraftModel"
    vllm_method = "dspark"
    first_prediction = 0
    vllm_on_cpu = False  # vLLM's model for it runs on its GPU (V2) runner only
    hf_keys = frozenset(
        {
            "mask_token_id",
            "target_layer_ids",
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
            "sample_from_anchor",
        }
    )
    Settings = Settings

    def build(self, cfg: DrafterConfig) -> DSparkDrafter:
        return DSparkDrafter(cfg)

    def forward_loss(self, drafter, *args, **kwargs) -> ForwardOutput:
        return forward_loss(drafter, *args, **kwargs)

    @torch.no_grad()
    def propose(
        self,
        drafter: DSparkDrafter,
        context_1nF: torch.Tensor,
        last_token: int,
        embed_VH: torch.Tensor,
        head_VH: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K drafts: one backbone pass, then left to right, each with the Markov bias of the token
        drafted before it (the anchor first)."""
        cfg = drafter.cfg
        device, n, K = context_1nF.device, context_1nF.shape[1], cfg.block_size
        dtype = next(drafter.parameters()).dtype
        block_ids = torch.full((1, K), cfg.mask_token_id, device=device)
        block_ids[0, 0] = last_token
        positions = torch.arange(n, n + K, device=device)[None]
        masks = attention_masks(drafter, torch.tensor([[n]], device=device), n, "sdpa")
        hidden = drafter(context_1nF.to(dtype), F.embedding(block_ids, embed_VH).to(dtype), positions, masks)[0]
        base = head_logits(hidden, head_VH).float()  # [K, V]
        argmax = sampling.greedy or sampling.greedy_drafts
        prev = torch.tensor([last_token], device=device)
        drafts, qs = [], []
        for i in range(K):
            logits = base[i] + drafter.markov_head.bias(drafter.markov_head.embed(prev))[0].float()
            if argmax:
                prev = logits.argmax(-1, keepdim=True)
            else:
                qs.append(warp(logits, sampling.temperature, sampling.top_p))
                prev = torch.multinomial(qs[-1], 1, generator=sampling.generator)
            drafts.append(prev)
        return torch.cat(drafts), None if argmax else torch.stack(qs)

    def hf_config(self, cfg: DrafterConfig) -> dict:
        """vLLM's Qwen3 DSpark keys, flat at the top level (it reads `target_layer_ids` as DFlash's
        `dflash_config.target_layer_ids`: the output of 0-based layer i)."""
        own = cfg.settings
        return {
            "architectures": [self.architecture],
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "markov_rank": own.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": own.confidence_head,
            "confidence_head_with_markov": own.confidence_with_markov,
            "sample_from_anchor": True,
        }

    def read_hf_config(self, data: dict) -> dict:
        """Its flat keys (`from_hf_config` has checked the fields every family shares); the drafter
        here is vLLM's vanilla head drafting from the anchor, so a config.json of another is refused."""
        from dflash_ray.drafter.config_checks import MAX_RANK, Fields

        top = Fields(data)
        top.choice("markov_head_type", ("vanilla",), "vanilla")
        if not top.flag("sample_from_anchor", True):
            raise top.bad("sample_from_anchor", "true (the drafter here drafts from the anchor)", False)
        return {
            "mask_token_id": data["mask_token_id"],
            "target_layer_ids": list(data["target_layer_ids"]),
            "settings": {
                "markov_rank": top.whole("markov_rank", 1, MAX_RANK),
                "confidence_head": top.flag("enable_confidence_head", False),
                "confidence_with_markov": top.flag("confidence_head_with_markov", False),
            },
        }


FAMILY = DSpark()

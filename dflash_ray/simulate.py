"""A role's own step code run at the real shape under fake tensors: peak memory by category, FLOPs
counted, a step time estimated, all without a GPU and without allocating a byte.

`FakeTensorMode` gives every tensor its shape, dtype and size but no data; `MemTracker` (or
`FSDPMemTracker` for a sharded drafter, over a fake process group) records what the step holds at
its peak; `FlopCounterMode` counts its FLOPs. What fake tensors cannot run is stood in for, each
with the memory and FLOPs of the GPU kernel it stands for:

- compiled flex attention (a kernel that never materializes the scores): saves q, k, v, the output
  and the log-sum-exp for the backward; its FLOPs are counted from the attention rule (each block
  query sees its anchor's context, or the window of it, and its own block);
- the fused cross-entropy runs its chunked PyTorch path (the Triton kernel rewrites the same chunk
  of logits in place);
- data-dependent index ops (`nonzero`, boolean masks) see every entry true: every position a
  response position, an upper bound;
- AdamW takes its multi-tensor path over a whole drafter, the GPU's default (its temporaries a copy
  of the weights' size), and the per-tensor path over a sharded one: on fake tensors the sharded
  multi-tensor path counts full-size temporaries that the real one (checked on real tensors over a
  fake group) never holds, while its one shard-sized temporary falls after the backward's peak;
- SDPA on fake CPU tensors is an operator the flop counter has no rule for: a target's attention
  FLOPs are counted from its layers (causal pairs, or the window of them) when it records none.

The drafter's step is the steady state, not the first: AdamW makes its two moments at its first
`step()`, so a first step peaks without them. The simulation makes them as a first step does (a
zero gradient on every parameter, one `step()`, the gradients freed) before the tracked step, and
places `zero_grad` where the worker does (`averaged_gradients`: before the forward, so the previous
step's gradients are freed before the activations grow).

Not seen here: allocator fragmentation, the CUDA context and NCCL's buffers (`plan.memory_headroom`
leaves room for them; the peak itself is 1.046x the H200's `max_memory_allocated` for the code
measured, `bench/simulate.py`), the kernels' own efficiency (the step time is counted FLOPs at a
utilisation calibrated on the one H200 measurement, `bench/RESULTS.md`). No Ray.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from dflash_ray.simulate_traffic import CountedTraffic


aten = torch.ops.aten


def _all_indices(x: torch.Tensor) -> torch.Tensor:
    """What `nonzero` returns for a tensor whose every entry is true: [numel, ndim]."""
    grids = torch.meshgrid(*[torch.arange(n, device=x.device) for n in x.shape], indexing="ij")
    return torch.stack([g.reshape(-1) for g in grids], -1)


class _EveryEntryTrue(torch.utils._python_dispatch.TorchDispatchMode):
    """Data-dependent index ops on fake tensors, as if every mask entry were true."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(a, FakeTensor) for a in tensors):
            with unset_fake_temporarily():  # a real tensor (a device mesh's ranks) keeps its real values
                return func(*args, **kwargs)
        if func is aten.nonzero.default:
            return _all_indices(args[0])
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):
            indices = []
            for i in args[1]:
                indices.extend(_all_indices(i).unbind(-1) if i is not None and i.dtype == torch.bool else [i])
            args = (args[0], indices, *args[2:])
        return func(*args, **kwargs)


class _FlexKernel(torch.autograd.Function):
    """Compiled flex attention's memory: q, k, v, out and the log-sum-exp kept for the backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q, dtype=v.dtype)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _out, _lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _Counted:
    """FLOPs of stood-in kernels the flop counter does not see."""

    flops = 0.0


def _gated_delta_rule(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False, **_):
    """The chunked Gated-DeltaNet kernel (flash-linear-attention's on a GPU): its output, its final
    state when asked, and its FLOPs (per token and head: the state read twice and updated, 3 x 2·dk·dv,
    and the 64-token chunk's own attention, 2·64·(dk + dv))."""
    B, S, h, dk = key.shape
    dv = value.shape[-1]
    _Counted.flops += B * S * h * (6 * dk * dv + 2 * 64 * (dk + dv))
    state = value.new_empty(B, h, dk, dv, dtype=torch.float32) if output_final_state else None
    return torch.empty_like(value), state


@contextlib.contextmanager
def fake_run() -> Iterator[Any]:
    """A fake tensor mode with the stand-ins above in place; yields the mode."""
    import importlib
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflash_ray.drafter import model
    from dflash_ray.kernels import fused_ce

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _Counted.flops = 0.0
    with contextlib.ExitStack() as stack:
        flex = lambda q, k, v, mask: _FlexKernel.apply(q, k, v)  # noqa: E731 (the attention layers' call)
        stack.enter_context(mock.patch.object(model, "flex_attention", flex))
        stack.enter_context(mock.patch.object(fused_ce, "_use_triton", lambda t: False))
        for hybrid in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # transformers' Gated-DeltaNet targets
            try:
                modeling = importlib.import_module(f"transformers.models.{hybrid}.modeling_{hybrid}")
            except ImportError:
                continue
            if hasattr(modeling, "torch_chunk_gated_delta_rule"):
                stack.enter_context(mock.patch.object(modeling, "torch_chunk_gated_delta_rule", _gated_delta_rule))
        stack.enter_context(mode)
        stack.enter_context(_EveryEntryTrue())
        yield mode


def peak_only(tracker_class: type) -> type:
    """`tracker_class` (torch's `MemTracker` or `FSDPMemTracker`) keeping the step's peak alone. After
    every operator the stock tracker also walks every module it has seen for the per-module peaks,
    which the simulation never reads: over a 64-layer target that walk is about a third of a plan's time.
    The peak itself is updated by the same rule, so it is the same."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class PeakOnly(tracker_class):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = dict(snapshot)

    PeakOnly.__name__ = f"PeakOnly{tracker_class.__name__}"
    return PeakOnly


def fake_module(build, mode, dtype: torch.dtype | None = None) -> nn.Module:
    """`build()` on the meta device, then every parameter and buffer made a fake CPU tensor (a fake
    tensor has a size the trackers count; a meta one does not)."""
    with torch.device("meta"):
        module = build()
    convert = mode.fake_tensor_converter
    made: dict[int, nn.Parameter] = {}  # tied weights stay one tensor
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    t = convert.from_meta_and_device(mode, p.data.to(dtype or p.dtype), torch.device("cpu"))
                    made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = convert.from_meta_and_device(mode, b, torch.device("cpu"))
    return module


def _categories(snapshot: dict) -> dict[str, float]:
    """A tracker's peak snapshot as GB by category, summed over devices; the FSDP tracker's finer
    kinds folded into the five a reader compares."""
    fold = {
        "Parameter": "parameters",
        "Sharded Param": "parameters",
        "Unsharded Param": "parameters",
        "Buffer": "parameters",
        "Gradient": "gradients",
        "Sharded Grad": "gradients",
        "Unsharded Grad": "gradients",
        "Optstate": "optimizer",
        "OptState": "optimizer",
        "Activation": "activations",
        "Temp": "temporaries",
        "All Gather": "temporaries",
        "Reduce Scatter": "temporaries",
        "Inputs": "inputs",
        "Other": "temporaries",
    }
    out = dict.fromkeys(["parameters", "gradients", "optimizer", "activations", "temporaries", "inputs"], 0.0)
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            name = getattr(kind, "value", kind)
            if name != "Total":
                out[fold.get(name, "temporaries")] += nbytes / 1e9
    return {k: round(v, 2) for k, v in out.items()}


def tensor_gb(*tensors: torch.Tensor) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 1e9


# -- the attention FLOPs the flex stand-in does not count ----------------------------------------


def attention_pairs(
    seq_len: int, prompt_len: int, num_anchors: int, block_size: int, layer_type: str, sliding_window: int
) -> float:
    """Expected (query, key) pairs a block-attention layer computes for one sequence: anchors drawn
    uniformly over the response, each block's K queries seeing the anchor's context (its window of
    it in a sliding layer) and their own block."""
    candidates = range(prompt_len, seq_len - 1)
    n = max(1, len(candidates))
    window = sliding_window if layer_type == "sliding_attention" else seq_len
    mean_context = sum(min(a, window) for a in candidates) / n
    anchors = min(num_anchors, n)
    return anchors * block_size * (mean_context + block_size)


def attention_flops(drafter_cfg, seq_len: int, prompt_len: int, num_anchors: int, backward: bool) -> float:
    """FLOPs of the drafter's block attention over its layers: 2 matmuls forward (4·pairs·heads·dim),
    twice that in the backward (the flop counter's own rule for attention)."""
    total = 0.0
    for layer_type in drafter_cfg.layer_types:
        pairs = attention_pairs(
            seq_len, prompt_len, num_anchors, drafter_cfg.block_size, layer_type, drafter_cfg.sliding_window
        )
        total += 4 * pairs * drafter_cfg.num_heads * drafter_cfg.head_dim * (3 if backward else 1)
    return total


def causal_attention_flops(target_config, seq_len: int, num_layers: int | None = None) -> float:
    """FLOPs of a target's softmax attention over one sequence in a forward through its first
    `num_layers` layers (all by default): 2 matmuls (4·pairs·heads·dim) over the causal pairs a flash
    kernel computes, each query seeing the keys before it (the window of them in a sliding layer);
    linear-attention layers are counted apart."""
    text = getattr(target_config, "text_config", None) or target_config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    kinds = kinds[:num_layers] if num_layers else kinds
    S, window = seq_len, getattr(text, "sliding_window", None) or seq_len
    pairs = {"full_attention": S * (S + 1) / 2}
    w = min(window, S)  # query i sees min(i + 1, w) keys
    pairs["sliding_attention"] = w * (w + 1) / 2 + (S - w) * w
    return sum(4 * pairs[k] * heads * head_dim for k in kinds if k in pairs)


def _counter_saw_attention(flops) -> bool:
    return any("attention" in str(op) and n for op, n in flops.get_flop_counts().get("Global", {}).items())


# -- the roles ---------------------------------------------------------------------------------


@dataclass
class Sample:
    """The batch a role steps on: `batch` sequences of `seq_len` tokens, the first `prompt_len` of
    each the prompt (the rest trained on)."""

    seq_len: int
    prompt_len: int
    batch: int = 1


def drafter_step(
    drafter_cfg,
    family_name: str,
    sample: Sample,
    *,
    num_anchors: int,
    world: int,
    replicas: int = 1,
    reduce_dtype: torch.dtype = torch.float32,
    keep_gathered: bool = False,
    tied_head: bool,
    teacher_k: int,
    distill: float,
    gamma: float | None,
    length_bucket: int,
    zero_grad_first: bool = True,
    after_backward: Callable[[nn.Module], None] | None = None,
) -> dict[str, Any]:
    """One steady-state training step of a drafter rank: its family's own forward and loss, the
    backward, the clipped gradients and AdamW (its moments made by a first step before this one),
    sharded with FSDP2 over `world` ranks (a fake group) in `replicas` rows (`train/mesh.py`) as a run
    shards it. Returns memory by category (GB) at the step's peak, FLOPs (and the decoder layers',
    which their traffic hides behind), the bytes a rank's collectives send by mesh dimension
    (`simulate_traffic`) and the simulator's own seconds.

    `zero_grad_first`: the worker's placement (last step's gradients freed before the forward);
    False keeps them, zeroed, through the forward, as code that zeroes after the forward does.
    `after_backward(drafter)`: what that code does with the gradients before clipping them."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    from dflash_ray.drafter import families

    family = families.get(family_name)
    started = time.perf_counter()
    S, B = sample.seq_len, sample.batch
    with _fake_group(world, replicas) as (group, names), fake_run() as mode:
        drafter = fake_module(lambda: family.build(drafter_cfg), mode, torch.float32)
        parameters = sum(p.numel() for p in drafter.parameters())
        embed, head, features, ids, mask, teacher = _step_inputs(drafter_cfg, sample, tied_head, teacher_k)
        if group is not None:
            from dflash_ray.train.fsdp import apply_fsdp

            apply_fsdp(drafter, "cpu", group, torch.bfloat16, reduce_dtype=reduce_dtype, keep_gathered=keep_gathered)
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, foreach=group is None)  # see the module's note
        for p in drafter.parameters():  # the first step's state: AdamW's moments, made at its first step()
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=zero_grad_first)
        tracker = peak_only(FSDPMemTracker)(drafter, opt) if group is not None else peak_only(MemTracker)()
        if group is None:
            tracker.track_external(drafter, opt)
        flops = FlopCounterMode(display=False)
        traffic = CountedTraffic(names)
        with tracker, flops, traffic:
            if zero_grad_first:
                opt.zero_grad(set_to_none=True)  # `averaged_gradients`: before the forward
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = family.forward_loss(
                    drafter,
                    embed,
                    head,
                    features,
                    ids,
                    mask,
                    num_anchors=num_anchors,
                    generator=torch.Generator().manual_seed(0),
                    attention="flex",
                    gamma=gamma,
                    teacher=teacher,
                    distill=distill,
                    length_bucket=length_bucket,
                )
            if not zero_grad_first:
                opt.zero_grad(set_to_none=False)
            out.loss.loss.backward()
            if after_backward is not None:
                after_backward(drafter)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
        memory = _categories(tracker.get_tracker_snapshot("peak"))
        frozen = tensor_gb(embed) + (0 if tied_head else tensor_gb(head))
    memory["frozen_embedding_and_head"] = round(frozen, 2)
    sent = tensor_gb(teacher) if isinstance(teacher, torch.Tensor) else tensor_gb(*teacher) if teacher else 0.0
    memory["inputs"] = round(memory["inputs"] + tensor_gb(features) + sent, 2)
    memory["total"] = round(sum(memory.values()), 2)
    counted: float = flops.get_total_flops()  # one rank's own batch
    attention = attention_flops(drafter_cfg, S, sample.prompt_len, num_anchors, backward=True) * B
    counted += attention
    in_layers = attention + _layer_flops(flops, type(drafter).__name__)
    return {
        "memory_gb": memory,
        "flops_per_step": counted,
        "layer_flops_per_step": in_layers,
        "traffic_gb": traffic.gigabytes(),
        "parameters": parameters,
        "simulated_in_s": round(time.perf_counter() - started, 1),
    }


def _layer_flops(flops, root: str) -> float:
    """FLOPs inside the drafter's decoder layers: the drafter module's own, less its other direct
    children's (fc, the norms, a family's heads). The counter's per-layer figures cannot serve: under
    FSDP2 its backward attribution piles each layer's backward onto the layers after it."""
    counts = {name: sum(by_op.values()) for name, by_op in flops.get_flop_counts().items()}
    children = [n for n in counts if n.count(".") == 1 and n.startswith(root + ".")]
    return counts.get(root, 0.0) - sum(counts[n] for n in children if not n.endswith(".layers"))


def _step_inputs(drafter_cfg, sample: Sample, tied_head: bool, teacher_k: int) -> tuple:
    """What a drafter rank receives for one step, as fake tensors of the shapes a run sends: the
    frozen embedding and head, the target's features, the ids and loss mask, and the teacher (the
    target's last hidden states, its top-k, or none)."""
    H, V, S, B = drafter_cfg.hidden_size, drafter_cfg.vocab_size, sample.seq_len, sample.batch
    embed = torch.empty(V, H, dtype=torch.bfloat16)
    head = embed if tied_head else torch.empty(V, H, dtype=torch.bfloat16)
    features = torch.empty(B, S, len(drafter_cfg.target_layer_ids) * H, dtype=torch.bfloat16)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[:, : sample.prompt_len] = 0
    teacher: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
    if drafter_cfg.settings.wants_target_distribution():  # the target's last hidden states
        teacher = torch.empty(B, S, H, dtype=torch.bfloat16)
    else:
        teacher = (torch.zeros(B, S, teacher_k, dtype=torch.long), torch.empty(B, S, teacher_k)) if teacher_k else None
    return embed, head, features, ids, mask, teacher


@contextlib.contextmanager
def _fake_group(world: int, replicas: int = 1):
    """A fake process group of `world` ranks (this process rank 0) for FSDP2 to shard over, as a mesh
    of `replicas` rows (1: one dimension, every rank sharding), and the mesh's group names by
    dimension; (None, {}) for one rank. Its collectives move nothing."""
    if world <= 1:
        yield None, {}
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the simulation needs a process without a process group")
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if world % replicas:
        raise ValueError(f"{world} ranks do not make {replicas} equal rows")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        assert dist.group.WORLD is not None  # set by init_process_group
        if replicas == 1:  # made outside the fake mode
            mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
            yield mesh, {dist.group.WORLD.group_name: "shard"}
        else:
            mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
            yield mesh, {mesh.get_group(d).group_name: d for d in ("replicate", "shard")}
    finally:
        dist.destroy_process_group()


def target_forward(
    target_config, layer_ids: list[int], sample: Sample, top_k: int, last: bool = False
) -> dict[str, Any]:
    """The target's forward with the capture hooks (`capture.target_outputs`, the worker's own call)
    over the sample, in bf16, built from its config.json alone (transformers' own class); `top_k`:
    distillation's top-k, `last`: the last hidden states a DSpark drafter turns into the distribution."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from dflash_ray.target_model.capture import target_outputs

    started = time.perf_counter()
    with fake_run() as mode:
        model = fake_module(lambda: AutoModelForCausalLM.from_config(target_config), mode, torch.bfloat16).eval()
        B, S = sample.batch, sample.seq_len
        ids = torch.zeros(B, S, dtype=torch.long)
        attn = torch.ones(B, S, dtype=torch.long)
        want = torch.ones(B, S, dtype=torch.long)
        tracker = peak_only(MemTracker)()
        tracker.track_external(model)
        flops = FlopCounterMode(display=False)
        with tracker, flops, torch.no_grad():
            target_outputs(model, ids, layer_ids, attention_mask=attn, top_k=top_k, want_BS=want, last_hidden=last)
        memory = _categories(tracker.get_tracker_snapshot("peak"))
        counted = flops.get_total_flops() + _Counted.flops
        if not _counter_saw_attention(flops):  # SDPA's CPU operator: no rule in the counter
            run = None if top_k or last else max(layer_ids) + 1  # the capture stops after its last layer
            counted += causal_attention_flops(target_config, S, run) * B
    memory["total"] = round(sum(memory.values()), 2)
    return {
        "memory_gb": memory,
        "flops_per_step": counted,
        "simulated_in_s": round(time.perf_counter() - started, 1),
    }

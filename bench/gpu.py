"""`make gpu-check`: the GPU paths of training and decoding, on one GPU, Ray-free, random weights.

    python -m bench.gpu --json                      # CUDA: Qwen3.6-27B width, the reference drafter
    python -m bench.gpu --device cpu --tiny --json  # the same checks at toy sizes (in the test suite)

One JSON line per check, each with "ok":
- fused_ce: the fused linear + CE (Triton on CUDA) against the naive fp32-logits reference: relative
  error of loss and gradient (hard labels, and distillation's soft targets), peak memory ratio, time ratio.
- flex_attention: the DFlash block mask through compiled flex attention against the dense SDPA mask,
  full and sliding layers: output and gradient error, fwd+bwd time ratio (forward only on the CPU);
  then sequences of many lengths padded to `length_bucket` multiples: the graphs compiled (one per
  bucket, shared by both layer types) and graph breaks (none: nothing runs eagerly).
- train_step: one colocated stream (`ColocatedWorker`: target and drafter on one device, the code the
  Ray actor runs): tokens/s, step split (target / drafter / optimizer), peak memory and step time
  beside the plan's simulation of the same step (`bench.simulate`), model FLOP utilisation by the
  FLOPs the simulation counts; steps over sequences of
  many lengths: the attention shapes met and the graphs compiled (flex attention and its block mask
  on the GPU; none on the CPU, which runs the dense mask); and what the paired
  path's trip of one batch's features through host memory (device → host → device) costs against it;
  and the same step with distillation (the target's top-32 over the response positions).
- hybrid_target: a target of Qwen3.6-27B's own layer shapes (3 Gated-DeltaNet layers, 1 full
  attention): its forward over the shape check's lengths in tokens/s, whether Gated-DeltaNet ran
  through the fast kernels (flash-linear-attention, causal-conv1d) or the torch fallback, and a
  batch of two lengths against each row alone.
- speculative: greedy speculative decoding with a (briefly trained) drafter on the device equals the
  target's own greedy output; its acceptance length.
- layout_step: one drafter rank of the preset's layout (hsdp over 2 x 8 ranks, bf16 reductions, the
  layers kept gathered) on a fake group (`bench/gpu_layout.py`): its step, peak memory and the bytes
  its collectives would send, beside the plan's simulation of the same step.
- ray_free: nothing above imported Ray or vLLM (the GPU machine has neither).
- compile_cache (with `--compile-cache PATH`, a file or a folder): the compiled artifacts loaded from
  PATH before the first check and saved there after the last (`dflash_ray.train.compile_cache`), and
  what was compiled in between: a second start with the same PATH compiles nothing (misses 0).

It runs from a source checkout without installing the project (the GPU machine gets the working tree
only): `kernels/` is mapped to `dflash_ray.kernels` as the installed package maps it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _map_kernels() -> None:
    if importlib.util.find_spec("dflash_ray") is None:
        sys.path.insert(0, str(ROOT))
    try:
        found = importlib.util.find_spec("dflash_ray.kernels") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        spec = importlib.util.spec_from_file_location(
            "dflash_ray.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["dflash_ray.kernels"] = module
        spec.loader.exec_module(module)


_map_kernels()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.gpu_layout import check_layout_step  # noqa: E402
from dflash_ray.train import compile_cache  # noqa: E402

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Sizes:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    target_layers: int
    layer_ids: list
    drafter_layers: int
    layer_types: list
    sliding_window: int
    anchors: int
    seq_len: int
    lengths: list  # sequence lengths the shape checks meet, padded to multiples of `length_bucket`
    length_bucket: int
    steps: int  # timed training steps, after `warmup`
    warmup: int
    spec_hidden: int  # the speculative-decoding target (fp32, narrower: exact greedy comparisons)
    spec_vocab: int
    spec_tokens: int
    spec_train_steps: int
    block: int = 16
    hybrid: dict = field(default_factory=dict)  # the hybrid target's shape (`tiny_qwen35` arguments)
    extra: dict = field(default_factory=dict)


# Qwen3.6-27B's width (hidden 5120, 32/8 heads of 128, intermediate 17408, vocabulary 248,320) with
# six target layers; the reference drafter: 5 layers (4 sliding + 1 full, window 2048), 512 anchors.
FULL_SIZES = Sizes(
    hidden=5120,
    intermediate=17408,
    heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=248320,
    target_layers=6,
    layer_ids=[1, 2, 3, 4, 5],
    drafter_layers=5,
    layer_types=[SLIDING] * 4 + [FULL],
    sliding_window=2048,
    anchors=512,
    seq_len=3072,
    lengths=[2100, 2222, 2345, 2500, 2560, 2700, 2850, 2999, 3072],
    length_bucket=512,
    steps=4,
    warmup=2,
    spec_hidden=1024,
    spec_vocab=32000,
    spec_tokens=64,
    spec_train_steps=100,
    # Qwen3.6-27B's layer shapes: 3 Gated-DeltaNet layers (16 key / 48 value heads of 128)
    # and 1 full-attention layer (24/4 heads of 256), hidden 5120, intermediate 17408
    hybrid=dict(
        num_layers=4,
        hidden_size=5120,
        intermediate_size=17408,
        num_heads=24,
        num_kv_heads=4,
        head_dim=256,
        linear_key_heads=16,
        linear_value_heads=48,
        linear_head_dim=128,
    ),
)
TINY_SIZES = Sizes(
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=512,
    target_layers=4,
    layer_ids=[0, 1, 2],
    drafter_layers=2,
    layer_types=[SLIDING, FULL],
    sliding_window=32,
    anchors=16,
    seq_len=96,
    lengths=[40, 47, 55, 61, 64, 70, 77, 85, 90, 96],
    length_bucket=32,
    steps=2,
    warmup=1,
    spec_hidden=64,
    spec_vocab=512,
    spec_tokens=24,
    spec_train_steps=30,
    hybrid=dict(num_layers=4, hidden_size=64, vocab_size=512),
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str, reps: int = 3) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _peak(fn, device: str) -> int | None:
    """Peak bytes allocated by `fn()` above what was allocated before (None on the CPU)."""
    if not device.startswith("cuda"):
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_fused_ce(sz: Sizes, device: str) -> dict:
    from dflash_ray.drafter.loss import naive_loss
    from dflash_ray.kernels.fused_ce import _use_triton, fused_linear_weighted_ce

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    N = sz.anchors * (sz.block - 1)
    hidden = torch.randn(N, sz.hidden, generator=g).to(device, dtype)
    head = (torch.randn(sz.vocab, sz.hidden, generator=g) * 0.02).to(device, dtype)
    labels = torch.randint(0, sz.vocab, (N,), generator=g).to(device)
    weights = (torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.1)).to(device)
    # distillation's soft targets: the label and the target's top-32, half and half
    soft_ids = torch.cat([labels[:, None], torch.randint(0, sz.vocab, (N, 32), generator=g).to(device)], 1)
    soft_p = torch.rand(N, 32, generator=g)
    soft_probs = torch.cat([torch.full((N, 1), 0.5), soft_p / soft_p.sum(1, keepdim=True) * 0.5], 1).to(device)
    results = {}
    for name, fn, soft in (
        ("naive", naive_loss, ()),
        ("fused", fused_linear_weighted_ce, ()),
        ("naive_soft", naive_loss, (soft_ids, soft_probs)),
        ("fused_soft", fused_linear_weighted_ce, (soft_ids, soft_probs)),
    ):
        h = hidden.clone().requires_grad_(True)

        def run(h=h, fn=fn, soft=soft):
            h.grad = None
            loss, _ = fn(h, head, labels, weights, *soft)
            loss.backward()
            return loss

        peak = _peak(run, device)
        loss = run()
        results[name] = {
            "loss": loss.detach(),
            "grad": h.grad.detach().clone(),
            "peak": peak,
            "seconds": _timed(run, device),
        }
    n, f = results["naive"], results["fused"]
    loss_err, grad_err = _rel(f["loss"], n["loss"]), _rel(f["grad"], n["grad"])
    soft_loss_err = _rel(results["fused_soft"]["loss"], results["naive_soft"]["loss"])
    soft_grad_err = _rel(results["fused_soft"]["grad"], results["naive_soft"]["grad"])
    tol = (1e-3, 3e-2) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    ok = loss_err < tol[0] and grad_err < tol[1] and soft_loss_err < tol[0] and soft_grad_err < tol[1]
    return {
        "check": "fused_ce",
        "ok": ok,
        "rows": N,
        "vocab": sz.vocab,
        "triton": _use_triton(hidden),
        "loss_rel_err": loss_err,
        "grad_rel_err": grad_err,
        "soft_loss_rel_err": soft_loss_err,
        "soft_grad_rel_err": soft_grad_err,
        "time_ratio_fused_soft_over_fused": results["fused_soft"]["seconds"] / f["seconds"],
        "peak_bytes_naive": n["peak"],
        "peak_bytes_fused": f["peak"],
        "peak_memory_ratio_naive_over_fused": n["peak"] / f["peak"] if f["peak"] else None,
        "time_ratio_naive_over_fused": n["seconds"] / f["seconds"],
    }


def _anchors(sz: Sizes, device: str, seq_len: int | None = None, padded: int | None = None) -> torch.Tensor:
    """Anchors in the last 3/4 of `seq_len` positions, right-padded (loss_mask 0) to `padded`."""
    from dflash_ray.drafter.blocks import sample_anchors

    seq_len = seq_len or sz.seq_len
    mask = torch.zeros(1, padded or seq_len, dtype=torch.long)
    mask[:, seq_len // 4 : seq_len] = 1
    anchors, _ = sample_anchors(mask, sz.anchors, torch.Generator().manual_seed(0))
    return anchors.to(device)


def _graphs_and_breaks() -> tuple[int, int]:
    """Graphs torch.compile has built in this process, and graph breaks (code it left to eager)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def check_flex_attention(sz: Sizes, device: str) -> dict:
    from dflash_ray.drafter.blocks import bucket_length, dense_mask, flex_block_mask
    from dflash_ray.drafter.model import compiled_flex_attention

    cuda = device.startswith("cuda")
    flex = compiled_flex_attention()  # the CPU too: forward only
    graphs, breaks = _graphs_and_breaks()
    dtype = torch.bfloat16 if cuda else torch.float32
    anchors = _anchors(sz, device)
    Q, KV = sz.anchors * sz.block, sz.seq_len + sz.anchors * sz.block
    g = torch.Generator().manual_seed(1)
    q0 = torch.randn(1, sz.heads, Q, sz.head_dim, generator=g).to(device, dtype)
    k0 = torch.randn(1, sz.kv_heads, KV, sz.head_dim, generator=g).to(device, dtype)
    v0 = torch.randn(1, sz.kv_heads, KV, sz.head_dim, generator=g).to(device, dtype)
    dout = torch.randn(1, sz.heads, Q, sz.head_dim, generator=g).to(device, dtype)
    out = {"check": "flex_attention", "compiled": True, "queries": Q, "keys": KV, "backward": cuda}
    ok = True
    for layer_type in (FULL, SLIDING):
        dense = dense_mask(anchors, sz.seq_len, sz.block, layer_type, sz.sliding_window)
        block = flex_block_mask(anchors, sz.seq_len, sz.block, layer_type, sz.sliding_window)
        runs = {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True),
            "flex": lambda q, k, v: flex(q, k, v, block_mask=block, enable_gqa=True),
        }
        res = {}
        for name, attn in runs.items():
            q, k, v = (t.clone().requires_grad_(cuda) for t in (q0, k0, v0))

            def step(q=q, k=k, v=v, attn=attn):
                o = attn(q, k, v)
                if cuda:
                    for t in (q, k, v):
                        t.grad = None
                    o.backward(dout)
                return o

            o = step()
            res[name] = {
                "out": o.detach(),
                "grads": [t.grad for t in (q, k, v)] if cuda else [],
                "seconds": _timed(step, device),
            }
        tag = "full" if layer_type == FULL else "sliding"
        out[f"{tag}_out_rel_err"] = _rel(res["flex"]["out"], res["sdpa"]["out"])
        if cuda:
            out[f"{tag}_grad_rel_err"] = max(_rel(a, b) for a, b in zip(res["flex"]["grads"], res["sdpa"]["grads"]))
        out[f"{tag}_time_ratio_sdpa_over_flex"] = res["sdpa"]["seconds"] / res["flex"]["seconds"]
        tol = 2e-2 if cuda else 1e-5
        ok = ok and out[f"{tag}_out_rel_err"] < tol and out.get(f"{tag}_grad_rel_err", 0.0) < 2 * tol
    # many sequence lengths, each padded to a bucket as training pads them: one graph per bucket
    for seq_len in sz.lengths:
        padded = bucket_length(seq_len, sz.length_bucket)
        anchors = _anchors(sz, device, seq_len, padded)
        q = q0.clone().requires_grad_(cuda)
        k, v = (
            torch.randn(1, sz.kv_heads, padded + Q, sz.head_dim, generator=g).to(device, dtype).requires_grad_(cuda)
            for _ in range(2)
        )
        for layer_type in (FULL, SLIDING):
            o = flex(
                q,
                k,
                v,
                block_mask=flex_block_mask(anchors, padded, sz.block, layer_type, sz.sliding_window),
                enable_gqa=True,
            )
            if cuda:
                o.backward(dout)
    shapes = {bucket_length(n, sz.length_bucket) for n in sz.lengths + [sz.seq_len]}
    per_shape = 2 if cuda else 1  # on the GPU the block mask is compiled too
    now_graphs, now_breaks = _graphs_and_breaks()
    out.update(
        lengths=len(set(sz.lengths)),
        length_bucket=sz.length_bucket,
        shapes=len(shapes),
        compiled_graphs=now_graphs - graphs,
        graph_breaks=now_breaks - breaks,
        graphs_per_shape=per_shape,
    )
    out["ok"] = ok and out["compiled_graphs"] <= per_shape * len(shapes) and out["graph_breaks"] == 0
    return out


def _dataset(folder: Path, sz: Sizes, lengths: list[int], name: str = "part-0") -> str:
    """One row per length: random tokens, the first quarter prompt (loss_mask 0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = torch.Generator().manual_seed(2)
    table = pa.Table.from_pylist(
        [
            {
                "input_ids": torch.randint(0, sz.vocab - 2, (n,), generator=g).tolist(),
                "loss_mask": [0] * (n // 4) + [1] * (n - n // 4),
            }
            for n in lengths
        ]
    )
    path = folder / f"{name}.parquet"
    pq.write_table(table, path)
    return str(path)


def check_train_step(sz: Sizes, device: str, tmp: Path, peak_tflops: float) -> dict:
    from transformers import AutoConfig

    from dflash_ray.config import TrainConfig
    from dflash_ray.drafter.blocks import bucket_length
    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import to_hf_config
    from bench.simulate import simulate_check
    from dflash_ray.tiny_models import tiny_qwen3
    from dflash_ray.train.workers import ColocatedWorker

    cuda = device.startswith("cuda")
    started = time.perf_counter()
    target = tiny_qwen3(
        tmp / "target",
        num_layers=sz.target_layers,
        hidden_size=sz.hidden,
        vocab_size=sz.vocab,
        intermediate_size=sz.intermediate,
        num_heads=sz.heads,
        num_kv_heads=sz.kv_heads,
        head_dim=sz.head_dim,
        device=device,
        dtype="bfloat16" if cuda else "float32",
    )
    if cuda:
        torch.cuda.empty_cache()
    built = time.perf_counter() - started
    cfg = TrainConfig(
        actor_gpus=1 if cuda else 0,
        num_anchors=sz.anchors,
        num_layers=sz.drafter_layers,
        layer_types=sz.layer_types,
        sliding_window=sz.sliding_window,
        target_layer_ids=sz.layer_ids,
        init="random",
        colocate=True,
        torch_threads=torch.get_num_threads(),
        length_bucket=sz.length_bucket,
    )
    dcfg = from_target(
        AutoConfig.from_pretrained(target),
        mask_token_id=sz.vocab - 1,
        num_layers=sz.drafter_layers,
        target_layer_ids=sz.layer_ids,
        layer_types=sz.layer_types,
        sliding_window=sz.sliding_window,
    )
    worker = ColocatedWorker(target, sz.layer_ids, json.dumps(to_hf_config(dcfg, torch.bfloat16)), "random", cfg, 0, 1)
    total = sz.warmup + sz.steps
    worker.set_total_steps(total)
    data = _dataset(tmp, sz, [sz.seq_len] * 2)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    stats, walls = [], []
    for step in range(total):
        _sync(device)
        start = time.perf_counter()
        stats.append(worker.train_samples(step, [[(data, step % 2)]]))
        _sync(device)
        walls.append(time.perf_counter() - start)
    timed, wall = stats[sz.warmup :], sum(walls[sz.warmup :]) / sz.steps

    def mean(key):
        return sum(s[key] for s in timed) / len(timed)

    # steps over sequences of many lengths: the attention shapes they meet, the graphs compiled for them
    varied = _dataset(tmp, sz, sz.lengths, name="varied")
    shapes = set()  # (context length, query count) as each attention layer receives them
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda m, a: shapes.add((a[1].shape[1], a[0].shape[1])))
        for layer in worker.drafter.layers
    ]
    graphs, breaks = _graphs_and_breaks()
    for i in range(len(sz.lengths)):
        worker.train_samples(total + i, [[(varied, i)]])
    now_graphs, now_breaks = _graphs_and_breaks()
    for hook in hooks:
        hook.remove()
    buckets = {bucket_length(n, sz.length_bucket) for n in sz.lengths}
    shape_stats = {
        "lengths": len(set(sz.lengths)),
        "length_bucket": sz.length_bucket,
        "buckets": len(buckets),
        "attention_shapes": len(shapes),
        "compiled_graphs": now_graphs - graphs,
        "graph_breaks": now_breaks - breaks,
    }
    shapes_ok = len(shapes) <= len(buckets) and now_breaks == breaks and now_graphs - graphs <= 2 * len(buckets)

    # with distillation the target also runs its last layers and its head over the response positions
    # and sends its top-32: the same worker, its settings switched (a frozen config, replaced whole)
    import dataclasses

    worker.cfg = worker.target.cfg = dataclasses.replace(cfg, distill=0.5, distill_top_k=32)
    distilled = []
    for step in range(total + len(sz.lengths), total + len(sz.lengths) + 1 + sz.warmup):
        distilled.append(worker.train_samples(step, [[(data, step % 2)]]))
    distilled = distilled[1:]

    # the paired (non-colocated) path moves each batch's features through host memory: time that trip
    feats = worker.target.features([(data, 0)], to_host=False)["features"]
    host = feats.cpu()
    to_host_s = _timed(lambda: feats.cpu(), device)
    to_pinned_s = _timed(lambda: worker.target._staged("features", feats), device)
    to_device_s = _timed(lambda: host.to(device), device)
    pinned = worker.target._staged("features", feats)
    pinned_to_device_s = _timed(lambda: pinned.to(device, non_blocking=True), device)
    place = worker.place
    layers = worker.target.model.model.layers
    target_params = sum(p.numel() for layer in layers[: max(sz.layer_ids) + 1] for p in layer.parameters())
    drafter_params = sum(p.numel() for p in worker.drafter.parameters())
    head_params = worker.head.numel()
    # the plan's simulation of this very step (fake tensors, the same code), beside what was measured
    sim = simulate_check(
        hidden=sz.hidden,
        intermediate=sz.intermediate,
        heads=sz.heads,
        kv_heads=sz.kv_heads,
        head_dim=sz.head_dim,
        vocab=sz.vocab,
        target_layers=sz.target_layers,
        layer_ids=sz.layer_ids,
        drafter_layers=sz.drafter_layers,
        sliding_window=sz.sliding_window,
        anchors=sz.anchors,
        seq_len=sz.seq_len,
        length_bucket=sz.length_bucket,
    )
    flops = sim["tflops_per_step"] * 1e12
    losses = [s["loss"] for s in stats]
    finite = all(map(torch.isfinite, torch.tensor(losses + [s["loss"] for s in distilled])))
    return {
        "check": "train_step",
        "ok": finite and timed[-1]["grad_norm"] > 0 and shapes_ok,
        **shape_stats,
        "device": place.device,
        "dtype": str(place.dtype).removeprefix("torch."),
        "attention": place.attention,
        "seq_len": sz.seq_len,
        "anchors": sz.anchors,
        "drafter_layers": sz.drafter_layers,
        "target_params_run": target_params,
        "drafter_params": drafter_params,
        "head_params": head_params,
        "step_seconds": wall,
        "tokens_per_s": sz.seq_len / wall,
        "target_seconds": mean("target_seconds"),
        "drafter_seconds": mean("drafter_seconds") - mean("optimizer_seconds"),
        "optimizer_seconds": mean("optimizer_seconds"),
        "first_step_seconds": walls[0],
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "simulated_peak_bytes": sim["peak_gb"] * 1e9,
        "simulated_step_seconds": sim["step_seconds"],
        "model_tflops_per_step": flops / 1e12,
        "mfu": flops / wall / (peak_tflops * 1e12) if cuda else None,
        "peak_tflops": peak_tflops,
        "losses": [round(x, 4) for x in losses],
        "target_build_seconds": built,
        "distill_target_seconds": sum(s["target_seconds"] for s in distilled) / len(distilled),
        "distill_drafter_seconds": sum(s["drafter_seconds"] for s in distilled) / len(distilled),
        "distill_loss": distilled[-1]["loss"],
        "feature_bytes": feats.numel() * feats.element_size(),
        "feature_to_host_seconds": to_host_s,
        "feature_to_device_seconds": to_device_s,
        "feature_to_pinned_host_seconds": to_pinned_s,
        "feature_pinned_to_device_seconds": pinned_to_device_s,
        "feature_host_trip_share_of_step": (to_host_s + to_device_s) / wall,
        "feature_pinned_trip_share_of_step": (to_pinned_s + pinned_to_device_s) / wall,
    }


def check_hybrid_target(sz: Sizes, device: str, tmp: Path) -> dict:
    """The hybrid target's forward (what a target actor runs to capture features) over the shape
    check's lengths: Gated-DeltaNet through flash-linear-attention and causal-conv1d when installed
    (transformers picks them up), else its torch fallback; which one ran is reported. A batch of two
    lengths gives each row the features it gets alone (no state crosses rows or padding)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from dflash_ray.target_model.capture import target_features
    from dflash_ray.tiny_models import tiny_qwen35

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    path = tiny_qwen35(tmp / "hybrid", **sz.hybrid, device=device, dtype=str(dtype).removeprefix("torch."))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    layers = list(range(model.config.num_hidden_layers))
    kernels = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    seconds = {}
    for n in sz.lengths:
        ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
        seconds[n] = _timed(lambda ids=ids: target_features(model, ids, layers), device, reps=1)
    short, long = sz.lengths[0], sz.lengths[-1]
    ids = torch.randint(0, vocab, (2, long), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, short:] = 0
    batch = target_features(model, ids, layers, attention_mask=mask)
    alone = [target_features(model, ids[:1], layers), target_features(model, ids[1:, :short], layers)]
    row_err = max(_rel(batch[0], alone[0][0]), _rel(batch[1, :short], alone[1][0]))
    tokens = sum(seconds) / sum(seconds.values())
    finite = bool(torch.isfinite(batch).all())
    return {
        "check": "hybrid_target",
        "ok": finite and row_err < (2e-2 if cuda else 1e-4),
        "device": device,
        "layers": model.config.layer_types,
        "hidden": model.config.hidden_size,
        "kernels": kernels,
        "gated_deltanet": "fast kernels" if all(kernels.values()) else "torch fallback",
        "tokens_per_s": tokens,
        "seconds_by_length": {str(k): round(v, 4) for k, v in seconds.items()},
        "batch_row_rel_err": row_err,
    }


def check_speculative(sz: Sizes, device: str, tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.drafter.speculative import speculative_decode, target_decode
    from dflash_ray.drafter.forward import forward_loss
    from dflash_ray.target_model.capture import load_embed_and_head, target_features
    from dflash_ray.tiny_models import tiny_qwen3

    path = tiny_qwen3(
        tmp / "spec",
        num_layers=4,
        hidden_size=sz.spec_hidden,
        vocab_size=sz.spec_vocab,
        seed=3,
        num_heads=max(4, sz.spec_hidden // 128),
        num_kv_heads=2,
    )
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    embed, head = (t.to(device, torch.float32) for t in load_embed_and_head(path))
    cfg = from_target(target.config, mask_token_id=sz.spec_vocab - 1, num_layers=1, target_layer_ids=[0, 1, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, sz.spec_vocab - 2, (8,), generator=g).tolist() for _ in range(3)]
    refs = [target_decode(target, p, sz.spec_tokens, set()) for p in prompts]
    # a few steps on the target's own continuations, so drafts get accepted and the check means something
    seqs = torch.tensor([p + r.token_ids for p, r in zip(prompts, refs)], device=device)
    mask = torch.zeros_like(seqs)
    mask[:, 8:] = 1
    feats = target_features(target, seqs, cfg.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(sz.spec_train_steps):
        out = forward_loss(drafter, embed, head, feats, seqs, mask, num_anchors=24, generator=g)
        opt.zero_grad()
        out.loss.loss.backward()
        opt.step()
    drafter.eval()
    spec = [speculative_decode(target, drafter, embed, head, p, sz.spec_tokens, set()) for p in prompts]
    equal = [s.token_ids == r.token_ids for s, r in zip(spec, refs)]
    steps = [a for s in spec for a in s.acceptance]
    return {
        "check": "speculative",
        "ok": all(equal),
        "device": str(target.device),
        "prompts": len(prompts),
        "equal_outputs": sum(equal),
        "tau": sum(steps) / len(steps),
        "speedup": sum(r.seconds for r in refs) / sum(s.seconds for s in spec),
    }


class _CompileCache:
    """Compiled artifacts loaded from `path` at once (before any check compiles) and saved back by
    `finish` (after the last), with what torch compiled in between."""

    def __init__(self, path: str):
        from dflash_ray import storage

        folder = path.endswith("/") or (not storage.is_s3(path) and storage.local_path(path).is_dir())
        self.uri = compile_cache.uri_for(path) if folder else path
        self.before = compile_cache.counts()
        self.errors: list[str] = []
        try:
            self.loaded = compile_cache.load(self.uri)
        except Exception as e:  # an unreadable cache costs the compiles, not the check
            self.loaded = {"loaded_bytes": 0, "entries": {}, "seconds": 0.0}
            self.errors.append(f"load: {type(e).__name__}: {e}"[:1000])

    def finish(self) -> dict:
        compiled = compile_cache.since(self.before)
        try:
            saved = compile_cache.save(self.uri)
        except Exception as e:
            saved = {"saved_bytes": 0, "written": False, "entries": {}, "seconds": 0.0}
            self.errors.append(f"save: {type(e).__name__}: {e}"[:1000])
        out = {
            "check": "compile_cache",
            "ok": not self.errors,
            "uri": self.uri,
            "loaded_bytes": self.loaded["loaded_bytes"],
            "loaded_entries": self.loaded["entries"],
            "load_seconds": self.loaded["seconds"],
            "saved_bytes": saved["saved_bytes"],
            "saved_entries": saved["entries"],
            "written": saved["written"],
            "save_seconds": saved["seconds"],
            **compiled,
        }
        if self.errors:
            out["error"] = "; ".join(self.errors)
        return out


def check_ray_free() -> dict:
    loaded = [m for m in ("ray", "vllm") if m in sys.modules]
    return {"check": "ray_free", "ok": not loaded, "imported": loaded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (the CPU twin in the test suite)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for the MFU")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    parser.add_argument("--json", action="store_true", help="one JSON line per check (always the case)")
    parser.add_argument(
        "--compile-cache",
        default=None,
        metavar="PATH",
        help=f"load compiled artifacts from PATH (a file, or a folder holding {compile_cache.COMPILE_CACHE}) before the "
        "first compile and save them there after the last",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"check": "setup", "ok": False, "error": "no CUDA device: use --device cpu --tiny"}))
        return 1
    sz = TINY_SIZES if args.tiny else FULL_SIZES
    header = {
        "check": "setup",
        "ok": True,
        "device": args.device,
        "tiny": args.tiny,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
    }
    print(json.dumps(header), flush=True)
    cache = _CompileCache(args.compile_cache) if args.compile_cache else None
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        checks = {
            "fused_ce": lambda: check_fused_ce(sz, args.device),
            "flex_attention": lambda: check_flex_attention(sz, args.device),
            "train_step": lambda: check_train_step(sz, args.device, Path(tmp), args.peak_tflops),
            "hybrid_target": lambda: check_hybrid_target(sz, args.device, Path(tmp)),
            "speculative": lambda: check_speculative(sz, args.device, Path(tmp)),
            "layout_step": lambda: check_layout_step(sz, args.device, world=4 if args.tiny else 16, replicas=2),
            "ray_free": check_ray_free,
        }
        for name, run in checks.items():
            if args.only and name not in args.only:
                continue
            start = time.perf_counter()
            try:
                result = run()
            except Exception as e:  # a failed check reports itself; the others still run
                result = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            result["seconds"] = round(time.perf_counter() - start, 2)
            ok = ok and result["ok"]
            print(json.dumps(result), flush=True)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if cache is not None:
        result = cache.finish()
        ok = ok and result["ok"]
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

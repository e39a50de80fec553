"""Load an exported DFlash2 drafter into vLLM's own `DFlash2Qwen3ForCausalLM` and compare (CPU).

Run by `test_dflash2_vllm.py` in its own process (vLLM sets up a process-wide distributed group):
`python tests/vllm_dflash2_parity.py TARGET_DIR DRAFTER_DIR` prints one JSON line. As for DSpark, the
VllmConfig is built for the target alone and the speculative config (method "dflash", which serves
`DFlash2DraftModel`), built and validated by vLLM itself, is set on it after. vLLM's block is the
bonus token plus `num_speculative_tokens` masks: our block size minus one drafts.
"""

import json
import socket
import sys

import torch

from vllm_dspark_parity import _expected  # tests/ is beside this script on sys.path


def _vllm_model(target_dir: str, drafter_dir: str, num_drafts: int):
    from vllm.engine.arg_utils import EngineArgs

    common = {
        "model": target_dir,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 256,
        "skip_tokenizer_init": True,
    }
    vllm_config = EngineArgs(**common).create_engine_config()
    spec = EngineArgs(
        **common, speculative_config={"method": "dflash", "model": drafter_dir, "num_speculative_tokens": num_drafts}
    )
    vllm_config.speculative_config = spec.create_speculative_config(
        vllm_config.model_config, vllm_config.parallel_config
    )
    return vllm_config


def _weights(model, exported: dict[str, torch.Tensor]) -> dict:
    """Every declared parameter filled from the export, and every exported tensor used."""
    declared = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shared = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")  # the target's / unused
    params = dict(model.named_parameters())
    covered = {n.removeprefix("model.") for n in declared}
    fused = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # stacked into qkv_proj, gate_up_proj
    return {
        "declared": declared,
        "not_loaded": sorted(n for n in declared if n not in shared and _expected(exported, n) is None),
        "mismatched": sorted(
            n
            for n in declared
            if n not in shared
            and _expected(exported, n) is not None
            and not torch.equal(params[n].float(), _expected(exported, n).float())
        ),
        "unused_exported": sorted(k for k in exported if k not in covered and k.rsplit(".", 2)[-2] not in fused),
    }


def _conv_diffs(theirs, mine, K: int, H: int, g: torch.Generator) -> dict:
    """The pair around one sublayer on three blocks of rows: vLLM's prepare (pre-convolution and the
    post side's offsets) and finish, against ours."""
    x, y = torch.randn(3 * K, H, generator=g), torch.randn(3 * K, H, generator=g)
    pre, coef = theirs.prepare(x)
    post = theirs.finish(y, coef)
    delta = mine.deltas(x[None])
    return {
        "pre": (pre - mine.convolve(x[None], delta[:, :, 0], 0)[0]).abs().max(),
        "post": (post - mine.convolve(y[None], delta[:, :, 1], 1)[0]).abs().max(),
    }


def _selector_diffs(model, drafter, head: torch.Tensor, g: torch.Generator) -> dict:
    """vLLM's edge scores [b, l, C, C] for two requests, its top-C candidates of the head, against ours."""
    cfg, sel = drafter.cfg, drafter.candidate_selector
    b, steps, C = 2, cfg.block_size - 1, cfg.settings.selector_top_k
    hidden = torch.randn(b, steps, cfg.hidden_size, generator=g)
    cand = torch.randint(0, cfg.vocab_size, (b, steps, C), generator=g)
    unary = torch.randn(b, steps, C, generator=g)
    anchors = torch.randint(0, cfg.vocab_size, (b,), generator=g)
    theirs = model.model.candidate_selector(cand, unary, hidden, anchors)
    ours = torch.stack([sel.edge_scores(hidden[i], int(anchors[i]), cand[i], unary[i]) for i in range(b)])
    ids, values = model.compute_candidates(hidden.flatten(0, 1))
    our_values, our_ids = (hidden.flatten(0, 1) @ head.t()).topk(C, -1)
    return {
        "selector_scores": (theirs - ours).abs().max(),
        "candidate_logits": (values - our_values).abs().max(),
        "candidate_ids": (ids != our_ids).sum().float(),
    }


def main(target_dir: str, drafter_dir: str) -> dict:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from dflash_ray.drafter.export import load_drafter

    drafter = load_drafter(drafter_dir).eval()
    cfg = drafter.cfg
    vllm_config = _vllm_model(target_dir, drafter_dir, cfg.block_size - 1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    draft_hf = vllm_config.speculative_config.draft_model_config.hf_config
    result: dict = {
        "method": vllm_config.speculative_config.method,
        "architectures": draft_hf.architectures,
        "dflash_config": dict(draft_hf.dflash_config),
    }
    with set_current_vllm_config(vllm_config), torch.no_grad():
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

        model = DFlash2Qwen3ForCausalLM(vllm_config=vllm_config)
        exported = load_file(f"{drafter_dir}/model.safetensors")
        model.load_weights(exported.items())  # an unknown name raises here
        result.update(_weights(model, exported))
        result["conv_block_size"] = model.model.layers[0].attention_conv.block_size
        head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        model.lm_head.weight.data.copy_(head)  # the target's, shared at serving time
        # the CPU linear layers repack their weights for inference: compared above, before this
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))

        g = torch.Generator().manual_seed(0)
        N, H = 7, cfg.hidden_size
        features, x = torch.randn(N, cfg.num_features * H, generator=g), torch.randn(N, H, generator=g)
        diffs = {}
        ctx = model.combine_hidden_states(features)
        diffs["fc"] = (ctx - drafter.fc(features)).abs().max()
        ours_ctx = drafter.hidden_norm(drafter.fc(features))
        layers = model.model.layers
        k, v = model.model._project_context_kv(ctx, N, len(layers), cfg.num_kv_heads, cfg.head_dim)
        k = model.model._normalize_context_k(k)
        for i, (theirs, mine) in enumerate(zip(layers, drafter.layers)):
            attn = mine.self_attn
            our_k = attn.k_norm(attn.k_proj(ours_ctx).view(N, cfg.num_kv_heads, cfg.head_dim))
            diffs[f"layer{i}.context_k"] = (k[i] - our_k).abs().max()
            diffs[f"layer{i}.context_v"] = (
                (v[i] - attn.v_proj(ours_ctx).view(N, cfg.num_kv_heads, cfg.head_dim)).abs().max()
            )
            diffs[f"layer{i}.mlp"] = (theirs.mlp(x) - mine.mlp(x)).abs().max()
            diffs[f"layer{i}.input_layernorm"] = (theirs.input_layernorm(x) - mine.input_layernorm(x)).abs().max()
            for name in ("attention_conv", "mlp_conv"):
                for side, d in _conv_diffs(getattr(theirs, name), getattr(mine, name), cfg.block_size, H, g).items():
                    diffs[f"layer{i}.{name}.{side}"] = d
        diffs["norm"] = (model.model.norm(x) - drafter.norm(x)).abs().max()
        diffs.update(_selector_diffs(model, drafter, head, g))
        result["max_abs_diff"] = {name: float(d) for name, d in diffs.items()}
    return result


if __name__ == "__main__":
    print("PARITY " + json.dumps(main(sys.argv[1], sys.argv[2])))

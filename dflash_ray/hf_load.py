"""Every tokenizer, config and model that transformers or vLLM reads from a folder goes through here.

A model folder is the user's input, and a Hugging Face folder can carry code: an `auto_map` in its
`config.json` or `tokenizer_config.json` names Python files beside it that transformers imports
when asked to trust them (and, without an answer either way, asks on the terminal). Nothing here
runs code from a folder: `check_no_code` reads the folder's own JSON files first and refuses an
`auto_map` (or a `trust_remote_code` request) naming the file and field, so no prompt ever appears,
and every load passes `trust_remote_code=False` as well. A test holds the package to this: no other
module calls `from_pretrained` or builds a vLLM engine from a path itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dflash_ray import progress
from dflash_ray.errors import DFlashError

# the JSON files of a model folder that transformers or vLLM read a class or a code reference from
CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
CODE_KEYS = ("auto_map", "trust_remote_code")
READ_BLOCK = 16 << 20  # bytes read at a time when a model's files are read through (`read_through`)


def _code_keys(value: Any, where: str) -> str | None:
    """The dotted key of the first code reference in a config's mapping (sub-configs included)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in CODE_KEYS and inner not in (None, False, {}, []):
                return f"{where}{key}"
            found = _code_keys(inner, f"{where}{key}.")
            if found:
                return found
    return None


def check_no_code(folder: str | Path) -> None:
    """Refuse a model or tokenizer folder whose JSON files ask for code to be run, or are not JSON."""
    base = Path(folder)
    if not base.is_dir():
        return  # a single file (a GGUF) carries no code reference; a missing folder is named by the load
    for name in CODE_FILES:
        path = base / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as e:
            raise DFlashError(f"not valid JSON ({e}): a model folder's {name} must be", file=str(path)) from None
        except OSError as e:
            raise DFlashError(f"cannot be read: {e.strerror or e}", file=str(path)) from None
        if not isinstance(data, dict):
            raise DFlashError(f"a JSON {type(data).__name__}, not a mapping", file=str(path))
        found = _code_keys(data, "")
        if found:
            raise DFlashError(
                "asks for Python code shipped in the folder to be run; dflash-ray runs no code from a model "
                "or tokenizer folder: use a folder whose classes transformers knows (remove the key)",
                file=str(path),
                field=found,
            )


def tokenizer(folder: str | Path, **kwargs: Any):
    """A fast tokenizer (with its chat template) from `folder`, no code run."""
    from transformers import AutoTokenizer

    check_no_code(folder)
    loaded = AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **kwargs)
    if len(loaded) < 2:  # transformers builds an empty one from a model folder without tokenizer files
        raise DFlashError(
            f"holds no tokenizer (a vocabulary of {len(loaded)}: no tokenizer.json, vocab or merges files): "
            "give a folder or name that has one (a short name such as qwen3, or the model's own folder)",
            file=str(folder),
        )
    return loaded


def config(folder: str | Path):
    """A model's Hugging Face config from `folder`, no code run."""
    from transformers import AutoConfig

    check_no_code(folder)
    return AutoConfig.from_pretrained(folder, trust_remote_code=False)


def causal_lm(folder: str | Path, **kwargs: Any):
    """A causal LM with its weights from `folder`, no code run (its config checked as `config` does).
    Inside Ray its weight files are first read through once, counted as progress: a stream actor
    loading 54 GB from a slow disk is seen moving (`read_through`)."""
    from transformers import AutoModelForCausalLM

    check_no_code(folder)
    with progress.doing(f"loading {folder} from the node's disk"):
        if progress.watched():
            base = Path(folder)
            read_through(
                sorted(base.glob("*.safetensors")) + ([base / kwargs["gguf_file"]] if "gguf_file" in kwargs else [])
            )
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, **kwargs)


def read_through(paths: list[Path]) -> int:
    """Read `paths` once, in order, counting the bytes as progress (`progress.add`); returns them.
    transformers' loader reads the weights where no count can follow it; this one sequential pass
    brings them into the page cache, where the loader then finds them: on a slow disk it moves
    the disk's time here, where it is seen, at the cost of one copy from the cache (GB/s); only
    a node whose memory cannot hold the files reads them from the disk twice."""
    buffer = memoryview(bytearray(READ_BLOCK))
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger read-ahead
            while n := f.readinto(buffer):
                total += n
                progress.add(n)
    return total


def vllm_engine(model: str, **kwargs: Any):
    """A vLLM engine over the model folder `model` (and any drafter folder its speculative config
    names), no code run."""
    from vllm import LLM

    check_no_code(model)
    spec = kwargs.get("speculative_config") or {}
    if isinstance(spec, dict) and isinstance(spec.get("model"), str):
        check_no_code(spec["model"])
    if kwargs.pop("trust_remote_code", False):
        raise DFlashError("dflash-ray runs no code from a model folder", field="generate.engine_args.trust_remote_code")
    return LLM(model=model, trust_remote_code=False, **kwargs)

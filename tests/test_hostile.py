"""Hostile input at every door of every command, from one table.

Each command of `dflash-ray --help` is listed in `DOORS` with the inputs it takes (a file, a folder,
a URI, a setting, an environment variable) and, for each, the standard cases a careless or hostile
user hands it: missing, empty, binary, another format, a path that leaves its folder, a link out, a
pickle where safetensors goes, NaN weights, absurd numbers, an unsupported scheme, code in a model
folder, a folder of the user's own files. Every case must exit 2 (3 for the gate) with a message
naming the file or field, before Ray starts, the user's files byte-identical afterwards and nothing
outside a folder read. A command missing from the table fails `test_every_command_is_listed`, so the
next command is covered the day it is added. The cases run in-process through `cli.main`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from dflash_ray import storage
from dflash_ray.cli import _parser, main

SMALL = ["train.num_layers=1", "train.target_layer_ids=[0,1,2]"]


@dataclass
class World:
    """What the cases are built from: a tiny target, a drafter exported for it, and a scratch folder."""

    root: Path
    target: str
    drafter: str
    weights: dict[str, torch.Tensor]

    def folder(self, name: str) -> Path:
        out = self.root / name
        out.mkdir(parents=True, exist_ok=True)
        return out

    def copy_drafter(self, name: str) -> Path:
        out = self.folder(name)
        for f in Path(self.drafter).iterdir():
            if f.name in ("config.json", "model.safetensors"):
                (out / f.name).write_bytes(f.read_bytes())
        return out

    def users_folder(self, name: str, files: dict[str, bytes]) -> Path:
        out = self.folder(name)
        for n, data in files.items():
            (out / n).write_bytes(data)
        return out

    def code_folder(self, name: str, of: str) -> Path:
        """A copy of the folder `of` whose config.json names Python code to run (an `auto_map`)."""
        from dflash_ray.registry import QWEN3, resolve

        out = self.folder(name)
        for source in (Path(resolve(QWEN3, need="tokenizer")), Path(of)):
            for f in source.iterdir():
                if f.is_file():
                    (out / f.name).write_bytes(f.read_bytes())
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        (out / "evil.py").write_text(f"open({str(self.root / 'RAN')!r}, 'w').write('ran')\n")
        return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from dflash_ray.config import load_config
    from dflash_ray.drafter.export import from_hf_config, save_drafter
    from dflash_ray.drafter.init import initial_drafter
    from dflash_ray.tiny_models import tiny_qwen3
    from dflash_ray.train.shape import drafter_config

    root = tmp_path_factory.mktemp("hostile")
    target = str(tiny_qwen3(root / "target", num_layers=4, hidden_size=64))
    bare = root / "bare-target"  # a model without its tokenizer's files
    bare.mkdir()
    for f in Path(target).iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    from dflash_ray.registry import QWEN3, resolve

    for f in Path(resolve(QWEN3, need="tokenizer")).iterdir():  # the target's own tokenizer beside it
        if f.is_file():
            (Path(target) / f.name).write_bytes(f.read_bytes())
    drafter = initial_drafter(from_hf_config(drafter_config(target, load_config(None, SMALL))), target, "random", 7)
    save_drafter(drafter, root / "drafter", dtype=torch.float32)
    from dflash_ray.stages.prompts import run_prompts

    chat = [{"role": "user", "content": "hello?"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    (root / "answered.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    run_prompts([str(root / "answered.jsonl")], str(root / "prompts"), load_config(), progress=False)
    run_prompts(
        [str(root / "answered.jsonl")], str(root / "completions"), load_config(), progress=False, responses=True
    )
    import ray

    from dflash_ray.stages.tokenize import run_tokenize

    joined = ray.is_initialized()  # a session cluster an earlier test of this worker started stays up
    tokenizing = load_config(None, ["tokenize.tokenizer=qwen3", "ray.num_cpus=2"])
    run_tokenize(str(root / "completions"), str(root / "tokenized-here"), tokenizing)
    if not joined:
        ray.shutdown()  # every case starts with no Ray: a refusal must come before one starts
    return World(root, target, str(root / "drafter"), {k: v.clone() for k, v in drafter.state_dict().items()})


@dataclass
class Case:
    """One hostile input: the command line, the words its error must carry, the files that must stay
    byte-identical, and the environment it runs in."""

    argv: list[str]
    says: tuple[str, ...]
    kept: tuple[Path, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    code: int = 2
    unread: tuple[Path, ...] = ()  # files outside a folder that must never be read


def _digests(paths: tuple[Path, ...]) -> dict[str, str]:
    out = {}
    for top in paths:
        for p in [top] if top.is_file() else sorted(q for q in top.rglob("*") if q.is_file()):
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ---- the standard cases, by the kind of input ----


def _binary(world: World, name: str) -> Path:
    path = world.root / name
    path.write_bytes(bytes(range(256)) * 4)
    return path


def _outside_index(world: World, name: str) -> tuple[Path, Path]:
    """A sharded drafter whose index names a file outside its folder: (folder, the outside file)."""
    from safetensors.torch import save_file

    folder = world.folder(name)
    (folder / "config.json").write_bytes((Path(world.drafter) / "config.json").read_bytes())
    outside = world.folder(name + "-outside") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in world.weights.items()}, str(outside))
    rel = os.path.relpath(outside, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: rel for k in world.weights}}))
    return folder, outside


def _absolute_index(world: World, name: str) -> tuple[Path, Path]:
    folder, outside = _outside_index(world, name)
    index = {"weight_map": {k: str(outside) for k in world.weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, outside


def _linked_out(world: World, name: str) -> tuple[Path, Path]:
    """A drafter folder whose weights are a link to a file outside it."""
    folder = world.copy_drafter(name)
    outside = world.folder(name + "-outside") / "weights.safetensors"
    outside.write_bytes((folder / "model.safetensors").read_bytes())
    (folder / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model-00001-of-00001.safetensors").unlink()
    (folder / "model-00001-of-00001.safetensors").symlink_to(outside)
    index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in world.weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder, outside


def _pickled(world: World, name: str) -> Path:
    folder = world.copy_drafter(name)
    torch.save(world.weights, folder / "model.safetensors")
    return folder


def _bin_only(world: World, name: str) -> Path:
    folder = world.copy_drafter(name)
    (folder / "model.safetensors").unlink()
    torch.save(world.weights, folder / "pytorch_model.bin")
    return folder


def _nan(world: World, name: str) -> Path:
    from safetensors.torch import save_file

    folder = world.copy_drafter(name)
    weights = {k: v.clone() for k, v in world.weights.items()}
    weights["fc.weight"][0, 0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def _cut(world: World, name: str) -> Path:
    folder = world.copy_drafter(name)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


def _missing_shard(world: World, name: str) -> Path:
    folder, outside = _outside_index(world, name)
    index = {"weight_map": {k: "model-00002-of-00002.safetensors" for k in world.weights}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _empty(world: World) -> Path:
    path = world.root / "empty.jsonl"
    path.write_bytes(b"")
    return path


def _folder_linking_out(world: World) -> Path:
    """An input folder whose only file is a link to a file outside it."""
    folder = world.folder("linking-out")
    outside = world.folder("linked-to") / "chats.jsonl"
    outside.write_text(json.dumps({"messages": [{"role": "user", "content": "from outside"}]}) + "\n")
    if not (folder / "chats.jsonl").is_symlink():
        (folder / "chats.jsonl").symlink_to(outside)
    return folder


def _manifest_out(world: World) -> Path:
    """A copy of a finished dataset whose manifest names a file outside its folder."""
    folder = world.folder("manifest-out")
    for f in (world.root / "completions").iterdir():
        if f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((folder / "_manifest.json").read_text())
    for entry in manifest.get("files", []):
        entry["name"] = "../completions/" + entry["name"]
    (folder / "_manifest.json").write_text(json.dumps(manifest))
    return folder


def warm_starts(world: World, command: Callable[[str], list[str]]) -> dict[str, Case]:
    """Every way a drafter folder read from outside can be bad, for a command that reads one."""
    out: dict[str, Case] = {}
    for kind, make in (("relative", _outside_index), ("absolute", _absolute_index), ("link", _linked_out)):
        folder, outside = make(world, f"{kind}-out")
        out[f"index-{kind}-out"] = Case(command(str(folder)), ("model.safetensors.index.json",), unread=(outside,))
    out["pickle"] = Case(command(str(_pickled(world, "pickled"))), ("pickle", "model.safetensors"))
    out["bin-only"] = Case(command(str(_bin_only(world, "bin-only"))), ("pytorch_model.bin", "safetensors only"))
    out["nan"] = Case(command(str(_nan(world, "nan"))), ("NaN", "fc.weight"))
    out["cut"] = Case(command(str(_cut(world, "cut"))), ("model.safetensors", "cut short"))
    out["missing-shard"] = Case(command(str(_missing_shard(world, "missing-shard"))), ("model-00002-of-00002",))
    out["missing"] = Case(command(str(world.root / "no-such-drafter")), ("no-such-drafter",))
    return out


def _chats(world: World, name: str = "chats.jsonl") -> Path:
    path = world.root / name
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello?"}]}) + "\n")
    return path


def user_output(world: World, name: str, command: Callable[[str], list[str]], *files: str) -> Case:
    """An output folder that holds the user's own files: refused, every byte kept."""
    folder = world.users_folder(name, {f: f"the user's own {f}".encode() for f in files})
    return Case(command(str(folder)), (str(folder),), kept=(folder,))


# ---- the table: every command, each of its doors ----


def doors(world: World) -> dict[str, dict[str, Case]]:
    w, t = world, world.target
    chats, binary = _chats(w), _binary(w, "binary.jsonl")
    missing = str(w.root / "missing.jsonl")
    tokenizer_code = str(w.code_folder("code-tokenizer", t))
    if (Path(w.drafter) / "config.json").read_text() != "{}":  # the real world: an export of ours to pretrain over
        assert main(["export", w.drafter, str(w.root / "exported")]) == 0
    train = ["train", "--data", str(w.root / "data"), "--target", t, "--output", str(w.root / "train-out")]
    pretrain = ["pretrain", "--target", t, "--data", str(chats), "--output", str(w.root / "pretrain-out")]
    evaluate = ["evaluate", "--target", t, "--prompts", str(w.root / "prompts"), "--tokenizer", "qwen3"]
    small = [a for s in SMALL for a in ("--set", s)]
    return {
        "prompts": {
            "input-missing": Case(["prompts", "--input", missing, "--output", str(w.root / "p1")], ("missing.jsonl",)),
            "input-scheme": Case(["prompts", "--input", "gs://b/x.jsonl", "--output", str(w.root / "p2")], ("gs://",)),
            "input-empty": Case(
                ["prompts", "--input", str(_empty(w)), "--output", str(w.root / "p3")], ("empty.jsonl",)
            ),
            "input-binary": Case(
                ["prompts", "--input", str(binary), "--output", str(w.root / "p4")], ("binary.jsonl",)
            ),
            "input-link-out": Case(
                ["prompts", "--input", str(_folder_linking_out(w)), "--output", str(w.root / "p5")], ("linking-out",)
            ),
            "output-users": user_output(
                w, "users-prompts", lambda o: ["prompts", "--input", str(chats), "--output", o], "prompts-00000.parquet"
            ),
        },
        "responses": {
            "input-missing": Case(
                ["responses", "--input", missing, "--output", str(w.root / "r1")], ("missing.jsonl",)
            ),
            "output-users": user_output(
                w, "users-responses", lambda o: ["responses", "--input", str(chats), "--output", o], "notes.md"
            ),
        },
        "selfprompt": {
            "model-missing": Case(
                ["selfprompt", "--model", str(w.root / "no-model"), "--count", "1", "--output", str(w.root / "s1")],
                ("no-model",),
            ),
            "model-code": Case(
                ["selfprompt", "--model", tokenizer_code, "--count", "1", "--output", str(w.root / "s2")],
                ("tokenizer_config.json", "auto_map"),
            ),
            "output-users": user_output(
                w,
                "users-selfprompt",
                lambda o: ["selfprompt", "--model", t, "--count", "1", "--output", o],
                "self-prompts.jsonl",
            ),
        },
        "generate": {
            "prompts-missing": Case(
                ["generate", "--prompts", missing, "--output", str(w.root / "g1"), "--model", t], ("missing.jsonl",)
            ),
            "model-code": Case(
                ["generate", "--prompts", str(w.root / "prompts"), "--output", str(w.root / "g2")]
                + ["--model", tokenizer_code],
                ("tokenizer_config.json", "auto_map"),
            ),
            "output-users": user_output(
                w,
                "users-generate",
                lambda o: ["generate", "--prompts", str(w.root / "prompts"), "--output", o, "--model", t],
                "completions-00000.parquet",
            ),
        },
        "scale": {},  # acts on a running generation by name only: the options every command shares
        "pause": {},
        "resume": {},
        "status": {
            "output-missing": Case(["status", "--output", str(w.root / "no-generation")], ("no-generation",)),
        },
        "tokenize": {
            "tokenizer-code": Case(
                [
                    "tokenize",
                    "--input",
                    str(w.root / "completions"),
                    "--output",
                    str(w.root / "t1"),
                    "--tokenizer",
                    tokenizer_code,
                ],
                ("tokenizer_config.json", "auto_map"),
            ),
            "input-missing": Case(
                ["tokenize", "--input", str(w.root / "no-completions"), "--output", str(w.root / "t2")],
                ("no-completions",),
            ),
        },
        "validate": {
            "input-missing": Case(["validate", "--input", str(w.root / "no-tokenized")], ("no-tokenized",)),
            "input-users": Case(
                ["validate", "--input", str(w.users_folder("users-validate", {"a.parquet": b"PAR1 not really"}))],
                ("users-validate",),
            ),
            "manifest-out": Case(["validate", "--input", str(_manifest_out(w))], ("_manifest.json", "..")),
            "input-prompts": Case(["validate", "--input", str(w.root / "prompts")], ("prompts",)),
        },
        "train": {
            "target-code": Case(
                [*train[:3], "--target", tokenizer_code, *train[5:]], ("tokenizer_config.json", "auto_map")
            ),
            "output-users": user_output(
                w, "users-train", lambda o: [*train[:5], "--output", o, *small], "metrics.jsonl"
            ),
            **{
                f"init-from-{k}": v
                for k, v in warm_starts(w, lambda d: [*train, *small, "--set", f"train.init_from={d}"]).items()
            },
        },
        "pretrain": {
            "data-binary": Case([*pretrain[:3], "--data", str(binary), *pretrain[5:], *small], ("binary.jsonl",)),
            "target-code": Case(
                ["pretrain", "--target", tokenizer_code, *pretrain[3:], *small], ("tokenizer_config.json", "auto_map")
            ),
            "output-users": user_output(
                w,
                "users-pretrain",
                lambda o: [*pretrain[:5], "--output", o, *small],
                "config.json",
                "model.safetensors",
            ),
            "output-another-export": Case(
                [*pretrain[:5], "--output", str(w.root / "exported"), *small],
                ("exported", "made_by"),
                kept=(w.root / "exported",),
            ),
            "target-without-tokenizer": Case(
                ["pretrain", "--target", str(w.root / "bare-target"), *pretrain[3:], *small],
                ("bare-target", "no tokenizer"),
            ),
            "batch-absurd": Case(
                [*pretrain, *small, "--set", "pretrain.batch_size=" + "1" * 21], ("pretrain.batch_size",)
            ),
        },
        "export": {
            **{f"checkpoint-{k}": v for k, v in warm_starts(w, lambda d: ["export", d, str(w.root / "e1")]).items()},
            "output-users": user_output(w, "users-export", lambda o: ["export", w.drafter, o], "notes.md"),
        },
        "evaluate": {
            **{f"drafter-{k}": v for k, v in warm_starts(w, lambda d: [*evaluate, "--drafter", d]).items()},
            "tokenizer-code": Case(
                [*evaluate[:5], "--tokenizer", tokenizer_code, "--drafter", w.drafter],
                ("tokenizer_config.json", "auto_map"),
            ),
        },
        "onesample": {
            "target-code": Case(["onesample", "--target", tokenizer_code], ("tokenizer_config.json", "auto_map")),
            "target-missing": Case(["onesample", "--target", str(w.root / "no-target")], ("no-target",)),
        },
        "pipeline": {
            "target-code": Case(
                ["pipeline", "--target", tokenizer_code, "--workdir", str(w.root / "pipe"), "--input", str(chats)],
                ("tokenizer_config.json", "auto_map"),
            ),
        },
        "netcheck": {
            "megabytes-nan": Case(["netcheck", "--megabytes", "nan"], ("--megabytes",)),
        },
        "plan": {
            "cluster-missing": Case(["plan", "--cluster", str(w.root / "no-cluster.yaml")], ("no-cluster.yaml",)),
            "cluster-binary": Case(["plan", "--cluster", str(binary)], ("binary.jsonl",)),
        },
        "demo": {
            "workdir-file": Case(["demo", "--workdir", str(chats)], (str(chats),)),
        },
    }


def _yaml(world: World, name: str, text: str) -> Path:
    path = world.root / name
    path.write_text(text)
    return path


def _cluster(gpus: str, workers: int) -> str:
    return (
        "available_node_types:\n"
        f"  gen: {{max_workers: {workers}, resources: {{GPU: {gpus}, gen_node: 1}}}}\n"
        f"  train: {{max_workers: {workers}, resources: {{GPU: {gpus}, train_node: 1}}}}\n"
    )


_NO_S3 = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
    "AWS_ACCESS_KEY_ID": "x",
    "AWS_SECRET_ACCESS_KEY": "x",
    "DFLASH_RAY_S3_CONNECT_TIMEOUT_S": "1",
    "AWS_MAX_ATTEMPTS": "1",
}


def more_doors(world: World) -> dict[str, dict[str, Case]]:
    """Folders written beside the input or the user's files, tokenizers and targets that are not
    what they claim, configs and cluster files that are not sane YAML, a Ray address that is none."""
    w, t = world, world.target
    tok, comp, prompts = str(w.root / "tokenized-here"), str(w.root / "completions"), str(w.root / "prompts")
    deep = "train: " + "[" * 20000 + "]" * 20000 + "\n"
    evaluate = ["evaluate", "--target", t, "--prompts", prompts, "--tokenizer", "qwen3", "--drafter", w.drafter]
    bare = str(w.root / "bare-target")
    return {
        "validate": {
            "report-users": user_output(
                w, "users-report", lambda o: ["validate", "--input", tok, "--report", o], "report.md"
            ),
            "report-in-input": Case(["validate", "--input", tok, "--report", tok], (tok,), kept=(Path(tok),)),
        },
        "evaluate": {
            "report-users": user_output(w, "users-evaluation", lambda o: [*evaluate, "--report", o], "evaluation.png"),
            "target-a-drafter": Case([*evaluate[:2], w.drafter, *evaluate[3:]], ("--target",)),
        },
        "tokenize": {
            "tokenizer-none-there": Case(
                ["tokenize", "--input", comp, "--output", str(w.root / "t3"), "--tokenizer", bare],
                ("bare-target", "no tokenizer"),
            ),
            "output-inside-input": Case(
                ["tokenize", "--input", comp, "--output", comp + "/tok", "--tokenizer", "qwen3"], ("overlap",)
            ),
        },
        "generate": {
            "output-inside-input": Case(
                ["generate", "--prompts", prompts, "--output", prompts + "/gen", "--model", t], ("overlap",)
            ),
        },
        "train": {
            "data-prompts": Case(
                ["train", "--data", prompts, "--target", t, "--output", str(w.root / "tr-p")], ("prompts",)
            ),
        },
        "pipeline": {
            "workdir-users": user_output(
                w,
                "users-workdir",
                lambda o: ["pipeline", "--workdir", o, "--target", t, "--input", str(w.root / "answered.jsonl")],
                "chat.jsonl",
                "notes.md",
            ),
        },
        "plan": {
            "config-list-key": Case(
                ["plan", "--config", str(_yaml(w, "listkey.yaml", "train: {? [a, b] : 1}\n"))], ("listkey.yaml",)
            ),
            "config-deep": Case(["plan", "--config", str(_yaml(w, "deep.yaml", deep))], ("deep.yaml",)),
            "config-device": Case(["plan", "--config", "/dev/zero"], ("/dev/zero",)),
            "cluster-inf": Case(
                ["plan", "--cluster", str(_yaml(w, "inf-cluster.yaml", _cluster(".inf", 1)))], ("inf-cluster.yaml",)
            ),
            "cluster-huge": Case(
                ["plan", "--cluster", str(_yaml(w, "huge-cluster.yaml", _cluster("1000000", 10**12)))],
                ("huge-cluster.yaml",),
            ),
        },
        "status": {"address-not-a-url": Case(["status", "--set", "ray.address=http://[::1"], ("ray.address",))},
        "pause": {"name-empty": Case(["pause", "--name", ""], ("--name",))},
        "scale": {"count-huge": Case(["scale", "generators", "99999999999"], ("99999999999",))},
        "prompts": {
            "input-s3-no-bucket": Case(
                ["prompts", "--input", "s3://", "--output", str(w.root / "p6")], ("s3://",), env=_NO_S3
            ),
        },
    }


def all_doors(world: World) -> dict[str, dict[str, Case]]:
    """`doors` and `more_doors` in one table."""
    table = doors(world)
    for command, cases in more_doors(world).items():
        table[command].update(cases)
    return table


# the arguments each command cannot run without, for the cases every command shares
REQUIRED = {
    "prompts": ["--input", "x.jsonl", "--output", "out"],
    "responses": ["--input", "x.jsonl", "--output", "out"],
    "selfprompt": ["--model", "m", "--output", "out"],
    "generate": ["--prompts", "p", "--output", "out", "--model", "m"],
    "scale": ["generators", "2"],
    "tokenize": ["--input", "c", "--output", "out"],
    "validate": ["--input", "t"],
    "train": ["--data", "d", "--target", "m", "--output", "out"],
    "pretrain": ["--target", "m", "--data", "d", "--output", "out"],
    "export": ["ckpt", "out"],
    "evaluate": ["--drafter", "d", "--target", "m", "--prompts", "p"],
    "onesample": ["--target", "m"],
}

# (arguments added to the command, environment, words the error must carry): for every command
SHARED = {
    "config-missing": (["--config", "no-such-config.yaml"], {}, ("no-such-config.yaml",)),
    "config-scheme": (["--config", "gs://bucket/run.yaml"], {}, ("gs://",)),
    "setting-absurd": (["--set", "train.batch_size=" + "9" * 21], {}, ("train.batch_size",)),
    "setting-nan": (["--set", "train.lr=nan"], {}, ("train.lr",)),
    "setting-unknown": (["--set", "train.no_such_field=1"], {}, ("no_such_field",)),
    "setting-lr-huge": (["--set", "train.lr=1e12"], {}, ("train.lr",)),
    "env-chunk-tiny": ([], {"DFLASH_RAY_S3_CHUNK_MB": "1e-9"}, ("DFLASH_RAY_S3_CHUNK_MB",)),
    "env-timeout-text": ([], {"DFLASH_RAY_S3_READ_TIMEOUT_S": "soon"}, ("DFLASH_RAY_S3_READ_TIMEOUT_S",)),
}


def _commands() -> list[str]:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    return sorted(sub.choices)  # type: ignore[union-attr]


def _stub_table() -> dict[str, dict[str, Case]]:
    """The table built over stand-in files: its commands and case names, for the parametrization (the
    real world is built once, by the `world` fixture)."""
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        stub = World(tmp, str(tmp / "target"), str(tmp / "drafter"), {"fc.weight": torch.zeros(2, 2)})
        (tmp / "target").mkdir()
        (tmp / "target" / "tokenizer_config.json").write_text("{}")
        (tmp / "drafter").mkdir()
        (tmp / "drafter" / "config.json").write_text("{}")
        (tmp / "completions").mkdir()
        (tmp / "completions" / "_manifest.json").write_text("{}")
        save_file(stub.weights, str(tmp / "drafter" / "model.safetensors"))
        return all_doors(stub)


STUB = _stub_table()


def test_every_command_is_listed():
    """A command of `dflash-ray --help` that the table does not list fails here."""
    assert set(_commands()) == set(STUB), "list the new command's doors in tests/test_hostile.py"


@pytest.fixture
def no_ray(monkeypatch):
    """Ray must not start: a refusal comes before it. A cluster an earlier test of this worker left up
    is hidden, so that a command reaches for Ray here exactly as it would in a fresh process."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray started before the input was refused")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def _run(case: Case, capsys, monkeypatch, world_root: Path) -> None:
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    read: list[str] = []
    real = storage.read_bytes

    def watched(uri, *a, **k):
        read.append(str(uri))
        return real(uri, *a, **k)

    monkeypatch.setattr(storage, "read_bytes", watched)
    before = _digests(case.kept)
    code = main([*case.argv, "--json"])
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    assert code == case.code, f"exit {code}: {err[-3000:]}"
    assert not summary.get("bug"), err[-3000:]
    for word in case.says:
        assert word in summary.get("error", ""), f"{word!r} not in {summary.get('error')!r}"
    assert _digests(case.kept) == before, "a file of the user's was changed"
    for outside in case.unread:
        assert not any(Path(r).resolve() == outside.resolve() for r in read if not r.startswith("s3://")), (
            f"{outside} was read"
        )
    assert not (world_root / "RAN").exists(), "code from a model folder ran"


@pytest.fixture(scope="module")
def table(world) -> dict[str, dict[str, Case]]:
    return all_doors(world)


@pytest.mark.parametrize("command, name", [(c, k) for c, cases in STUB.items() for k in cases])
def test_hostile_door(command, name, table, world, no_ray, capsys, monkeypatch):
    _run(table[command][name], capsys, monkeypatch, world.root)


@pytest.mark.parametrize("command", sorted(STUB))
@pytest.mark.parametrize("name", sorted(SHARED))
def test_hostile_shared(command, name, tmp_path, no_ray, capsys, monkeypatch):
    """The options every command shares (`--config`, `--set`, the environment), bad, at every command."""
    extra, env, says = SHARED[name]
    monkeypatch.chdir(tmp_path)
    _run(Case([command, *REQUIRED.get(command, []), *extra], says, env=env), capsys, monkeypatch, tmp_path)


def test_every_hugging_face_load_goes_through_the_one_door():
    """No module but `hf_load` calls `from_pretrained` or builds a vLLM engine from a path: each such
    load elsewhere would be a door where a model folder's code could run."""
    import re

    package = Path(__file__).parent.parent / "dflash_ray"
    pattern = re.compile(r"\.from_pretrained\(|\bLLM\(")
    found = [
        f"{p.relative_to(package)}:{i}"
        for p in sorted(package.rglob("*.py"))
        if p.name != "hf_load.py"
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, f"load through dflash_ray.hf_load instead: {found}"


def test_a_tokenizer_folder_with_code_is_refused_with_no_prompt_and_nothing_run(world, monkeypatch):
    """transformers asks on the terminal whether to run a folder's `auto_map` code: here nothing asks."""
    import builtins

    from dflash_ray.errors import DFlashError
    from dflash_ray.registry import load_tokenizer

    def no_prompt(*args, **kwargs):
        raise AssertionError("a prompt was shown")

    monkeypatch.setattr(builtins, "input", no_prompt)
    folder = world.code_folder("asked", world.target)
    with pytest.raises(DFlashError, match="auto_map"):
        load_tokenizer(str(folder))
    assert not (world.root / "RAN").exists()


def test_a_drafter_saved_in_shards_exports_whole(world, tmp_path, capsys):
    """A released drafter in shards (`model.safetensors.index.json`) exports as one file, its weights
    unchanged: its config.json is there, and the export says so."""
    from safetensors.torch import load_file, save_file

    names = sorted(world.weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((Path(world.drafter) / "config.json").read_bytes())
    for file, part in halves.items():
        save_file({k: world.weights[k].contiguous() for k in part}, str(sharded / file))
    index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["export", str(sharded), str(tmp_path / "out"), "--dtype", "float32"]) == 0, capsys.readouterr().err
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(world.weights) and all(torch.equal(got[k], world.weights[k]) for k in got)

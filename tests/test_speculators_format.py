"""A DFlash drafter saved by vLLM's speculators trainer (its checkpoint format, written here by hand
from one of ours: their field and weight names, their layer ids one higher; and the config their own
trainer wrote in `bench.peers`, in tests/data) is read as ours by
`load_drafter`, `export` and `train.init_from`: the same weights and the same captured layers; a
missing field or a weight with no counterpart is a DFlashError (exit 2) naming it. No Ray, nothing
downloaded: the verifier the config names is the tiny target's folder."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_ray.cli import main
from dflash_ray.config import load_config
from dflash_ray.drafter import warm_start
from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.drafter.export import CONFIG, WEIGHTS, from_hf_config, load_drafter
from dflash_ray.drafter.init import initial_drafter
from dflash_ray.errors import DFlashError
from dflash_ray.tiny_models import tiny_qwen3
from dflash_ray.train.shape import drafter_config, drafter_init

SETTINGS = ["train.num_layers=1", "train.target_layer_ids=[0,1,2]"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("target"), num_layers=4, hidden_size=64, vocab_size=512)


@pytest.fixture(scope="module")
def original(target):
    """One of our drafters, with weights no start of a run makes."""
    cfg = load_config(None, SETTINGS)
    drafter = initial_drafter(from_hf_config(drafter_config(target, cfg)), target, "random", seed=1234)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01)
    return drafter


def speculators_config(cfg: DrafterConfig, verifier: str) -> dict:
    """What speculators' `DFlashSpeculatorConfig.save_pretrained` writes for `cfg` (transformers 5:
    the draft layers' Qwen3 config as its `to_diff_dict`)."""
    return {
        "architectures": ["DFlashDraftModel"],  # save_pretrained's: the model class's name
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]},
        },
        "transformer_layer_config": {
            "transformers_version": "5.19.0",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": cfg.rms_norm_eps,
            "use_cache": True,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 28,
            "layer_types": list(cfg.layer_types),
            "attention_dropout": 0.0,
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
            "model_type": "qwen3",
        },
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],  # HF's hidden_states index
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "dtype": "float32",
        "transformers_version": "5.19.0",
    }


def write_speculators(folder, drafter, verifier: str, config: dict | None = None, extra: dict | None = None):
    """A speculators DFlash checkpoint folder: their config.json, and the body's weights beside the
    frozen copies of the target's embedding and head their model.safetensors carries."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter.cfg
    (folder / CONFIG).write_text(json.dumps(config or speculators_config(cfg, verifier), indent=2))
    tensors = {k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    tensors["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    save_file({**tensors, **(extra or {})}, str(folder / WEIGHTS), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def theirs(original, target, tmp_path_factory):
    return write_speculators(tmp_path_factory.mktemp("speculators") / "epoch-3", original, str(target))


def _same_weights(drafter, original) -> bool:
    got, want = drafter.state_dict(), original.state_dict()
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_load_drafter_reads_their_folder_with_the_layer_ids_shifted_back(theirs, original):
    drafter = load_drafter(theirs)
    assert drafter.cfg.target_layer_ids == original.cfg.target_layer_ids == [0, 1, 2]
    for field in ("mask_token_id", "block_size", "num_target_layers", "layer_types", "rope_theta", "head_dim"):
        assert getattr(drafter.cfg, field) == getattr(original.cfg, field), field
    assert _same_weights(drafter, original)


def test_a_transformers_4_layer_config_is_read_alike(original, target, tmp_path):
    config = speculators_config(original.cfg, str(target))
    layers = config["transformer_layer_config"]
    layers["rope_theta"] = layers.pop("rope_parameters")["rope_theta"]
    layers["rope_scaling"] = None
    drafter = load_drafter(write_speculators(tmp_path / "old", original, str(target), config))
    untied = original.cfg.replace(tie_word_embeddings=False)  # speculators' draft layers: never tied
    assert drafter.cfg == untied and _same_weights(drafter, original)


def test_a_run_starts_from_their_folder(theirs, original, target):
    cfg = load_config(None, [*SETTINGS, f"train.init_from={theirs}"])
    mode = drafter_init(target, cfg)  # their config checked against this run's on the driver
    assert mode == warm_start.PREFIX + str(theirs)
    drafter = initial_drafter(from_hf_config(drafter_config(target, cfg)), target, mode, seed=0)
    assert _same_weights(drafter, original)
    assert warm_start.released_config(str(theirs)).target_layer_ids == [0, 1, 2]


def _changed(config: dict, path: str, value) -> dict:
    config = json.loads(json.dumps(config))
    *parents, key = path.split(".")
    node = config
    for parent in parents:
        node = node[parent]
    if value is _DELETE:
        del node[key]
    else:
        node[key] = value
    return config


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, field",
    [
        ("aux_hidden_state_layer_ids", _DELETE, "aux_hidden_state_layer_ids"),
        ("aux_hidden_state_layer_ids", [0, 1, 2], "aux_hidden_state_layer_ids"),  # 0: the embedding output
        ("aux_hidden_state_layer_ids", [1, 2, 5], "aux_hidden_state_layer_ids"),  # past the target's 4 layers
        ("mask_token_id", _DELETE, "mask_token_id"),
        ("mask_token_id", None, "mask_token_id"),  # speculators' default: trained without one
        ("block_size", _DELETE, "block_size"),
        ("transformer_layer_config.hidden_size", _DELETE, "transformer_layer_config.hidden_size"),
        ("transformer_layer_config.layer_types", ["full_attention"] * 2, "transformer_layer_config.layer_types"),
        ("transformer_layer_config.hidden_act", "gelu", "transformer_layer_config.hidden_act"),
        (
            "transformer_layer_config.rope_parameters.mrope_section",
            [8, 4, 4],
            "transformer_layer_config.rope_parameters.mrope_section",
        ),
        ("transformer_layer_config", _DELETE, "transformer_layer_config"),
        ("draft_vocab_size", 256, "draft_vocab_size"),  # a reduced draft vocabulary (d2t/t2d)
        ("sample_from_anchor", True, "sample_from_anchor"),
        ("speculators_model_type", "dspark", "speculators_model_type"),
        ("speculators_config.verifier.name_or_path", "/no/such/target", "speculators_config.verifier.name_or_path"),
    ],
)
def test_a_bad_or_missing_field_is_named(original, target, tmp_path, path, value, field):
    config = _changed(speculators_config(original.cfg, str(target)), path, value)
    folder = write_speculators(tmp_path / "theirs", original, str(target), config)
    for read in (lambda: load_drafter(folder), lambda: warm_start.released_config(str(folder))):
        with pytest.raises(DFlashError) as e:
            read()
        assert e.value.field == field and e.value.exit_code == 2, str(e.value)
        assert e.value.file == str(folder / CONFIG), str(e.value)


def test_the_target_layer_count_comes_from_the_file_or_the_run_when_the_verifier_is_elsewhere(
    original, target, tmp_path
):
    config = _changed(speculators_config(original.cfg, str(target)), "speculators_config.verifier.name_or_path", "/x")
    folder = write_speculators(tmp_path / "theirs", original, str(target), config)
    assert warm_start.released_config(str(folder), num_target_layers=4).num_target_layers == 4  # the run's
    (folder / CONFIG).write_text(json.dumps({**config, "num_target_layers": 4}))
    assert load_drafter(folder).cfg.target_layer_ids == [0, 1, 2]


@pytest.mark.parametrize("name", ["layers.0.self_attn.q_proj.bias", "markov_head.w1.weight", "d2t"])
def test_a_weight_with_no_counterpart_is_named(original, target, tmp_path, name):
    folder = write_speculators(tmp_path / "theirs", original, str(target), extra={name: torch.zeros(4)})
    with pytest.raises(DFlashError) as e:
        load_drafter(folder)
    assert e.value.field == name and e.value.file == str(folder / WEIGHTS) and e.value.exit_code == 2
    run = load_config(None, [*SETTINGS, f"train.init_from={folder}"])
    with pytest.raises(DFlashError) as e:
        initial_drafter(from_hf_config(drafter_config(target, run)), target, warm_start.PREFIX + str(folder), seed=0)
    assert e.value.field == name and e.value.exit_code == 2, str(e.value)


def test_export_writes_their_folder_in_our_format(theirs, original, tmp_path, capsys):
    out = tmp_path / "served"
    assert main(["export", str(theirs), str(out), "--dtype", "float32", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["target_layer_ids"] == [0, 1, 2]
    config = json.loads((out / CONFIG).read_text())
    assert "speculators_model_type" not in config and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": original.cfg.mask_token_id, "target_layer_ids": [0, 1, 2]}
    assert config["num_target_layers"] == 4 and config["block_size"] == original.cfg.block_size
    assert _same_weights(load_drafter(out), original)


REAL = Path(__file__).parent / "data" / "speculators-0.9.0-dflash"


def test_a_folder_their_trainer_wrote_is_read_with_its_shape_and_weights(tmp_path):
    """`config.json` as speculators 0.9.0's own `speculators train` wrote it (`bench.peers`: a
    one-layer DFlash drafter of SmolLM2-135M; only the verifier's path replaced by its Hub id), and
    weights of the names and shapes that run saved (bf16; no embedding or head: the target's)."""
    released = warm_start.released_config(str(REAL), num_target_layers=30)  # the run's target's
    assert (released.hidden_size, released.num_layers, released.num_heads, released.num_kv_heads) == (576, 1, 9, 3)
    assert released.target_layer_ids == [1, 8, 14, 20, 27]  # their 2, 9, 15, 21, 28
    assert (released.mask_token_id, released.block_size, released.layer_types) == (49151, 16, ["full_attention"])
    assert released.family == "dflash" and released.vocab_size == 49152
    shapes = json.loads((REAL / "weights.json").read_text())
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(weights, str(tmp_path / WEIGHTS))
    (tmp_path / CONFIG).write_text(json.dumps({**json.loads((REAL / CONFIG).read_text()), "num_target_layers": 30}))
    drafter = load_drafter(tmp_path)
    assert drafter.cfg == released
    state = drafter.state_dict()
    assert all(torch.equal(state[name].to(torch.bfloat16), w) for name, w in weights.items())

"""A malformed drafter config.json or model.safetensors is the user's error (exit 2), named down to
the field or tensor, never an internal error: every field the readers read, missing, of the wrong
type and absurd, for a tiny exported drafter of each family (`export.read_config`), the weights
against their config (`export.load_drafter`), a sharded checkpoint's config (`assemble`) and the
`export` command itself."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash_ray.cli import main
from dflash_ray.drafter import families
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.export import CONFIG, WEIGHTS, load_drafter, read_config, save_drafter
from dflash_ray.errors import DFlashError

FAMILIES = ("dflash", "dflash2", "dspark")
DELETE = object()  # the field removed


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """Family -> the folder of a tiny exported drafter (32 wide, a 96-token vocabulary, 4 target layers)."""
    target = AutoConfig.for_model(
        "qwen3",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    folders = {}
    for name in FAMILIES:
        settings = {"markov_rank": 8} if name == "dspark" else {"selector_rank": 8} if name == "dflash2" else None
        cfg = from_target(target, mask_token_id=95, num_target_features=2, family=name, settings=settings)
        torch.manual_seed(0)
        folders[name] = save_drafter(families.get(name).build(cfg), tmp_path_factory.mktemp(name), torch.float32)
    return folders


def _config(folder) -> dict:
    return json.loads((folder / CONFIG).read_text())


# field: (a value of the wrong type, an absurd value); every family's config.json holds these
SHARED = {
    "architectures": ("DFlashDraftModel", ["Qwen3ForCausalLM"]),
    "hidden_size": ("32", 10**12),
    "intermediate_size": (64.0, 0),
    "num_hidden_layers": (True, 0),
    "num_attention_heads": ([4], -4),
    "num_key_value_heads": ("2", 3),  # 3 does not divide the 4 query heads
    "head_dim": (8.0, 7),  # RoPE rotates halves
    "vocab_size": ("96", 0),
    "num_target_layers": (None, 0),
    "layer_types": ("full_attention", ["linear_attention"]),
    "rope_theta": ("1e6", 0),
    "rms_norm_eps": ([1e-6], -1e-6),
    "max_position_embeddings": (40960.0, 0),
    "block_size": ("16", 1),
}
# fields that may be left out (the reader's default), each with its wrong type and absurd value
OPTIONAL = {
    "sliding_window": ("2048", 0),
    "tie_word_embeddings": (1, None),
    "torch_dtype": (16, "int8"),
    "dtype": (8, "int8"),
}
NESTED_IDS = {
    "dflash_config": ([], None),
    "dflash_config.mask_token_id": ("95", 96),  # the vocabulary has 96 rows: 0..95
    "dflash_config.target_layer_ids": (1, [0, 4]),  # the target has 4 layers: 0..3
}
OWN = {
    "dflash": {**NESTED_IDS},
    "dflash2": {
        **NESTED_IDS,
        "dflash_config.conv_kernel_size": (2.0, 0),
        "dflash_config.conv_group_size": ("16", 5),  # 5 does not divide hidden_size 32
        "dflash_config.selector_rank": (None, 0),
        "dflash_config.selector_top_k": (True, 97),  # past the vocabulary
    },
    "dspark": {
        "mask_token_id": ("95", -1),
        "target_layer_ids": ("1,3", []),
        "markov_rank": (4.5, 0),
    },
}
OWN_OPTIONAL = {
    "dspark": {
        "enable_confidence_head": ("yes", None),
        "confidence_head_with_markov": (1, None),
        "markov_head_type": (0, "mlp"),
        "sample_from_anchor": ("true", False),
    },
}
# drafter_settings (optional): a wrong type, then an absurd entry and the field it names
SETTINGS_ABSURD = {
    "dflash": ({"markov_rank": 4}, "drafter_settings.markov_rank"),  # no setting of this family
    "dflash2": ({"selector_weight": -1.0}, "drafter_settings.selector_weight"),
    "dspark": ({"ce_weight": "much"}, "drafter_settings.ce_weight"),
}


def _cases():
    for family in FAMILIES:
        required = {**SHARED, **OWN[family]}
        optional = {**OPTIONAL, **OWN_OPTIONAL.get(family, {})}
        for field, (wrong, absurd) in {**required, **optional}.items():
            if field in required:
                yield pytest.param(family, field, DELETE, field, id=f"{family}-{field}-missing")
            yield pytest.param(family, field, wrong, field, id=f"{family}-{field}-wrong-type")
            if absurd is not None:  # None: a field with no absurd value of its type (a flag, a section)
                yield pytest.param(family, field, absurd, field, id=f"{family}-{field}-absurd")
        yield pytest.param(family, "drafter_settings", [1], "drafter_settings", id=f"{family}-settings-wrong-type")
        value, named = SETTINGS_ABSURD[family]
        yield pytest.param(family, "drafter_settings", value, named, id=f"{family}-settings-absurd")


def _set(data: dict, field: str, value) -> None:
    *parents, key = field.split(".")
    for parent in parents:
        data = data[parent]
    if value is DELETE:
        del data[key]
    else:
        data[key] = value


@pytest.mark.parametrize("family, field, value, named", list(_cases()))
def test_every_field_missing_mistyped_or_absurd_is_named(exported, family, field, value, named):
    data = _config(exported[family])
    _set(data, field, value)
    with pytest.raises(DFlashError) as e:
        read_config(json.dumps(data), "somewhere/config.json")
    assert e.value.field == named and e.value.file == "somewhere/config.json", str(e.value)
    assert str(e.value).startswith(f"somewhere/config.json: field '{named}': ")
    assert ("missing" in e.value.message) == (value is DELETE), str(e.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_exported_configs_read_back_and_optional_fields_may_be_left_out(exported, family):
    data = _config(exported[family])
    cfg = read_config(json.dumps(data), "config.json")
    assert cfg.family == family and cfg.mask_token_id == 95
    for field in [*OPTIONAL, *OWN_OPTIONAL.get(family, {}), "drafter_settings"]:
        data.pop(field, None)
    assert read_config(json.dumps(data), "config.json").family == family


@pytest.mark.parametrize("family", FAMILIES)
def test_sizes_each_in_range_that_multiply_past_any_drafter_are_refused_before_building(exported, family):
    data = _config(exported[family])
    data.update(hidden_size=1 << 20, intermediate_size=1 << 22)  # fc alone: 2 x 2^40 weights
    with pytest.raises(DFlashError) as e:
        read_config(json.dumps(data), "config.json")
    assert e.value.field == "hidden_size" and "parameters" in str(e.value)


def test_another_familys_architecture_names_the_field_it_misses(exported):
    data = _config(exported["dspark"])
    data["architectures"] = ["DFlashDraftModel"]
    with pytest.raises(DFlashError) as e:
        read_config(json.dumps(data), "config.json")
    assert e.value.field == "dflash_config" and "DFlashDraftModel config.json has it" in str(e.value)


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00", b"[1, 2]", b"null"])
def test_a_config_that_is_no_json_object_names_the_file(tmp_path, raw):
    with pytest.raises(DFlashError) as e:
        read_config(raw, "x/config.json")
    assert e.value.file == "x/config.json"
    (tmp_path / CONFIG).write_bytes(raw)
    with pytest.raises(DFlashError) as e:
        load_drafter(tmp_path)
    assert e.value.file == str(tmp_path / CONFIG)


def _weights_case(state: dict, case: str) -> str:
    """Spoil `state` as `case` says; returns the tensor the error must name."""
    if case == "int8":
        state["norm.weight"] = state["norm.weight"].to(torch.int8)
        return "norm.weight"
    if case == "shape":
        state["fc.weight"] = state["fc.weight"].t().contiguous()
        return "fc.weight"
    if case == "missing":
        del state["layers.0.mlp.up_proj.weight"]
        return "layers.0.mlp.up_proj.weight"
    state["lm_head.weight"] = torch.zeros(96, 32)
    return "lm_head.weight"


@pytest.mark.parametrize("case", ["int8", "shape", "missing", "unexpected"])
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_that_do_not_fit_the_config_name_the_tensor(exported, tmp_path, family, case):
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(exported[family], folder)
    state = load_file(str(folder / WEIGHTS))
    named = _weights_case(state, case)
    save_file(state, str(folder / WEIGHTS))
    with pytest.raises(DFlashError) as e:
        load_drafter(folder)
    assert e.value.field == named and e.value.file == str(folder / WEIGHTS), str(e.value)


def test_a_damaged_weights_file_names_it(exported, tmp_path):
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(exported["dflash"], folder)
    (folder / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(DFlashError) as e:
        load_drafter(folder)
    assert e.value.file == str(folder / WEIGHTS)


def test_a_checkpoints_config_is_read_through_the_same_checks(exported, tmp_path):
    """`export` of a training checkpoint (`checkpoint_files.assemble`) reads its drafter/config.json,
    checked against the manifest, through the same reader before any shard: a bad field (vouched
    for by the manifest) is named with the file."""
    from dflash_ray.train import checkpoint, checkpoint_files

    data = _config(exported["dflash"])
    data["dflash_config"]["target_layer_ids"] = [0, 9]
    run = str(tmp_path / "run")
    checkpoint.save(run, 1, {f"drafter/{CONFIG}": json.dumps(data).encode()})
    folder = checkpoint.step_dir(run, 1)
    with pytest.raises(DFlashError) as e:
        checkpoint_files.assemble(folder)
    assert e.value.field == "dflash_config.target_layer_ids" and e.value.file == f"{folder}/drafter/{CONFIG}"


def test_export_of_a_config_that_is_no_json_exits_2_naming_it(exported, tmp_path, capsys):
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(exported["dflash"], folder)
    (folder / CONFIG).write_text('{"architectures": ["DFlashDraftModel"],')
    assert main(["export", str(folder), str(tmp_path / "out"), "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert str(folder / CONFIG) in error and "not valid JSON" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_the_export_command_exits_2_naming_the_field(exported, tmp_path):
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(exported["dspark"], folder)
    data = _config(folder)
    data["markov_rank"] = "256"
    (folder / CONFIG).write_text(json.dumps(data))
    done = subprocess.run(
        [sys.executable, "-m", "dflash_ray.cli", "export", str(folder), str(tmp_path / "out"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["exit_code"] == 2 and "field 'markov_rank'" in summary["error"]
    assert str(folder / CONFIG) in summary["error"] and "internal error" not in done.stderr

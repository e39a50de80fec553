import pytest

from dflash_ray.config import RunConfig, load_config
from dflash_ray.errors import DFlashError


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("tokenize:\n  max_seq_len: 2048\n  overlong: drop\nvalidate:\n  gate:\n    max_mode_share: 0.3\n")
    cfg = load_config(str(path), ["tokenize.max_seq_len=1024", "validate.gate.min_median_response=10",
                                  "prompts.multi_turn=per_turn"])
    assert isinstance(cfg, RunConfig)
    assert cfg.tokenize.max_seq_len == 1024 and cfg.tokenize.overlong == "drop"
    assert cfg.validate.gate.max_mode_share == 0.3
    assert cfg.validate.gate.min_median_response == 10.0
    assert cfg.prompts.multi_turn == "per_turn"
    assert cfg.to_dict()["tokenize"]["max_seq_len"] == 1024


def test_unknown_key_names_field_and_valid_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("tokenize:\n  max_seqlen: 10\n")
    with pytest.raises(DFlashError) as e:
        load_config(str(path))
    assert "tokenize.max_seqlen" in str(e.value) and "max_seq_len" in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("override, field", [
    ("tokenize.max_seq_len=long", "tokenize.max_seq_len"),
    ("tokenize.overlong=clip", "tokenize.overlong"),
    ("ray.include_dashboard=3", "ray.include_dashboard"),
    ("novel=1", "novel"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(DFlashError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.seed = 3

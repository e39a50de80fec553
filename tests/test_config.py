import re
from pathlib import Path

import pytest

from dflash_ray.config import RunConfig, load_config
from dflash_ray.errors import DFlashError


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("tokenize:\n  max_seq_len: 2048\n  overlong: drop\nvalidate:\n  gate:\n    max_mode_share: 0.3\n")
    cfg = load_config(
        str(path), ["tokenize.max_seq_len=1024", "validate.gate.min_median_response=10", "prompts.multi_turn=per_turn"]
    )
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


@pytest.mark.parametrize(
    "override, field",
    [
        ("tokenize.max_seq_len=long", "tokenize.max_seq_len"),
        ("tokenize.overlong=clip", "tokenize.overlong"),
        ("ray.include_dashboard=3", "ray.include_dashboard"),
        ("novel=1", "novel"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(DFlashError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.seed = 3


@pytest.mark.parametrize(
    "override, field, allowed",
    [
        ("train.checkpoint_every=0", "train.checkpoint_every", ">= 1"),
        ("train.num_anchors=0", "train.num_anchors", ">= 1"),
        ("train.num_streams=0", "train.num_streams", ">= 1"),
        ("train.batch_size=0", "train.batch_size", ">= 1"),
        ("train.epochs=0", "train.epochs", ">= 1"),
        ("train.lr=0", "train.lr", "> 0"),
        ("train.lr=inf", "train.lr", "finite"),  # inf passed every range check and trained to NaN
        ("train.lr=nan", "train.lr", "finite"),
        ("plan.memory_headroom=-inf", "plan.memory_headroom", "finite"),
        ("train.collective_timeout_s=.inf", "train.collective_timeout_s", "finite"),
        ("train.lr=-1e-3", "train.lr", "> 0"),
        ("train.warmup_ratio=1", "train.warmup_ratio", "[0, 1)"),
        ("train.warmup_ratio=-0.1", "train.warmup_ratio", "[0, 1)"),
        ("train.clip=0", "train.clip", "> 0"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints", ">= 1"),
        ("train.max_in_flight=-1", "train.max_in_flight", ">= 0"),
        ("train.heldout=-1", "train.heldout", ">= 0"),
        ("train.eval_every=-5", "train.eval_every", ">= 0"),
        ("train.block_size=1", "train.block_size", ">= 2"),
        ("train.sliding_window=0", "train.sliding_window", ">= 1"),
        ("train.actor_cpus=0", "train.actor_cpus", "> 0"),
        ("train.actor_gpus=-1", "train.actor_gpus", ">= 0"),
        ("train.target_layer_ids=[3,1]", "train.target_layer_ids", "sorted"),
        ("train.target_layer_ids=[1,1]", "train.target_layer_ids", "unique"),
        ("train.target_layer_ids=[-1,2]", "train.target_layer_ids", "non-negative"),
        ("train.target_layer_ids=[1.5]", "train.target_layer_ids", "non-negative"),
        ("train.target_layer_ids=5", "train.target_layer_ids", "list"),
        ("train.layer_types=[full]", "train.layer_types", "sliding_attention"),
        ("train.layer_types=sliding_attention", "train.layer_types", "list"),
        ("train.layer_types=[full_attention,full_attention]", "train.layer_types", "one per drafter layer"),
        ("train.trackers=[tensorbord]", "train.trackers", "'tensorboard', 'wandb', 'mlflow'"),
        ("train.trackers=wandb", "train.trackers", "list"),
        ("train.trackers=[wandb,wandb]", "train.trackers", "distinct"),
        ("generate.generators=0", "generate.generators", ">= 1"),
        ("generate.shard_size=0", "generate.shard_size", ">= 1"),
        ("generate.batch_size=0", "generate.batch_size", ">= 1"),
        ("generate.max_tokens=0", "generate.max_tokens", ">= 1"),
        ("generate.max_model_len=0", "generate.max_model_len", ">= 1"),
        ("generate.temperature=-0.5", "generate.temperature", ">= 0"),
        ("generate.top_p=0", "generate.top_p", "(0, 1]"),
        ("generate.top_p=1.5", "generate.top_p", "(0, 1]"),
        ("generate.samples_per_prompt=0", "generate.samples_per_prompt", ">= 1"),
        ("generate.memory_utilization=0", "generate.memory_utilization", "(0, 1]"),
        ("generate.memory_utilization=1.2", "generate.memory_utilization", "(0, 1]"),
        ("tokenize.max_seq_len=1", "tokenize.max_seq_len", ">= 2"),
        ("tokenize.batch_size=0", "tokenize.batch_size", ">= 1"),
        ("evaluate.num_prompts=0", "evaluate.num_prompts", ">= 1"),
        ("evaluate.num_heldout=0", "evaluate.num_heldout", ">= 1"),
        ("evaluate.ngram_min=5", "evaluate.ngram_min", "ngram_max"),
        ("prompts.shard_size=0", "prompts.shard_size", ">= 1"),
        ("prompts.max_prompt_tokens=-1", "prompts.max_prompt_tokens", ">= 0"),  # 0: no budget
        ("pipeline.eval_prompts=-1", "pipeline.eval_prompts", ">= 0"),
        ("pipeline.inputs=somepath", "pipeline.inputs", "list"),
        ("validate.gate.max_mode_share=1.5", "validate.gate.max_mode_share", "[0, 1]"),
        ("chaos.faults=[drafter, gpu]", "chaos.faults[1]", "KIND or KIND@SECONDS"),
        ("chaos.faults=[node@soon]", "chaos.faults[0]", "'node'"),
        ("chaos.faults=[generator@nan]", "chaos.faults[0]", "KIND@SECONDS"),  # a fault that never fires
        ("chaos.faults=[generator@inf]", "chaos.faults[0]", "KIND@SECONDS"),
        ("chaos.within_s=-1", "chaos.within_s", ">= 0"),
        ("train.min_bus_bandwidth=-1", "train.min_bus_bandwidth", ">= 0"),
    ],
)
def test_out_of_range_values_are_refused_before_anything_runs(override, field, allowed):
    with pytest.raises(DFlashError) as e:
        load_config(None, [override])
    assert e.value.field == field and f"'{field}'" in str(e.value) and allowed in str(e.value)


def test_edges_of_the_ranges_are_allowed():
    cfg = load_config(
        None,
        [
            "train.warmup_ratio=0",
            "train.max_in_flight=0",
            "generate.top_p=1",
            "generate.temperature=0",
            "generate.memory_utilization=1",
            "tokenize.max_seq_len=2",
            "train.block_size=2",
            "train.target_layer_ids=[0,3,7]",
            "train.num_layers=2",
            "train.layer_types=[sliding_attention,full_attention]",
            "pipeline.inputs=[a.jsonl]",
            "evaluate.ngram_min=3",
            "evaluate.ngram_max=3",
            "prompts.max_prompt_tokens=0",
        ],
    )
    assert cfg.train.target_layer_ids == [0, 3, 7] and cfg.pipeline.inputs == ["a.jsonl"]


def test_generation_longer_than_training_keeps_is_refused_or_warned_naming_both_fields():
    from dflash_ray.config import check_lengths

    with pytest.raises(DFlashError) as e:  # every answer past 4096 tokens would lose its tail
        check_lengths(load_config(None, ["generate.max_tokens=8192", "tokenize.max_seq_len=4096"]))
    assert e.value.field == "generate.max_tokens" and "tokenize.max_seq_len=4096" in str(e.value)
    warning = check_lengths(
        load_config(
            None,
            [
                "generate.max_tokens=2048",
                "generate.max_model_len=8192",
                "prompts.max_prompt_tokens=4096",
                "tokenize.max_seq_len=4096",
            ],
        )
    )
    assert "generate.max_model_len=8192" in warning and "tokenize.max_seq_len=4096" in warning
    assert "6144" in warning  # the longest conversation: 4096 prompt + 2048 answer, within 8192
    assert check_lengths(load_config(None, [])) is None  # the defaults keep every generated token
    for preset in ("qwen3-8b.yaml", "qwen3.6-27b.yaml"):
        assert check_lengths(load_config(str(Path(__file__).resolve().parent.parent / "configs" / preset))) is None


def test_a_range_error_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  keep_checkpoints: 0\n")
    with pytest.raises(DFlashError) as e:
        load_config(str(path))
    assert str(path) in str(e.value) and "train.keep_checkpoints" in str(e.value)


def test_fields_replaced_by_command_line_flags_are_checked_too(tmp_path, capsys):
    from dflash_ray.cli import main

    # `--generators` replaces generate.generators after the config is loaded: still refused before any run
    assert (
        main(
            [
                "generate",
                "--prompts",
                str(tmp_path / "p"),
                "--output",
                str(tmp_path / "o"),
                "--model",
                "m",
                "--generators",
                "0",
            ]
        )
        == 2
    )
    assert "generate.generators" in capsys.readouterr().err


@pytest.mark.integration
def test_train_command_exits_2_at_once_naming_the_field(tmp_path):
    import subprocess
    import sys
    import time

    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_ray.cli",
            "train",
            "--data",
            str(tmp_path / "data"),
            "--target",
            str(tmp_path / "target"),
            "--output",
            str(tmp_path / "out"),
            "--set",
            "train.checkpoint_every=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "train.checkpoint_every" in proc.stderr and ">= 1" in proc.stderr
    assert "Traceback" not in proc.stderr and time.perf_counter() - start < 60  # no Ray, no model loaded
    assert not (tmp_path / "out").exists()


def test_the_demo_settings_pass_the_preflight_and_hold_the_demo_to_its_bars(tmp_path):
    """The demo's own settings are a config like any other (a renamed field fails here, not 20
    minutes into `make demo`); the user's file and overrides go over them."""
    from dflash_ray.config import check
    from dflash_ray.generation.cpu_engine import native_bf16
    from dflash_ray.stages.demo import demo_config

    cfg = demo_config(None, [])
    check(cfg)
    assert cfg.pipeline.beat_ngram and cfg.pipeline.min_tau_gain > 0 and cfg.train.loss_decay == 1
    # greedy serving's loss: the target's greedy tokens as hard labels, no TV term
    assert (cfg.train.family["ce_weight"], cfg.train.family["tv_weight"], cfg.train.block_size) == (1, 0, 4)
    # held to prompt lookup at the answer length users serve, with the drafter that beats it there
    assert cfg.evaluate.max_new_tokens == 256 and (cfg.train.drafter, cfg.train.num_layers) == ("dspark", 2)
    (tmp_path / "mine.yaml").write_text("train: {epochs: 1}\n")
    mine = demo_config(str(tmp_path / "mine.yaml"), ["pipeline.beat_ngram=false"])
    assert cfg.train.dtype == ("bfloat16" if native_bf16() else "float32")
    assert mine.train.epochs == 1 and not mine.pipeline.beat_ngram and mine.train.loss_decay == 1
    # the earlier one-layer DFlash demo, as docs/demo.md gives it: DSpark's own settings do not follow it
    from dflash_ray import preflight
    from dflash_ray.stages.demo import DFLASH_SETTINGS

    preflight.check_settings(demo_config(None, DFLASH_SETTINGS))
    # the demo with the data to beat lookup on unseen kinds too, as docs/demo.md gives it
    more = demo_config(str(Path(__file__).parents[1] / "configs" / "demo-more-data.yaml"), [])
    preflight.check_settings(more)
    assert more.pipeline.beat_ngram and more.pipeline.beat_ngram_unseen and more.selfprompt.count >= 1000
    assert (more.train.epochs, more.train.drafter, more.train.family) == (1, "dspark", cfg.train.family)


def test_train_drafters_are_checked_entry_by_entry_and_expand_to_whole_configs():
    """`train.drafters`: each entry's name and settings checked where the config is read, naming
    the entry; each drafter becomes the run's config with its own settings and no drafter list."""
    from dflash_ray.train.drafters import expand, outputs, union_layers

    cfg = load_config(None, ["train.lr=1e-3", "train.drafters=[{name: a}, {name: b, drafter: dspark, lr: 2e-3}]"])
    runs = expand(cfg)
    assert [(n, r.train.drafter, r.train.lr, r.train.drafters) for n, r in runs] == [
        ("a", "dflash", 1e-3, []),
        ("b", "dspark", 2e-3, []),
    ]
    assert outputs("s3://b/run", cfg) == ["s3://b/run/a", "s3://b/run/b"]
    assert expand(load_config(None, [])) == [("", load_config(None, []))]
    for bad, field in (
        ("[{name: a, epochs: 2}]", "train.drafters[0].epochs"),
        ("[{name: A}]", "train.drafters[0]"),
        ("[{name: a}, {name: a}]", "train.drafters[1]"),
        ("[{name: a, lr: -1}]", "train.drafters[0].lr"),
        ("[{name: a, drafter: medusa}]", "train.drafters[0].drafter"),
        ("[{lr: 1}]", "train.drafters[0]"),
    ):
        with pytest.raises(DFlashError) as e:
            load_config(None, [f"train.drafters={bad}"])
        assert e.value.field == field, (bad, e.value)
    with pytest.raises(DFlashError, match="colocated") as e:
        load_config(None, ["train.colocate=true", "train.drafters=[{name: a}]"])
    assert union_layers([[1, 3, 5], [3, 5, 7], [1, 3, 5, 7]]) == ([1, 3, 5, 7], [[0, 1, 2], [1, 2, 3], None])


def test_family_settings_are_one_section_read_by_the_family():
    """`train.family` holds the chosen family's own settings, read by its module's `Settings` (the
    check a command runs on its config, `preflight.check_settings`): an unknown key or a value out of
    range names `train.family.KEY`; the keys that were `train`'s own say where they moved, in a
    drafter entry too. An entry keeping the run's family inherits its settings, one naming another
    family starts from that family's defaults."""
    from dflash_ray.drafter import families
    from dflash_ray.preflight import check_settings
    from dflash_ray.train.drafters import expand

    cfg = load_config(None, ["train.drafter=dspark", "train.family.markov_rank=64", "train.family.ce_weight=0.2"])
    own = families.settings("dspark", cfg.train.family)
    assert (own.markov_rank, own.ce_weight, own.tv_weight, own.confidence_head) == (64, 0.2, 0.9, True)
    for override, field, says in (
        (["train.drafter=dspark", "train.family.markov_rankk=3"], "train.family.markov_rankk", "markov_rank"),
        (["train.drafter=dspark", "train.family.markov_rank=0"], "train.family.markov_rank", ">= 1"),
        (["train.drafter=dflash2", "train.family.selector_top_k=x"], "train.family.selector_top_k", "integer"),
        (["train.family.markov_rank=8"], "train.family.markov_rank", "valid keys here: []"),  # dflash has none
        (["train.markov_rank=8"], "train.markov_rank", "moved to train.family.markov_rank"),
        (
            ["train.drafters=[{name: a, drafter: dspark, selector_top_k: 4}]"],
            "train.drafters[0].selector_top_k",
            "moved to train.drafters[0].family.selector_top_k",
        ),
        (
            ["train.drafters=[{name: a, drafter: dspark, family: {markov_rank: 0}}]"],
            "train.drafters[0].family.markov_rank",
            ">= 1",
        ),
    ):
        with pytest.raises(DFlashError, match=re.escape(says)) as e:
            load_config(None, override, check=check_settings)
        assert e.value.field == field, (override, e.value)
        if override[-1].startswith("train.family."):  # the command line's, named as such
            assert f"(given by --set {override[-1]})" in str(e.value)
    runs = expand(
        load_config(
            None,
            [
                "train.drafter=dflash2",
                "train.family.selector_top_k=8",
                "train.drafters=[{name: a, family: {selector_rank: 4}}, {name: b, drafter: dspark}]",
            ],
        )
    )
    assert [r.train.family for _, r in runs] == [{"selector_top_k": 8, "selector_rank": 4}, {}]


@pytest.mark.integration
def test_the_run_config_names_a_family_without_importing_torch():
    import json
    import subprocess
    import sys

    code = (
        "import sys, json; from dflash_ray.config import load_config; "
        "c = load_config(None, ['train.drafter=dspark']); print(json.dumps(['torch' in sys.modules, "
        "c.train.drafter]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, "dspark"]


def test_a_config_file_on_a_base_states_only_what_differs_and_a_loop_is_refused(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "train: {lr: 0.001, num_layers: 3, layer_types: [full_attention, full_attention, "
        "full_attention]}\ngenerate: {max_tokens: 100}\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.yaml").write_text(
        "base: ../base.yaml\ntrain: {num_layers: 1, layer_types: [sliding_attention]}\n"
    )
    cfg = load_config(str(tmp_path / "sub" / "child.yaml"), ["generate.max_tokens=50"])
    assert cfg.train.lr == 0.001 and cfg.train.num_layers == 1  # mappings merge key by key
    assert cfg.train.layer_types == ["sliding_attention"]  # a list replaces
    assert cfg.generate.max_tokens == 50  # overrides go on top of both
    (tmp_path / "base.yaml").write_text("base: sub/child.yaml\n")
    with pytest.raises(DFlashError) as e:
        load_config(str(tmp_path / "sub" / "child.yaml"))
    assert e.value.field == "base" and "loop" in str(e.value)


def test_a_command_line_argparse_refuses_still_ends_with_a_json_summary(capsys):
    import json

    from dflash_ray.cli import main

    assert main(["validate", "--json"]) == 2
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary == {
        "stage": "validate",
        "ok": False,
        "exit_code": 2,
        "error": "dflash-ray validate: error: the following arguments are required: --input",
    }
    assert "usage: dflash-ray validate" in err and "required: --input" in err
    assert main(["export", "CKPT", "--output", "x", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == "dflash-ray: error: unrecognized arguments: --output"
    assert main(["validate"]) == 2 and capsys.readouterr().out == ""  # without --json stdout stays empty


def test_settings_a_command_would_ignore_are_refused(tmp_path, capsys):
    """A fault drill asked of a command that runs none, and a step to stop after that no run
    reaches, are refused before anything runs, naming the setting."""
    import json

    from dflash_ray.cli import main

    tokenize = ["tokenize", "--input", str(tmp_path / "c"), "--output", str(tmp_path / "o"), "--json"]
    assert main(tokenize + ["--set", "chaos.faults=[target]"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "chaos.faults" in error and "pipeline" in error and "train" in error
    train = [
        "train",
        "--data",
        str(tmp_path / "d"),
        "--target",
        str(tmp_path / "t"),
        "--output",
        str(tmp_path / "o"),
        "--json",
    ]
    assert main(train + ["--stop-after-step", "-1"]) == 2
    assert "--stop-after-step" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_unreachable_ray_address_fails_fast_naming_where_it_came_from():
    """Ray's own connection retries the GCS for minutes; the address is tried first, briefly."""
    import socket
    import time

    import pytest

    from dflash_ray.cluster import check_reachable
    from dflash_ray.errors import DFlashError

    with socket.socket() as s:  # a port bound and not listening: nothing answers there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(DFlashError) as e:
            check_reachable(f"127.0.0.1:{port}", "the environment's RAY_ADDRESS", within_s=2)
    assert time.monotonic() - start < 10 and "RAY_ADDRESS" in str(e.value) and str(port) in str(e.value)
    with pytest.raises(DFlashError, match="not an address"):
        check_reachable("no-port-here", "ray.address")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"ray://127.0.0.1:{server.getsockname()[1]}", "ray.address")  # answers: fine


@pytest.mark.integration
def test_a_ray_address_that_is_no_url_or_whose_cluster_refuses_the_join_is_named(monkeypatch, capsys):
    """An address urlsplit cannot read, a service that is no Ray head, and a cluster that refuses the
    join (its token) are each one line naming ray.address (and RAY_AUTH_MODE for the token)."""
    import socket

    import ray
    from ray.exceptions import AuthenticationError

    from dflash_ray import cluster
    from dflash_ray.cli import main
    from dflash_ray.config import RayConfig

    with pytest.raises(DFlashError, match="not an address") as e:
        cluster.check_reachable("http://[::1", "ray.address")
    assert "ray.address" in str(e.value)
    assert main(["status", "--set", "ray.address=http://[::1"]) == 2
    err = capsys.readouterr().err
    assert "ray.address" in err and "internal error" not in err
    with socket.socket() as server:  # something answers at the address; what ray.init then says is faked
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        for raised, says in (
            (ConnectionError(f"Failed to connect to Ray cluster at {address}"), "no Ray cluster"),
            (AuthenticationError("Authentication failed: invalid token"), "RAY_AUTH_MODE"),
        ):

            def refuse(*args, raised=raised, **kwargs):
                raise raised

            monkeypatch.setattr(ray, "init", refuse)
            with pytest.raises(DFlashError, match=says) as e:
                cluster._connect(RayConfig(address=address), False, None)
            assert "ray.address" in str(e.value) and address in str(e.value)
            monkeypatch.setattr(cluster, "local_clusters", lambda: [{"address": address, "auth": None}])
            monkeypatch.setattr(cluster, "_ray_found", lambda: None)
            with pytest.raises(DFlashError, match=says) as e:
                cluster.join_running()
            assert address in str(e.value)


def test_a_file_where_a_folder_is_expected_is_one_line_naming_it(tmp_path, capsys):
    """Any OSError about a path (here a file given as the output folder: FileExistsError) reaches the
    user as one line naming the path, exit 2, not a traceback; the file is left as it was."""
    import json

    from dflash_ray.cli import main

    (tmp_path / "a-file").write_text("x")
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    code = main(["prompts", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "a-file"), "--json"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    assert "a-file" in json.loads(captured.out)["error"]
    assert (tmp_path / "a-file").read_text() == "x"


def test_every_fields_range_is_declared_with_the_field_and_refused_naming_it():
    """A range lives beside its field (`at_least`, `above`, `within`); a value just outside any of
    them is refused, naming the dotted field."""
    import dataclasses
    import typing

    from dflash_ray.settings.fields import CEILING

    def ranged(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from ranged(hints[f.name], prefix + f.name + ".")
            elif "range" in f.metadata:
                yield prefix + f.name, f.metadata["range"]

    checked = 0
    for dotted, (ok, allowed) in ranged(RunConfig):
        if allowed.startswith("in"):  # in [low, high] or (low, high): past the high end
            bad = float(allowed.split(",")[1].strip(" ])")) + 1
        elif " and <= " in allowed:  # >= low and <= high: past the high end
            bad = float(allowed.rsplit(" ", 1)[1]) + 1
        else:  # >= low: one below; > low: low itself
            low = float(allowed.lstrip(">= "))
            bad = low - 1 if allowed.startswith(">=") else low
        assert not ok(bad), dotted
        assert not ok(CEILING + 1) and not ok(-CEILING - 1), f"{dotted} takes any number: give it an upper bound"
        bad = int(bad) if bad == int(bad) else bad  # an integer field takes a whole number
        with pytest.raises(DFlashError, match="out of range") as e:
            load_config(None, [f"{dotted}={bad}"])
        assert e.value.field == dotted
        checked += 1
    assert checked > 100, checked


def test_what_may_change_on_resume_is_marked_beside_each_field():
    """`recovery.OPERATIONAL` is read off the fields' own marks (`config.operational`), ranges kept."""
    import dataclasses

    from dflash_ray.config import TrainConfig
    from dflash_ray.train.recovery import OPERATIONAL

    assert {"num_streams", "max_steps", "clocks", "trackers", "collective_timeout_s"} <= OPERATIONAL
    assert not {"lr", "seed", "batch_size", "drafter", "num_anchors"} & OPERATIONAL
    ranged = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}
    assert "range" in ranged["num_streams"] and ranged["num_streams"]["operational"]
    with pytest.raises(DFlashError, match="train.num_streams"):
        load_config(None, ["train.num_streams=0"])


def _bomb(levels: int = 9) -> str:
    """Anchors each holding nine aliases of the one before: 9**levels values once expanded."""
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip(names, names[1:])]
    return "{" + ", ".join(lines) + "}"


def test_a_config_key_that_is_a_list_or_mapping_is_refused_naming_the_file(tmp_path, capsys):
    from dflash_ray.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("train: {? [a, b] : 1}\n")
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "c.yaml" in err and "key" in err and "internal error" not in err
    with pytest.raises(DFlashError, match="key") as e:
        load_config(None, ["generate.engine_args={? {a: 1} : 1}"])
    assert e.value.field == "--set generate.engine_args"


def test_a_config_nested_too_deep_is_refused_naming_the_file_or_the_set(tmp_path, capsys):
    from dflash_ray.cli import main

    path = tmp_path / "deep.yaml"
    path.write_text("train: " + "[" * 20000 + "]" * 20000 + "\n")
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "deep.yaml" in err and "nested" in err and "internal error" not in err
    path.write_text("generate:\n  engine_args: " + "{a: " * 150 + "1" + "}" * 150 + "\n")  # YAML reads it
    with pytest.raises(DFlashError, match="nested") as e:
        load_config(str(path))
    assert e.value.file == str(path)
    for assignment in ("train.lr=" + "[" * 5000 + "]" * 5000, "generate.engine_args" + ".a" * 200 + "=1"):
        with pytest.raises(DFlashError, match="nested") as e:
            load_config(None, [assignment])
        assert e.value.field is not None and e.value.field.startswith("--set ")


def test_a_config_that_is_no_regular_file_or_too_large_is_refused_naming_it(tmp_path):
    with pytest.raises(DFlashError, match="not a regular file") as e:
        load_config("/dev/zero")
    assert e.value.file == "/dev/zero"
    with pytest.raises(DFlashError, match="not a regular file"):
        load_config(str(tmp_path))
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate((16 << 20) + 1)
    with pytest.raises(DFlashError, match="16 MiB") as e:
        load_config(str(big))
    assert e.value.file == str(big)


def test_an_alias_bomb_is_refused_and_ordinary_anchors_are_not(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"generate:\n  engine_args: {_bomb()}\n")
    with pytest.raises(DFlashError, match="1,000,000 values") as e:
        load_config(str(path))
    assert e.value.file == str(path)
    with pytest.raises(DFlashError, match="1,000,000 values") as e:
        load_config(None, [f"generate.engine_args={_bomb()}"])
    assert e.value.field == "--set generate.engine_args"
    path.write_text(f"generate:\n  engine_args: {_bomb(4)}\n")  # 9**4 values: a config may repeat itself
    assert len(load_config(str(path)).generate.engine_args["l3"]) == 9
    path.write_text(
        "tokenize: {max_seq_len: &n 2048}\n"
        "generate:\n"
        "  max_model_len: *n\n"
        "  engine_args: &e {enforce_eager: true}\n"
        "  chat_template_kwargs: {<<: *e, reasoning: low}\n"
    )
    cfg = load_config(str(path))
    assert cfg.generate.max_model_len == 2048
    assert cfg.generate.chat_template_kwargs == {"enforce_eager": True, "reasoning": "low"}


def test_the_demo_trains_in_bf16_only_on_a_cpu_that_multiplies_it_natively(monkeypatch):
    """On a CPU without AVX512-BF16 or AMX torch emulates bf16 matmuls (an AVX2 EPYC: 35 s a demo
    step, about 1 s in fp32), so the demo trains in fp32 there; a user's own dtype still wins."""
    import torch

    from dflash_ray.stages.demo import demo_config

    for avx512_bf16, amx, dtype in ((False, False, "float32"), (True, False, "bfloat16"), (False, True, "bfloat16")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert demo_config(None, []).train.dtype == dtype
        assert demo_config(None, ["train.dtype=bfloat16"]).train.dtype == "bfloat16"

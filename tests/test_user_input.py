"""Bad inputs, settings and faults a user meets first: each is one line naming the file, record or
field (exit 2), nothing of the user's is deleted or replaced, and nothing succeeds on garbage."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_ray import manifest
from dflash_ray.cli import main
from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from dflash_ray.registry import SMOLLM2


def _asset(name: str) -> str:
    from importlib import resources

    return str(resources.files("dflash_ray.assets") / name)


def _error(capsys) -> str:
    return capsys.readouterr().err


def test_the_demo_never_deletes_a_users_files_in_its_workdir(tmp_path, capsys):
    """An earlier demo's training output is cleared only after every setting is checked, and only
    when it holds nothing but what training writes."""
    from dflash_ray import writer
    from dflash_ray.stages.pipeline import clear_training

    work = tmp_path / "project"
    (work / "train").mkdir(parents=True)
    (work / "train" / "notes.md").write_text("irreplaceable")
    # a refused setting: nothing is touched
    assert main(["demo", "--workdir", str(work), "--set", "generate.max_tokens=100000", "--json"]) == 2
    assert (work / "train" / "notes.md").read_text() == "irreplaceable"
    cfg = load_config()
    with pytest.raises(DFlashError, match="notes.md, which no training run wrote: nothing was deleted"):
        clear_training(str(work / "train"), cfg)
    assert (work / "train" / "notes.md").exists()
    # what a training run wrote goes whole
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "metrics").mkdir()  # the metric history, appended per checkpoint
    (run / "metrics" / "000000002.jsonl").write_text("{}\n")
    (run / "compile-cache.bin").write_bytes(b"")  # torch's compiled artifacts
    (run / writer.MARK).write_text('{"kind": "training"}')  # the folder's claim, left by the first run
    clear_training(str(run), cfg)
    assert not run.exists()


def test_export_never_replaces_a_users_files(tmp_path, tiny_qwen3_dir, capsys):
    from transformers import AutoConfig

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.drafter.model import DFlashDrafter

    cfg = from_target(
        AutoConfig.from_pretrained(tiny_qwen3_dir), mask_token_id=151660, num_layers=1, num_target_features=3
    )
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp_path / "ckpt", dtype=torch.float32)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"keep": 1}')
    (mine / "notes.txt").write_text("precious")
    assert main(["export", str(tmp_path / "ckpt"), str(mine)]) == 2
    assert "config.json that is no drafter export" in _error(capsys)
    assert (mine / "config.json").read_text() == '{"keep": 1}' and not (mine / "model.safetensors").exists()
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes(b"user's")
    assert main(["export", str(tmp_path / "ckpt"), str(weights_only)]) == 2
    assert (weights_only / "model.safetensors").read_bytes() == b"user's"
    # an earlier export is replaced (a re-export), other files beside it stay
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    (out / "README.md").write_text("mine")
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--dtype", "float32"]) == 0
    assert (out / "README.md").read_text() == "mine"


def test_every_repeated_input_is_read(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.json"
    a.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}?"}]}) + "\n" for i in range(3))
    )
    b.write_text(json.dumps([{"messages": [{"role": "user", "content": "another one?"}]}]))
    assert (
        main(
            [
                "prompts",
                "--input",
                str(a),
                "--input",
                str(b),
                "--output",
                str(tmp_path / "out"),
                "--set",
                f"prompts.tokenizer={SMOLLM2}",
                "--json",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["input_files"] == 2 and summary["prompts"] == 4


@pytest.mark.parametrize(
    "args, field",
    [
        (["--set", "train.lr=[1"], "--set train.lr"),  # not YAML
        (["--config", ""], "--config"),  # an unset variable: not the defaults in silence
        (
            ["--set", "generate.backend=transformers", "--set", "generate.engine_args={max_num_seqs: 4}"],
            "generate.engine_args",
        ),  # read by vLLM alone
    ],
)
def test_settings_that_would_be_misread_are_refused(args, field, capsys):
    assert main(["plan", *args, "--json"]) == 2
    summary = json.loads(capsys.readouterr().out)
    assert not summary["ok"] and f"field '{field}'" in summary["error"]


def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    assert main(["plan", "--config", str(path)]) == 2
    assert "the key 'lr' is given twice" in _error(capsys)


def test_a_bad_set_is_named_as_the_set_not_the_config_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n")
    for given, said in (
        ("train.max_steps=-1", "field 'train.max_steps': -1 is out of range"),
        ("train.nope=1", "field 'train.nope': unknown config key"),
    ):
        assert main(["plan", "--config", str(path), "--set", given]) == 2
        error = _error(capsys)
        assert said in error and f"(given by --set {given})" in error and str(path) not in error, error
    path.write_text("train:\n  max_steps: -1\n")  # the file's own mistake is still the file's
    assert main(["plan", "--config", str(path), "--set", "train.lr=0.1"]) == 2
    assert f"{path}: field 'train.max_steps'" in _error(capsys)


@pytest.mark.parametrize(
    "ids, mask, field",
    [
        ([[1.7, 2.2, 3.9]] * 4, [[0, 1, 1]] * 4, "input_ids"),  # float ids: cast silently before
        ([[1, 2, 3]] * 4, [[0.0, 0.5, 1.0]] * 4, "loss_mask"),  # a half mask counted as 0 before
        ([["a", "b", "c"]] * 4, [[0, 1, 1]] * 4, "input_ids"),
        ([1, 2, 3, 4], [0, 1, 1, 1], "input_ids"),  # a scalar per sample
    ],
)
def test_token_columns_of_the_wrong_type_are_refused_by_validate_and_train(ids, mask, field, tmp_path, capsys):
    from dflash_ray.train.schedule import dataset_samples

    path = str(tmp_path / "data.parquet")
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": mask}), path)
    assert main(["validate", "--input", path, "--tokenizer", SMOLLM2]) == 2
    assert f"field '{field}'" in _error(capsys)
    with pytest.raises(DFlashError) as e:  # what training reads, before any actor starts
        dataset_samples(path)
    assert e.value.field == field and e.value.file == path


def test_tokenize_refuses_a_tokenizer_that_is_not_the_one_that_generated_the_answers(tmp_path):
    from dflash_ray.data import schema
    from dflash_ray.stages.prompts import shard_bytes
    from dflash_ray.stages.tokenize import run_tokenize

    folder = str(tmp_path / "completions")
    row = {k: None for k in schema.COMPLETIONS.names}
    row.update(
        id="a",
        source="x",
        messages=[{"role": "user", "content": "hi"}],
        text="hello",
        prompt_token_ids=[1, 2],
        output_token_ids=[3, 4],
    )
    (tmp_path / "completions").mkdir()
    (tmp_path / "completions" / "completions-00000.parquet").write_bytes(shard_bytes([row], schema.COMPLETIONS))
    manifest.write_manifest(
        folder, kind="completions", files=[{"name": "completions-00000.parquet", "rows": 1}], summary={"model": SMOLLM2}
    )
    with pytest.raises(DFlashError, match=f"generated by {SMOLLM2}, whose tokenizer is not 'qwen3'") as e:
        run_tokenize(folder, str(tmp_path / "tokenized"), load_config(None, ["tokenize.tokenizer=qwen3"]))
    assert e.value.field == "tokenize.tokenizer"


def test_the_pipeline_tokenizes_with_its_targets_tokenizer_unless_told():
    from dflash_ray.stages.pipeline import with_target_tokenizer

    cfg = with_target_tokenizer(load_config(None, [f"pipeline.target={SMOLLM2}"]))
    assert cfg.tokenize.tokenizer == cfg.prompts.tokenizer == SMOLLM2
    told = with_target_tokenizer(load_config(None, [f"pipeline.target={SMOLLM2}", "tokenize.tokenizer=other"]))
    assert told.tokenize.tokenizer == "other"


def test_keeping_every_prompt_aside_is_refused_naming_the_setting(tmp_path):
    from dflash_ray.stages.prompts import split_prompts
    from dflash_ray.stages.prompts import run_prompts

    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}?"}]}) + "\n" for i in range(3)))
    run_prompts(
        [str(raw)], str(tmp_path / "prompts"), load_config(None, [f"prompts.tokenizer={SMOLLM2}"]), progress=False
    )
    with pytest.raises(DFlashError) as e:
        split_prompts(str(tmp_path / "prompts"), str(tmp_path / "train"), str(tmp_path / "eval"), 3, 0)
    assert e.value.field == "pipeline.eval_prompts"


def test_a_generation_that_kept_no_answer_is_an_error_and_a_generator_no_node_holds_is_refused():
    from dflash_ray.generation.fleet import check_room
    from dflash_ray.stages.generate import _nonempty

    summary = {"completions": 0, "rejected": 2, "rejected_kinds": {"truncated": 2}}
    with pytest.raises(DFlashError, match="no completions: every one of 2 answers was rejected"):
        _nonempty(summary, "out")
    assert _nonempty({**summary, "completions": 1}, "out")["completions"] == 1
    gcfg = load_config(None, ["generate.generator_cpus=4"]).generate
    with pytest.raises(DFlashError) as e:
        check_room(gcfg, [{"CPU": 2.0}])
    assert e.value.field == "generate.generator_cpus"
    check_room(gcfg, [{"CPU": 2.0}, {"CPU": 8.0}])  # one node that can
    check_room(
        load_config(None, ["generate.generator_cpus=4", "generate.autoscale.enabled=true"]).generate, [{"CPU": 2.0}]
    )  # nodes may be added


@pytest.mark.parametrize("body", ["[1, 2]", '{"shards_done": "x"}', '{"done": {"0": 5}}'])
def test_status_on_a_progress_file_of_another_shape_names_it(body, tmp_path, capsys):
    (tmp_path / "_progress.json").write_text(body)
    assert main(["status", "--output", str(tmp_path)]) == 2
    assert "not a generation progress file" in _error(capsys)


_SHARD = {
    "completions": "completions-0.parquet",
    "rejected": "rejected-0.jsonl",
    "prompts": 2,
    "rows": 2,
    "counts": {"completions": 2, "rejected": 0},
    "output_tokens": 40,
    "node": "10.0.0.1",
}


@pytest.mark.parametrize(
    "body, says",
    [
        (b"not json", "corrupt generation progress"),
        (b'{"done": {"0": {"completions": "compl', "corrupt generation progress"),  # cut short
        (b"\xff\xfe\x00\x81binary", "corrupt generation progress"),
        (json.dumps({"done": {"first": _SHARD}}).encode(), "field 'done'"),
        (json.dumps({"done": {"0": {**_SHARD, "counts": None}}}).encode(), "field 'done.0.counts'"),
        (json.dumps({"done": {"0": {k: v for k, v in _SHARD.items() if k != "counts"}}}).encode(), "'done.0.counts'"),
        (json.dumps({"done": {"0": {**_SHARD, "rows": "2"}}}).encode(), "field 'done.0.rows'"),
        (json.dumps({"done": {"0": {**_SHARD, "output_tokens": float("nan")}}}).encode(), "'done.0.output_tokens'"),
        (json.dumps({"done": {"0": {**_SHARD, "counts": {"rejected": -1}}}}).encode(), "'done.0.counts.rejected'"),
        (json.dumps({"done": {"0": {**_SHARD, "node": ["10.0.0.1"]}}}).encode(), "field 'done.0.node'"),
    ],
)
def test_status_on_a_malformed_progress_file_names_the_file_and_field(body, says, tmp_path, capsys):
    (tmp_path / "_progress.json").write_bytes(body)
    assert main(["status", "--output", str(tmp_path)]) == 2
    err = _error(capsys)
    assert f"{tmp_path / '_progress.json'}: " in err and says in err and "internal error" not in err, err


def test_status_reads_a_finished_shard_and_refuses_a_manifest_that_is_no_mapping(tmp_path, capsys):
    (tmp_path / "_progress.json").write_text(json.dumps({"done": {"0": _SHARD}}))
    assert main(["status", "--output", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["shards_done"], out["output_tokens"], out["generator_nodes"], out["complete"]) == (
        1,
        40,
        ["10.0.0.1"],
        False,
    )
    for body, says in ((b"\x89PNG\r\n\x1a\n\x00", "not UTF-8 text"), (b"[1, 2]", "field 'files'")):
        (tmp_path / "_manifest.json").write_bytes(body)
        assert main(["status", "--output", str(tmp_path)]) == 2
        err = _error(capsys)
        assert f"{tmp_path / '_manifest.json'}: " in err and says in err and "internal error" not in err, err


@pytest.mark.parametrize("megabytes", ["1e-9", "inf", "nan"])
def test_netcheck_refuses_a_size_it_cannot_measure(megabytes, capsys):
    assert main(["netcheck", "--megabytes", megabytes, "--iters", "1"]) == 2
    assert "--megabytes" in _error(capsys)


@pytest.mark.parametrize(
    "text, field",
    [
        ("available_node_types:\n  a: 5\n", "available_node_types.a"),
        ("available_node_types: [1, 2]\n", "available_node_types"),
        (
            "available_node_types:\n  g: {max_workers: 2, resources: {GPU: eight, gen_node: 1}}\n",
            "available_node_types.g.resources.GPU",
        ),
        (
            "available_node_types:\n  g: {max_workers: -2, resources: {GPU: 8, gen_node: 1}}\n",
            "available_node_types.g.max_workers",
        ),
    ],
)
def test_plan_names_the_bad_entry_of_a_cluster_file(text, field, tmp_path, capsys):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    assert main(["plan", "--cluster", str(path)]) == 2
    assert f"cluster.yaml: field '{field}'" in _error(capsys)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": "big"}, "model_type"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"hidden_size": -64}, "hidden_size"),
    ],
)
def test_plan_names_the_bad_field_of_a_target_config(change, field, tmp_path, capsys):
    body = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
        **change,
    }
    path = tmp_path / "target.json"
    path.write_text(json.dumps(body))
    assert main(["plan", "--set", f"plan.target_config={path}"]) == 2
    assert f"target.json: field '{field}'" in _error(capsys)


def test_bad_s3_settings_in_the_environment_name_the_variable(monkeypatch):
    from dflash_ray import s3

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "abc")
    with pytest.raises(DFlashError, match="AWS_MAX_ATTEMPTS"):
        s3._client(-1)  # a key no cached client has
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "notaurl")
    with pytest.raises(DFlashError, match="AWS_ENDPOINT_URL"):
        s3._client(-2)


def test_an_unexpected_failure_says_it_is_a_bug(monkeypatch, capsys):
    from dflash_ray.stages import plan

    def broken(*args, **kwargs):
        raise RuntimeError("an invariant broke")

    monkeypatch.setattr(plan, "run_plan", broken)
    assert main(["plan", "--json"]) == 1
    out = capsys.readouterr()
    assert "This is a bug in dflash-ray, not in your input" in out.err and "Traceback" in out.err
    assert json.loads(out.out) == {
        "stage": "plan",
        "ok": False,
        "error": "RuntimeError: an invariant broke",
        "bug": True,
        "exit_code": 1,
    }


@pytest.mark.slow
def test_unseen_prompts_that_the_run_trains_on_are_refused(tmp_path):
    from dflash_ray.stages.prompts import unseen_prompts
    from dflash_ray.stages.prompts import run_prompts

    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}"])
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q {i}?"}]}) + "\n" for i in range(3)))
    run_prompts([str(raw)], str(tmp_path / "prompts"), cfg, progress=False)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"messages": [{"role": "user", "content": "something else"}]}) + "\n")
    assert unseen_prompts([str(other)], str(tmp_path / "prompts"), str(tmp_path / "unseen"), cfg) == 1
    with pytest.raises(DFlashError) as e:  # one of the run's own prompts is not unseen
        unseen_prompts([str(other), str(raw)], str(tmp_path / "prompts"), str(tmp_path / "unseen2"), cfg)
    assert e.value.field == "pipeline.unseen_prompts"


def test_dspark_with_no_loss_term_teaching_the_drafts_is_refused():
    from dflash_ray.preflight import check_settings

    with pytest.raises(DFlashError) as e:
        load_config(None, ["train.drafter=dspark", "train.family={ce_weight: 0, tv_weight: 0}"], check=check_settings)
    assert e.value.field == "train.family.ce_weight"


def test_an_export_into_a_folder_another_export_is_writing_is_refused(tmp_path, tiny_qwen3_dir):
    from transformers import AutoConfig

    from dflash_ray import writer
    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.stages.export import run_export

    cfg = from_target(AutoConfig.from_pretrained(tiny_qwen3_dir), mask_token_id=151660, num_layers=1)
    save_drafter(DFlashDrafter(cfg), tmp_path / "ckpt", dtype=torch.float32)
    with writer.claim(str(tmp_path / "out"), "drafter"):  # a first export, still writing
        with pytest.raises(DFlashError, match="another run is writing this output"):
            run_export(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, capsys):
    from dflash_ray.stages.evaluate import run_evaluate
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.train import run_train

    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    assert main(["selfprompt", "--model", SMOLLM2, "--output", str(afile), "--count", "1"]) == 2
    assert "is a file, not a folder" in _error(capsys)
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"messages": [{"role": "user", "content": "hi?"}]}) + "\n")
    run_prompts([str(raw)], str(tmp_path / "prompts"), load_config(None, [f"prompts.tokenizer={SMOLLM2}"]))
    with pytest.raises(DFlashError, match="is a file, not a folder"):  # before a model loads or a prompt decodes
        run_evaluate(
            str(tmp_path / "no-drafter"), SMOLLM2, str(tmp_path / "prompts"), load_config(), report_dir=str(afile)
        )
    with pytest.raises(DFlashError, match="overlap"):  # checkpoints among the data's shards
        run_train(SMOLLM2, str(tmp_path / "prompts"), str(tmp_path / "prompts" / "run"), load_config())
    assert afile.read_text() == "mine"


def test_a_plan_workload_of_less_than_two_tokens_a_sample_is_refused(capsys):
    assert main(["plan", "--set", "plan.prompts=1000000000000000000000"]) == 2
    assert "field 'plan.prompts'" in _error(capsys)


def test_onesample_refuses_more_blocks_than_the_target_has_positions(capsys):
    assert (
        main(["onesample", "--target", SMOLLM2, "--set", "train.block_size=4", "--set", "onesample.blocks=5000"]) == 2
    )
    assert "field 'onesample.blocks'" in _error(capsys)


@pytest.mark.slow
def test_a_rerun_never_replaces_a_finished_dataset_made_from_other_inputs_or_settings(tmp_path, capsys):
    """prompts, responses and tokenize into a folder holding their finished dataset from other inputs
    or settings: refused naming what differs, the dataset intact; `--replace` makes it anew; the same
    command again is a rerun."""
    chats, sharegpt = _asset("demo_chats.jsonl"), _asset("demo_sharegpt.jsonl")
    out = tmp_path / "prompts"
    assert main(["prompts", "--input", chats, "--output", str(out)]) == 0
    assert main(["prompts", "--input", chats, "--output", str(out)]) == 0  # the same inputs: a rerun
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["prompts", "--input", sharegpt, "--output", str(out)]) == 2
    assert "made from other inputs: this run would replace it" in _error(capsys)
    assert main(["prompts", "--input", chats, "--output", str(out), "--set", "prompts.max_prompt_tokens=64"]) == 2
    assert "prompts.max_prompt_tokens" in _error(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert manifest.read_manifest(str(out))["made_from"]["inputs"] == [chats]
    assert main(["prompts", "--input", sharegpt, "--output", str(out), "--replace"]) == 0
    assert manifest.read_manifest(str(out))["made_from"]["inputs"] == [sharegpt]
    answers = tmp_path / "completions"
    assert main(["responses", "--input", chats, "--output", str(answers)]) == 0
    assert main(["responses", "--input", sharegpt, "--output", str(answers)]) == 2
    # tokenize: refused before any Ray worker starts
    tokenized = tmp_path / "tokenized"
    tokenized.mkdir()
    manifest.write_manifest(
        str(tokenized),
        kind="tokenized",
        files=[],
        summary={},
        made_from={"input": "elsewhere", "tokenize.max_seq_len": 1},
    )
    assert main(["tokenize", "--input", str(answers), "--output", str(tokenized)]) == 2
    assert "made from other input, tokenize.max_seq_len" in _error(capsys)


def test_the_report_of_a_run_that_did_not_finish_is_not_read_as_data(tmp_path, capsys):
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "quarantine.jsonl").write_text('{"kind": "no_response"}\n')
    assert main(["tokenize", "--input", str(failed), "--output", str(tmp_path / "t")]) == 2
    assert "holds quarantine.jsonl but no _manifest.json: a run that did not finish" in _error(capsys)


def test_links_in_a_loop_are_named(tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "a.jsonl").symlink_to("b.jsonl")
    (loop / "b.jsonl").symlink_to("a.jsonl")
    assert main(["prompts", "--input", str(loop), "--output", str(tmp_path / "o")]) == 2
    assert "files found (skipped: a.jsonl, b.jsonl)" in _error(capsys)
    assert main(["prompts", "--input", str(loop / "a.jsonl"), "--output", str(tmp_path / "o")]) == 2
    assert "a symbolic link that leads back to itself (a loop)" in _error(capsys)


def test_an_output_that_is_a_file_is_named_as_one_before_any_work(tmp_path, capsys):
    mine = tmp_path / "mine.txt"
    mine.write_text("keep")
    for argv in (
        ["prompts", "--input", _asset("demo_chats.jsonl"), "--output", str(mine)],
        ["pipeline", "--input", _asset("demo_chats.jsonl"), "--workdir", str(mine), "--target", SMOLLM2],
        ["train", "--data", str(tmp_path), "--target", SMOLLM2, "--output", str(mine)],
    ):
        assert main(argv) == 2, argv
        assert f"{mine}: is a file" in _error(capsys)
    assert mine.read_text() == "keep"


def test_an_answer_whose_thinking_never_closes_is_quarantined(tmp_path):
    from dflash_ray.stages.prompts import run_prompts

    raw = tmp_path / "cut.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nabc"}]
    whole = [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nHello."}]
    raw.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": whole}) + "\n")
    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}"])
    summary = run_prompts([str(raw)], str(tmp_path / "out"), cfg, progress=False, responses=True)
    assert summary["quarantine_kinds"] == {"unclosed_thinking": 1} and summary["prompts"] == 1


@pytest.mark.slow
def test_evaluate_names_a_drafter_of_another_target_or_a_damaged_one(tmp_path, tiny_qwen3_dir, capsys):
    from transformers import AutoConfig

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.stages.prompts import run_prompts

    cfg = from_target(
        AutoConfig.from_pretrained(tiny_qwen3_dir), mask_token_id=151660, num_layers=1, num_target_features=3
    )
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello there"}]}) + "\n")
    run_prompts([str(raw)], str(tmp_path / "prompts"), load_config(), progress=False)
    evaluate = ["evaluate", "--target", tiny_qwen3_dir, "--tokenizer", "qwen3", "--prompts", str(tmp_path / "prompts")]
    for name, edit, said in (
        ("other", lambda c: c.update(vocab_size=c["vocab_size"] + 1000), "a drafter of another target"),
        (
            "zero",
            lambda c: c.update(block_size=0),
            "field 'block_size': expected a whole number in 2..1024; found int 0",
        ),
        ("cut", None, "not a readable safetensors file"),
    ):
        folder = tmp_path / name
        save_drafter(DFlashDrafter(cfg), folder, dtype=torch.float32)
        if edit is None:
            weights = folder / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
        else:
            config = json.loads((folder / "config.json").read_text())
            edit(config)
            (folder / "config.json").write_text(json.dumps(config))
        assert main([*evaluate, "--drafter", str(folder), "--set", "evaluate.max_new_tokens=2"]) == 2, name
        assert said in _error(capsys), name


def test_a_block_longer_than_any_kept_sample_and_a_bad_iters_name_their_setting(capsys):
    with pytest.raises(DFlashError, match="no block would fit") as e:
        load_config(None, ["train.block_size=1000", "tokenize.max_seq_len=512"])
    assert e.value.field == "train.block_size"
    assert main(["netcheck", "--iters", "0"]) == 2
    assert "field '--iters'" in _error(capsys)


def test_a_model_folder_without_a_model_is_named_before_any_engine(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("{}\n")
    assert main(["selfprompt", "--model", str(folder), "--count", "2", "--output", str(tmp_path / "o")]) == 2
    assert f"{folder}: not a model folder: it holds no config.json" in _error(capsys)


def test_reasoning_content_is_the_answers_thinking_and_odd_turns_are_quarantined(tmp_path):
    """An answer's `reasoning_content` field is its thinking (it was dropped); one that is not text,
    two user turns in a row, and an answer that is only a thinking block are quarantined."""
    from dflash_ray.stages.prompts import run_prompts

    user = {"role": "user", "content": "q"}
    records = [
        {"messages": [user, {"role": "assistant", "content": "final", "reasoning_content": "because"}]},
        {"messages": [{**user, "content": "q2"}, {"role": "assistant", "content": "x", "reasoning_content": 123}]},
        {"messages": [user, {"role": "user", "content": "again"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{**user, "content": "q3"}, {"role": "assistant", "content": "<think>only</think>"}]},
    ]
    raw = tmp_path / "in.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}"])
    summary = run_prompts([str(raw)], str(tmp_path / "out"), cfg, progress=False, responses=True)
    assert summary["prompts"] == 1
    assert summary["quarantine_kinds"] == {"bad_field": 1, "role_order": 1, "empty_response": 1}, summary
    (row,) = manifest.read_rows(str(tmp_path / "out"), ["reasoning", "text"], 10)
    assert (row["reasoning"], row["text"]) == ("because", "final")


@pytest.mark.slow
def test_tokenize_names_a_misspelled_tokenizer_before_any_worker(tmp_path, capsys):
    answers = tmp_path / "c"
    assert main(["responses", "--input", _asset("demo_chats.jsonl"), "--output", str(answers)]) == 0
    capsys.readouterr()
    assert main(["tokenize", "--input", str(answers), "--output", str(tmp_path / "t"), "--tokenizer", "smollm2-x"]) == 2
    assert "smollm2-x: field 'tokenize.tokenizer': not a short name" in _error(capsys)


def test_export_of_a_training_output_names_its_newest_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (2, 4):
        folder = run / "checkpoints" / f"step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "MANIFEST.json").write_text(json.dumps({"step": step, "files": {}}))
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    assert f"the newest being {run}/checkpoints/step-00000004" in _error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_progress_file_naming_a_shard_outside_the_output_is_refused_naming_it(tmp_path, capsys):
    done = {"completions": "completions-0.parquet", "rejected": "../../../../etc/passwd", "rows": 1, "prompts": 1}
    (tmp_path / "_progress.json").write_text(json.dumps({"plan": {}, "done": {"0": done}}))
    assert main(["status", "--output", str(tmp_path)]) == 2
    err = _error(capsys)
    assert "field 'done.0.rejected'" in err and "climbs out of the folder" in err


def test_a_saved_dataset_naming_a_file_outside_its_folder_is_refused(tmp_path, capsys):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../x.arrow"}]}))
    assert main(["validate", "--input", str(tmp_path / "ds"), "--tokenizer", SMOLLM2]) == 2
    assert "field '_data_files[0].filename'" in _error(capsys)


def test_a_link_out_of_an_input_folder_is_skipped_and_named(tmp_path, capsys):
    from dflash_ray.stages.prompts import run_prompts

    (tmp_path / "shadow").write_text("root:$6$secret:19000:0:99999:7:::\n")
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi?"}]}) + "\n")
    (folder / "users.jsonl").symlink_to(tmp_path / "shadow")
    summary = run_prompts([str(folder)], str(tmp_path / "out"), load_config(None, []), progress=False)
    assert summary["records"] == 1 and summary["skipped_files"] == [str(folder / "users.jsonl")]
    assert "users.jsonl" in _error(capsys)
    assert "secret" not in (tmp_path / "out" / "quarantine.jsonl").read_text()


def test_dolly_records_keep_their_passage_and_answer(tmp_path):
    """Dolly's `instruction`/`context`/`response`: the context is the prompt's passage in `prompts`,
    the response is the answer in `responses`; an instruction record with no answer names the fields."""
    from dflash_ray.stages.prompts import run_prompts

    dolly = {"instruction": "Who wrote it?", "context": "Hamlet was written by Shakespeare.", "category": "closed_qa"}
    raw = tmp_path / "dolly.jsonl"
    raw.write_text(json.dumps({**dolly, "response": "Shakespeare."}) + "\n" + json.dumps(dolly) + "\n")
    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}"])
    run_prompts([str(raw)], str(tmp_path / "prompts"), cfg, progress=False)  # the same prompt twice: one
    asked = [{"role": "user", "content": "Who wrote it?\n\nHamlet was written by Shakespeare."}]
    assert [r["messages"] for r in manifest.read_rows(str(tmp_path / "prompts"), ["messages"], 10)] == [asked]
    summary = run_prompts([str(raw)], str(tmp_path / "answers"), cfg, progress=False, responses=True)
    assert summary["prompts"] == 1 and summary["quarantine_kinds"] == {"no_response": 1}, summary
    (row,) = manifest.read_rows(str(tmp_path / "answers"), ["messages", "text"], 10)
    assert [m["content"] for m in row["messages"]] == [asked[0]["content"]] and row["text"] == "Shakespeare."
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "answers" / "quarantine.jsonl").open()]
    assert reasons == ["an instruction record with no answer: neither 'output' (Alpaca) nor 'response' (Dolly)"]


def test_thinking_tags_are_split_as_templates_make_them_or_quarantined_with_the_reason(tmp_path):
    """R1's answers close a block their template opened (`...</think>answer`): the part before is the
    thinking; `<THINK>` is a tag in any case; nested or repeated tags are quarantined, saying so."""
    from dflash_ray.stages.prompts import run_prompts

    answers = {
        "q1": "Two is even and prime.\n</think>\n\nTwo.",
        "q2": "<THINK>Small primes.</THINK>\n\nThree.",
        "q3": "<think>a<think>b</think>c</think>Five.",
        "q4": "<think>a</think>Seven.</think>",
    }
    raw = tmp_path / "in.jsonl"
    raw.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in answers.items()
        )
    )
    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}"])
    summary = run_prompts([str(raw)], str(tmp_path / "out"), cfg, progress=False, responses=True)
    assert summary["prompts"] == 2 and summary["quarantine_kinds"] == {"ambiguous_thinking": 2}, summary
    rows = manifest.read_rows(str(tmp_path / "out"), ["reasoning", "text"], 10)
    assert sorted((r["reasoning"], r["text"]) for r in rows) == [
        ("Small primes.", "Three."),
        ("Two is even and prime.", "Two."),
    ]
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "out" / "quarantine.jsonl").open()]
    assert "nested, one block inside another" in reasons[0] and "a stray closing tag" in reasons[1], reasons


def test_a_full_disk_is_named_in_every_stage_with_the_json_line(tmp_path, tiny_qwen3_dir, monkeypatch, capsys):
    """export onto a full disk: the path and the space needed, the --json line, nothing left (its
    folder included); a full disk a stage met without a path, or in a Ray worker (said only in the
    worker's traceback), is named too: never a traceback, never "a bug"."""
    import errno
    import os

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.stages import plan
    from transformers import AutoConfig

    cfg = from_target(
        AutoConfig.from_pretrained(tiny_qwen3_dir), mask_token_id=151660, num_layers=1, num_target_features=3
    )
    save_drafter(DFlashDrafter(cfg), tmp_path / "ckpt" / "drafter", dtype=torch.float32)

    fsync = os.fsync

    def full(fd):  # room for the small files (the writer's claim), none for the weights
        if os.fstat(fd).st_size > 10_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full)
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "export"), "--json"]) == 2
    summary = json.loads(capsys.readouterr().out)
    assert "export/model.safetensors: no space left on the device (" in summary["error"], summary
    assert " KB to write, " in summary["error"] and not (tmp_path / "export").exists()

    for raised, said in (
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on a device ("),
        (
            RuntimeError(  # a Ray Data worker's error: its traceback as text
                "ray::MapWorker(Map(_TokenizeUnit)).submit()\n  File x, line 1\n"
                "dflash_ray.errors.DiskFull: /data/tok/part.parquet: no space left on the device (1.0 KB to write, "
                "0 B free there): nothing half-written is left\n\nThe above exception was the direct cause of ..."
            ),
            "/data/tok/part.parquet: no space left on the device (1.0 KB to write",
        ),
    ):

        def broken(*args, raised=raised, **kwargs):
            raise raised

        monkeypatch.setattr(plan, "run_plan", broken)
        assert main(["plan", "--json"]) == 2
        out = capsys.readouterr()
        assert said in json.loads(out.out)["error"] and "Traceback" not in out.err and "bug" not in out.err


@pytest.fixture
def no_ray(monkeypatch):
    """Ray may not start: a check that should come first fails the test instead of reaching it."""
    import ray

    def started(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", started)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def _prompts(tmp_path, name="prompts") -> str:
    from dflash_ray.stages.prompts import run_prompts

    raw = tmp_path / f"{name}.jsonl"
    raw.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello there"}]}) + "\n")
    run_prompts([str(raw)], str(tmp_path / name), load_config(), progress=False)
    return str(tmp_path / name)


@pytest.mark.slow
def test_validate_and_evaluate_never_write_over_a_users_files_in_their_report_folder(tmp_path, capsys):
    """A report folder of the user's own files is refused with every file kept, and so is one that
    is or lies inside the input; a report folder a validation made is written again by a rerun."""
    from dflash_ray import writer

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3, 4]] * 4, "loss_mask": [[0, 0, 1, 1]] * 4}), data / "part.parquet")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    (mine / "evaluation.png").write_bytes(b"my plot")
    validate = ["validate", "--input", str(data), "--tokenizer", SMOLLM2, "--report"]
    assert main([*validate, str(mine)]) == 2
    assert "evaluation.png, report.md, which no dflash-ray run wrote" in _error(capsys)
    for report in (data, data / "report"):
        assert main([*validate, str(report)]) == 2
        assert (
            f"{report}" in (err := _error(capsys))
            and "overlap (one is, or is inside, the other)" in err
            and "field '--report'" in err
        )
    assert sorted(p.name for p in data.iterdir()) == ["part.parquet"]
    ours = tmp_path / "report"
    first = main([*validate, str(ours)])
    assert first in (0, 3) and (ours / "report.md").exists()
    assert main([*validate, str(ours)]) == first  # a rerun into the folder the first run made
    (ours / writer.MARK).unlink()  # a report an earlier version wrote, unmarked: known by its report.json
    assert main([*validate, str(ours)]) == first
    prompts = _prompts(tmp_path)
    evaluate = ["evaluate", "--drafter", str(tmp_path / "d"), "--target", str(tmp_path / "t"), "--prompts", prompts]
    assert main([*evaluate, "--report", str(mine)]) == 2
    assert "evaluation.png, report.md, which no dflash-ray run wrote" in _error(capsys)
    assert main([*evaluate, "--report", str(tmp_path / "prompts" / "plots")]) == 2
    assert (
        "overlap (one is, or is inside, the other)" in _error(capsys) and not (tmp_path / "prompts" / "plots").exists()
    )
    assert (mine / "report.md").read_text() == "my notes" and (mine / "evaluation.png").read_bytes() == b"my plot"
    assert sorted(p.name for p in mine.iterdir()) == ["evaluation.png", "report.md"]


@pytest.mark.slow
def test_tokenize_loads_its_tokenizer_on_the_driver_before_ray_starts(tmp_path, tiny_qwen3_dir, no_ray, capsys):
    """A model folder without tokenizer files, a file that is no tokenizer and a tokenizer without a
    chat template are each refused naming the setting, before any worker starts and before the
    output is made."""
    import shutil

    from dflash_ray.registry import resolve

    answers = tmp_path / "c"
    assert main(["responses", "--input", _asset("demo_chats.jsonl"), "--output", str(answers)]) == 0
    afile = tmp_path / "myfile.txt"
    afile.write_text("not a tokenizer")
    plain = tmp_path / "plain"
    shutil.copytree(resolve("qwen3", need="tokenizer"), plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    capsys.readouterr()
    for tokenizer, says in (
        (tiny_qwen3_dir, "holds no tokenizer"),
        (afile, "cannot load"),
        (plain, "no chat template"),
    ):
        code = main(
            ["tokenize", "--input", str(answers), "--output", str(tmp_path / "t"), "--tokenizer", str(tokenizer)]
        )
        err = _error(capsys)
        assert code == 2 and "field 'tokenize.tokenizer'" in err and says in err, err
        assert "--tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "t").exists()


def test_tokenize_and_generate_refuse_an_output_inside_their_input(tmp_path, no_ray, capsys):
    answers = tmp_path / "c"
    assert main(["responses", "--input", _asset("demo_chats.jsonl"), "--output", str(answers)]) == 0
    before = sorted(p.name for p in answers.iterdir())
    capsys.readouterr()
    assert main(["tokenize", "--input", str(answers), "--output", str(answers / "tok")]) == 2
    assert "and the input" in (err := _error(capsys)) and "overlap (one is" in err
    prompts = _prompts(tmp_path)
    generate = ["generate", "--prompts", prompts, "--output", f"{prompts}/gen", "--model", str(tmp_path / "no-model")]
    assert main(generate) == 2
    assert "and the prompts" in (err := _error(capsys)) and "overlap (one is" in err
    assert sorted(p.name for p in answers.iterdir()) == before and not (tmp_path / "prompts" / "gen").exists()


def test_evaluate_refuses_a_drafter_export_given_as_the_target(tmp_path, tiny_qwen3_dir, capsys):
    from transformers import AutoConfig

    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.drafter.model import DFlashDrafter

    cfg = from_target(AutoConfig.from_pretrained(tiny_qwen3_dir), mask_token_id=151660, num_layers=1)
    save_drafter(DFlashDrafter(cfg), tmp_path / "drafter", dtype=torch.float32)
    drafter, prompts = str(tmp_path / "drafter"), _prompts(tmp_path)
    evaluate = ["evaluate", "--drafter", drafter, "--target", drafter, "--tokenizer", "qwen3", "--prompts", prompts]
    assert main(evaluate) == 2
    err = _error(capsys)
    assert f"{drafter}: field '--target': a drafter export, not a target model" in err, err


def test_train_names_data_that_is_not_tokenized_before_ray_starts(tmp_path, tiny_qwen3_dir, no_ray, capsys):
    prompts = _prompts(tmp_path)
    out = tmp_path / "run"
    assert main(["train", "--data", prompts, "--target", tiny_qwen3_dir, "--output", str(out)]) == 2
    err = _error(capsys)
    assert f"{prompts}: holds prompts, not tokenized samples" in err, err
    assert not out.exists()


def test_the_pipeline_refuses_a_workdir_of_the_users_files(tmp_path, no_ray, monkeypatch, capsys):
    """A workdir holding files no dflash-ray run wrote is refused before any stage, every file kept; a
    new one, one a pipeline marked and one an earlier pipeline wrote (its stage folders' manifests)
    reach the stages."""
    from dflash_ray import stages, storage

    def step(run):  # a first stage that wrote its folder, then failed
        storage.write_text(run.at("prompts/part.txt"), "a stage's output")
        raise DFlashError("the stages were reached")

    first = stages.Stage(name="first", help="", command=lambda args, cfg: {}, step=step)
    monkeypatch.setattr(stages, "pipeline_stages", lambda: [first])
    chat = _asset("demo_chats.jsonl")
    work = tmp_path / "work"
    work.mkdir()
    (work / "chat.jsonl").write_text("{}\n")
    (work / "notes.md").write_text("mine")
    pipeline = ["pipeline", "--input", chat, "--target", SMOLLM2, "--workdir"]
    assert main([*pipeline, str(work)]) == 2
    assert "chat.jsonl, notes.md, which no dflash-ray run wrote" in _error(capsys)
    assert sorted(p.name for p in work.iterdir()) == ["chat.jsonl", "notes.md"]
    for _ in range(2):  # a new workdir, then the same one again (marked by the first run)
        assert main([*pipeline, str(tmp_path / "new")]) == 2
        assert "the stages were reached" in _error(capsys)
        assert (tmp_path / "new" / "prompts" / "part.txt").exists()
    earlier = tmp_path / "earlier"
    manifest.write_manifest(str(earlier / "prompts"), kind="prompts", files=[], summary={})
    (earlier / "notes.md").write_text("beside an earlier run's stages")
    assert main([*pipeline, str(earlier)]) == 2
    assert "the stages were reached" in _error(capsys)


def test_an_empty_generation_name_and_a_generator_count_past_the_bound_are_refused_before_ray(capsys):
    assert main(["pause", "--name", ""]) == 2
    assert "'--name'" in _error(capsys)
    assert main(["resume", "--name", "  "]) == 2
    assert "'--name'" in _error(capsys)
    assert main(["scale", "generators", "99999999999"]) == 2
    err = _error(capsys)
    assert "99999999999" in err and "10000" in err and "generators" in err


def test_an_s3_uri_without_a_bucket_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    from dflash_ray import s3

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fake")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake")
    assert main(["prompts", "--input", "s3://", "--output", str(tmp_path / "out")]) == 2
    err = _error(capsys)
    assert "s3://: " in err and "no bucket" in err and "Parameter validation" not in err
    with pytest.raises(DFlashError, match="no bucket") as e:
        s3.split("s3:///key")
    assert e.value.file == "s3:///key"
    assert s3.split("s3://bucket") == ("bucket", "") and s3.split("s3://b/k/x") == ("b", "k/x")

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash_ray.cli import main
from dflash_ray.config import load_config
from dflash_ray.stages.prompts import run_prompts
from dflash_ray.drafter.config import from_target
from dflash_ray.drafter.export import load_drafter, save_drafter
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.ngram import accepted_at, simulate_steps


def test_ngram_baseline_simulation():
    def simulate(prompt, output):
        return [step.commit for step in simulate_steps(prompt, output)]

    assert simulate([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 9]) == [1, 4]
    assert sum(simulate([7], [1, 2, 3, 1, 2, 3, 1, 2, 3])) == 8
    # no earlier match: a step without a draft; vLLM counts only the others
    steps = simulate_steps([7], [1, 2, 3, 1, 2, 3, 1, 2, 3])
    assert [(s.commit, s.drafted > 0) for s in steps] == [(1, False)] * 4 + [(4, True)]
    assert steps[-1] == (4, 3, 3)  # 3 drafted, all accepted, and the target's own token
    assert simulate_steps([7], [1, 2, 3, 1, 2, 3, 1, 2])[-1] == (3, 3, 3)  # the output ends: no token after


def test_lookup_scored_at_an_anchor_accepts_what_its_decoding_step_accepts():
    """`accepted_at` (lookup on the teacher-forced benches' blocks) agrees with every step of the
    decoding simulation, each step anchored at the last token it had committed."""
    prompt = [5, 1, 2, 3, 9, 4, 1, 2, 8]
    output = [1, 2, 3, 9, 4, 7, 1, 2, 3, 9, 6, 1, 2, 8, 5, 1]
    tokens, done = prompt + output, 1
    for step in simulate_steps(prompt, output, num_tokens=3):
        assert accepted_at(tokens, len(prompt) + done - 1, 3, 2, 4) == step.accepted
        done += step.commit
    # [1, 2, 3] ends at the anchor and in the prompt, where 9, 4, 1 follow; the target wrote 9, 4, 7
    assert accepted_at(tokens, len(prompt) + 2, 3, 2, 4) == 2


@pytest.mark.slow
def test_export_and_evaluate_commands(tmp_path, tiny_qwen3_dir, capsys):
    from transformers import AutoConfig

    cfg = from_target(
        AutoConfig.from_pretrained(tiny_qwen3_dir), mask_token_id=151660, num_layers=1, num_target_features=3
    )
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp_path / "ckpt" / "drafter", dtype=torch.float32)

    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "export"), "--dtype", "bfloat16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["layers"] == 1
    assert next(load_drafter(tmp_path / "export").parameters()).dtype == torch.bfloat16

    raw = tmp_path / "raw.jsonl"
    raw.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": q}]})
            for q in ("Hello there", "Count to three", "Name a color")
        )
    )
    run_prompts([str(raw)], str(tmp_path / "prompts"), load_config(), progress=False)
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    pq.write_table(
        pa.table({"input_ids": [list(range(100, 140))] * 2, "loss_mask": [[0] * 10 + [1] * 30] * 2}),
        heldout / "part-0.parquet",
    )
    code = main(
        [
            "evaluate",
            "--drafter",
            str(tmp_path / "export"),
            "--target",
            tiny_qwen3_dir,
            "--tokenizer",
            "qwen3",
            "--prompts",
            str(tmp_path / "prompts"),
            "--heldout",
            str(heldout),
            "--set",
            "evaluate.max_new_tokens=12",
            "--set",
            "evaluate.num_anchors=8",
            "--report",
            str(tmp_path / "report"),
            "--json",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["lossless"] and summary["prompts"] == 3
    assert summary["tokens"] == 36 and summary["tau"] >= 1 and summary["tau_ngram"] >= 1
    assert 1 <= summary["tau_sampled"] <= 16 and summary["sampling"] == {"temperature": 0.6, "top_p": 0.95}
    assert 0 <= summary["ngram_draft_share"] <= 1
    for key in ("acceptance_by_position", "acceptance_by_position_sampled"):  # every draft position of the block
        assert len(summary[key]) == 15 and all(r is None or 0 <= r <= 1 for r in summary[key]), summary[key]
    if summary["ngram_draft_share"]:  # per proposed draft is never below per target forward
        assert summary["tau_ngram_per_draft"] >= summary["tau_ngram"]
    assert set(summary["tau_per_source"]) == set(summary["tau_ngram_per_source"]) == {"raw"}
    # where acceptance is lost, the drafter beside lookup: per draft position and per source, and their plot
    lookup = summary["ngram_acceptance_by_position"]
    assert len(lookup) <= 15 and all(r is None or 0 <= r <= 1 for r in lookup), lookup
    assert summary["tau_ngram_per_source"]["raw"] == summary["tau_ngram"]
    assert (tmp_path / "report" / "evaluation.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["tokens_per_s"] > 0 and summary["target_tokens_per_s"] > 0
    assert 1 <= summary["tau_simulated_heldout"] < 1.5  # an untrained drafter

    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_export_checks_a_checkpoint_against_its_manifest(tmp_path, capsys):
    """A same-size corruption or a truncation of a checkpoint's drafter weights is an error naming
    the file and an earlier checkpoint to use; nothing is exported."""
    from dflash_ray.train import checkpoint

    cfg = from_target(_tiny_target_config(), mask_token_id=500, num_layers=1, target_layer_ids=[0, 1])
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(cfg), tmp_path / "d", dtype=torch.float32)
    files = {f"drafter/{p.name}": p.read_bytes() for p in (tmp_path / "d").iterdir()}
    run = str(tmp_path / "run")
    for step in (2, 4):
        checkpoint.save(run, step, files)
    step4 = checkpoint.step_dir(run, 4)

    assert main(["export", step4, str(tmp_path / "good"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified_files"] == 2

    # a checkpoint copied under another name (a user's `best`) is checked all the same
    import shutil

    best = tmp_path / "best"
    shutil.copytree(step4, best)
    copied = best / "drafter" / "model.safetensors"
    body = bytearray(copied.read_bytes())
    body[len(body) // 2] ^= 0xFF
    copied.write_bytes(bytes(body))
    assert main(["export", str(best), str(tmp_path / "from-best"), "--json"]) == 2
    assert "sha256" in json.loads(capsys.readouterr().out)["error"]
    assert not (tmp_path / "from-best").exists()

    # an output inside the checkpoint (or the checkpoint inside the output) would overwrite what it
    # reads: refused with the checkpoint untouched, which still exports
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    for out in (step4 + "/drafter", step4, str(tmp_path / "run")):
        assert main(["export", step4, out, "--json"]) == 2
        assert "overlap" in json.loads(capsys.readouterr().out)["error"]
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    (tmp_path / "a-file").write_text("mine")
    assert main(["export", step4, str(tmp_path / "a-file"), "--json"]) == 2
    assert "is a file" in json.loads(capsys.readouterr().out)["error"]
    assert (tmp_path / "a-file").read_text() == "mine"

    weights = tmp_path / "run" / "checkpoints" / "step-00000004" / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64  # same size, other weights
    weights.write_bytes(bytes(data))
    assert main(["export", step4, str(tmp_path / "bad"), "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "model.safetensors" in error and "sha256" in error and "step-00000002" in error
    weights.write_bytes(bytes(data[:100]))
    assert main(["export", step4, str(tmp_path / "bad"), "--json"]) == 2
    assert "truncated" in json.loads(capsys.readouterr().out)["error"]
    assert not (tmp_path / "bad").exists()


def _tiny_target_config():
    from conftest import small_qwen3_config

    return small_qwen3_config()


def test_a_dataset_of_the_wrong_kind_is_refused_before_any_model_or_engine_starts(tmp_path, capsys):
    """`evaluate --heldout` given prompts and `generate --prompts` given tokenized rows: each refused at
    once, naming the file and the missing columns (before, a 98 s decode or two engine starts came first)."""
    import time

    from dflash_ray.errors import DFlashError
    from dflash_ray.stages.generate import run_generate

    prompts, tokenized = tmp_path / "prompts", tmp_path / "tokenized"
    for folder, row in (
        (prompts, {"id": "p", "messages": [{"role": "user", "content": "hi"}]}),
        (tokenized, {"id": "t", "input_ids": [1, 2], "loss_mask": [0, 1], "seq_len": 2}),
    ):
        folder.mkdir()
        pq.write_table(pa.Table.from_pylist([row]), folder / "part-0.parquet")
    start = time.monotonic()
    code = main(
        [
            "evaluate",
            "--drafter",
            str(tmp_path / "no-drafter"),
            "--target",
            str(tmp_path / "no-target"),
            "--prompts",
            str(prompts),
            "--heldout",
            str(prompts),
            "--json",
        ]
    )
    error = json.loads(capsys.readouterr().out)["error"]
    assert code == 2 and "--heldout" in error and "input_ids" in error and "part-0.parquet" in error
    with pytest.raises(DFlashError) as e:
        run_generate(str(tokenized), str(tmp_path / "out"), str(tmp_path / "no-model"), load_config(None, []))
    assert "--prompts" in str(e.value) and "messages" in str(e.value)
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()


def test_evaluate_skips_prompts_past_the_targets_positions_before_decoding_and_says_so(
    tmp_path, tiny_qwen3_dir, capsys, caplog
):
    """A prompt that with evaluate.max_new_tokens passes the target's max_position_embeddings is
    measured before anything is decoded, left out, said on stderr and counted in the summary; none
    left is an error naming the setting."""
    import shutil

    from transformers import AutoConfig

    short = tmp_path / "short-target"
    shutil.copytree(tiny_qwen3_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    cfg = from_target(AutoConfig.from_pretrained(short), mask_token_id=151660, num_layers=1, num_target_features=3)
    save_drafter(DFlashDrafter(cfg), tmp_path / "drafter", dtype=torch.float32)
    raw = tmp_path / "raw.jsonl"
    raw.write_text(
        "\n".join(json.dumps({"messages": [{"role": "user", "content": q}]}) for q in ("Hello there", "word " * 80))
    )
    run_prompts([str(raw)], str(tmp_path / "prompts"), load_config(), progress=False)
    evaluate = ["evaluate", "--drafter", str(tmp_path / "drafter"), "--target", str(short), "--tokenizer", "qwen3"]
    evaluate += ["--prompts", str(tmp_path / "prompts"), "--json"]
    assert main([*evaluate, "--set", "evaluate.max_new_tokens=4", "--set", "evaluate.temperature=0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts"] == 1 and summary["prompts_skipped"] == 1 and summary["context"] == 48
    said = caplog.text
    assert "1 of 2 prompts (up to 89 tokens)" in said and "pass the target's 48 positions" in said, said
    assert main([*evaluate, "--set", "evaluate.max_new_tokens=40"]) == 2  # the short one no longer fits either
    summary = json.loads(capsys.readouterr().out)
    assert "none is left to measure" in summary["error"] and "evaluate.max_new_tokens" in summary["error"]

"""Paired training runs held to NCCL's rules (mid-run evaluations and checkpoints at every
in-flight depth), resumes on another stream count or refused on rewritten data, and a diverging
run stopped at its step. Apart from test_train.py so that the two files run side by side."""

import pytest
import torch

from conftest import checkpoint_weights
from dflash_ray import manifest, storage
from dflash_ray.config import load_config
from dflash_ray.stages.train import run_train
from dflash_ray.train import checkpoint
from test_train import SETTINGS, _tokenized, data, target  # noqa: F401  (the tiny training run's fixtures)


def test_mid_run_evaluations_and_checkpoints_never_wait_on_a_targets_own_sends(ray_cluster, target, data, tmp_path):
    """Under NCCL's rules a target's batch for step t+1 stays unmatched until its drafter's next
    step, so an evaluation at step t that made the target wait on its device would hang (on GPUs
    until the watchdog; here it raises after the timeout, and no restart is allowed). Evaluations at
    steps 2, 4, 6 and checkpoints at 3, 6 with 0 and 2 batches ahead all run, and train the same
    weights bit for bit (an evaluation changes nothing in training)."""
    import json

    weights = []
    for ahead in (0, 2):
        out = str(tmp_path / f"ahead{ahead}")
        cfg = load_config(
            None,
            SETTINGS
            + [
                "train.heldout=4",
                "train.eval_every=2",
                f"train.max_in_flight={ahead}",
                "train.collective_timeout_s=20",
                "train.max_restarts=0",
            ],
        )
        summary = run_train(target, data, out, cfg, progress=False)
        assert summary["restarts"] == 0 and summary["step"] == 6, summary
        metrics = [json.loads(x) for x in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()]
        assert [m["step"] for m in metrics if m.get("heldout_tau") is not None] == [2, 4, 6]
        assert checkpoint.complete_steps(out)[-1] == 6
        weights.append(checkpoint_weights(out))
    assert weights[0] == weights[1]


def test_a_two_stream_checkpoint_resumes_on_one_stream_where_its_data_stood(ray_cluster, target, data, tmp_path):
    """Resharding: a 2-stream run stopped at step 3 (6 of its 16 samples taken) goes on on one
    stream: its one rank loads both ranks' shards, the first 3 steps are kept as they were, and the
    10 samples left of the epoch take 10 more steps, at the rate the samples behind each reached."""
    import json

    out = str(tmp_path / "reshard")
    colocated = SETTINGS + ["train.colocate=true"]  # the drafters' shards are the subject, not the handoff
    first = run_train(target, data, out, load_config(None, colocated), progress=False, stop_after_step=3)
    assert first["step"] == 3 and first["total_steps"] == 8
    before = [json.loads(x) for x in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()]
    one = run_train(target, data, out, load_config(None, colocated + ["train.num_streams=1"]), progress=False)
    assert one["step"] == one["total_steps"] == 13 and one["restarts"] == 0
    metrics = [json.loads(x) for x in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 14)) and metrics[:3] == before
    # the rate goes on from the samples behind the step (6 of 16), not from the step (3 of 13)
    from dflash_ray.train.workers import lr_at

    assert metrics[3]["lr"] == pytest.approx(lr_at(6, 16, 3e-3, 0.04, 1), rel=1e-9)
    assert metrics[2]["lr"] == pytest.approx(lr_at(4, 16, 3e-3, 0.04, 2), rel=1e-9)
    assert sorted(checkpoint.read_manifest(out, 13)["files"]) == [
        "drafter/config.json",
        "shards/.metadata",
        "shards/__0_0.distcp",
        "state.json",
    ]


def test_a_diverging_run_stops_at_the_step_naming_it_and_never_reports_success(
    ray_cluster, target, data, tmp_path, capsys
):
    """A rate and decay that send the weights to infinity (each update scales them by -1e13, within
    every bound): the first non-finite loss stops the run at that step (no restart: it would
    diverge the same way), named, exit 2, with a summary that is JSON."""
    import json

    from dflash_ray.cli import main

    def no_constants(name):
        raise AssertionError(f"--json printed {name}")

    out = str(tmp_path / "nan")
    # one colocated stream: any batch overflows at lr 10
    settings = SETTINGS + ["train.lr=10", "train.weight_decay=1e12", "train.warmup_ratio=0"]
    settings += ["train.num_streams=1", "train.colocate=true"]
    args = [
        "train",
        "--data",
        data,
        "--target",
        target,
        "--output",
        out,
        "--json",
        *[x for s in settings for x in ("--set", s)],
    ]
    assert main(args) == 2
    summary = json.loads(capsys.readouterr().out, parse_constant=no_constants)
    assert not summary["ok"] and "not finite" in summary["error"] and "train.lr" in summary["error"]
    assert "step 2:" in summary["error"], summary["error"]  # step 1's update made the weights infinite
    assert checkpoint.complete_steps(out) == []  # nothing non-finite was ever committed


def test_a_resume_on_data_rewritten_at_the_same_path_is_refused(target, tmp_path, monkeypatch):
    """Resume matches the data's content, not its path: new data under the old name (a pipeline rerun
    on a replaced input) would otherwise go on training, or export, the old run's drafter. The data's
    print is its manifest's, so the refusal comes before Ray is reached, let alone the target loaded.
    The checkpoint is the state a run writes (`test_train`'s undisturbed run checks that a real
    run's holds its data's print)."""
    from dflash_ray import cluster
    from dflash_ray.errors import DFlashError

    g = torch.Generator().manual_seed(5)
    folder = str(tmp_path / "data")
    _tokenized(folder, [torch.randint(0, 490, (12,), generator=g).repeat(4).tolist() for _ in range(16)])
    out = str(tmp_path / "run")
    cfg = load_config(None, SETTINGS)
    _checkpointed(out, cfg, folder, target)
    _tokenized(folder, [torch.randint(0, 490, (12,), generator=g).repeat(4).tolist() for _ in range(16)])

    def no_ray(*args, **kwargs):
        raise _RayStarted()

    monkeypatch.setattr(cluster, "connect", no_ray)
    with pytest.raises(DFlashError, match="the data's content"):
        run_train(target, folder, out, cfg, progress=False)
    assert checkpoint.complete_steps(out) == [3]


class _RayStarted(Exception):
    pass


def _checkpointed(out: str, cfg, data: str, target: str) -> None:
    """Step 3's checkpoint of a run of `cfg` on `data` as the driver reads it before Ray: the run
    state a run writes (its settings, data, target and the data's print), no weights."""
    import json

    state = {"config": cfg.to_dict(), "data": data, "target": target, "data_print": manifest.fingerprint(data)}
    checkpoint.save(out, 3, {"state.json": json.dumps({**state, "step": 3}).encode()})


def test_train_refuses_on_storage_alone_before_ray_starts(target, data, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Another live run training into the output, checkpoints without --resume, and a checkpoint of
    other settings are refused before Ray starts (no cluster, no target loaded), each naming what to
    do; a raised train.max_steps goes on, the log saying what it does to the learning rate."""
    import json

    from dflash_ray import cluster, writer
    from dflash_ray.cli import main

    def no_ray(*args, **kwargs):
        raise _RayStarted()

    monkeypatch.setattr(cluster, "connect", no_ray)
    out = tmp_path / "run"
    args = ["train", "--data", data, "--target", target, "--output", str(out), "--json"]
    args += [x for s in SETTINGS for x in ("--set", s)]

    held = writer.claim(str(out), "training")  # a live run (this process) trains into it
    try:
        assert main(args) == 2
        error = json.loads(capsys.readouterr().out)["error"]
        assert "another run is writing this output (a training run, pid" in error, error
    finally:
        held.release()

    _checkpointed(str(out), load_config(None, SETTINGS), data, target)
    assert main(args) == 2
    assert "holds checkpoints of an earlier run: pass --resume" in json.loads(capsys.readouterr().out)["error"]
    assert main(args + ["--resume", "--set", "train.lr=0.5"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "step-00000003 was made with other settings (train.lr differ)" in error, error
    assert not (out / writer.WRITER).exists()  # the claim went with the refusal

    longer = load_config(None, SETTINGS + ["train.max_steps=50"])
    with pytest.raises(_RayStarted):  # past every storage check
        run_train(target, data, str(out), longer, progress=False, resume=True)
    assert "train.max_steps unset -> 50: the run goes on from step 3" in capsys.readouterr().err


def test_a_full_disk_the_restarts_could_not_pass_is_named_and_its_temporaries_removed(tmp_path):
    from dflash_ray.errors import DFlashError, DiskFull
    from dflash_ray.stages.train import _disk_full

    out = tmp_path / "run"
    shards = out / "checkpoints" / "step-00000003" / "shards"
    shards.mkdir(parents=True)
    (shards / ".__0_0.distcp.tmp").write_bytes(b"x" * 100)  # half-copied, never listed
    gave_up = DFlashError(
        "a stream failed 4 times, over the budget of 3 restarts; last: OSError: [Errno 28] No space left on "
        f"device: '/tmp/dflash-shard-1/__0_0.distcp' -> '{shards}/.__0_0.distcp.tmp'",
        field="train.max_restarts",
    )
    full = _disk_full(gave_up, str(out), load_config(None, SETTINGS))
    assert isinstance(full, DiskFull) and str(full).startswith(f"{shards}/__0_0.distcp: no space left on the device")
    assert "1 temporary files of an unfinished checkpoint removed" in str(full) and not list(shards.iterdir())

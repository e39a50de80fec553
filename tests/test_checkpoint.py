import pytest

from dflash_ray import storage
from dflash_ray.train import checkpoint


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return storage.join(request.getfixturevalue("s3_bucket"), "run")


def test_newest_complete_checkpoint_is_loaded(output):
    checkpoint.save(output, 10, {"drafter/model.safetensors": b"a" * 100, "state.json": b"{}"}, {"epoch": 0})
    checkpoint.save(output, 20, {"drafter/model.safetensors": b"b" * 100, "state.json": b"{}"}, {"epoch": 1})
    step, files, meta = checkpoint.load_latest(output)
    assert step == 20 and files["drafter/model.safetensors"] == b"b" * 100 and meta == {"epoch": 1}


def test_missing_manifest_truncated_or_corrupt_files_are_never_used(output):
    checkpoint.save(output, 10, {"w.bin": b"good" * 10})
    # step 20: files written, manifest never written (killed mid-save)
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 20), "w.bin"), b"new" * 10)
    assert checkpoint.complete_steps(output) == [10]
    # step 30: complete, then its file truncated
    checkpoint.save(output, 30, {"w.bin": b"x" * 40})
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 30), "w.bin"), b"x" * 20)
    # step 40: complete, then corrupted at the same size
    checkpoint.save(output, 40, {"w.bin": b"y" * 40})
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 40), "w.bin"), b"z" * 40)
    step, files, _ = checkpoint.load_latest(output)
    assert step == 10 and files["w.bin"] == b"good" * 10
    with pytest.raises(ValueError, match="do not match"):
        checkpoint.load(output, 30)


def test_rotation_keeps_the_newest(output):
    for step in (1, 2, 3, 4):
        checkpoint.save(output, step, {"w.bin": bytes([step])})
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 0), "w.bin"), b"partial")
    assert checkpoint.rotate(output, keep=2) == [0, 1, 2]
    assert checkpoint.complete_steps(output) == [3, 4]
    assert [storage.basename(d) for d in storage.list_dirs(storage.join(output, "checkpoints"))] == [
        "step-00000003", "step-00000004"]

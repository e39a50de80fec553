import pytest

from dflash_ray import storage
from dflash_ray.train import checkpoint


def load_latest(output: str):
    """The newest checkpoint that verifies, read whole (broken ones skipped), or None."""
    for step in reversed(checkpoint.complete_steps(output)):
        try:
            return (step, *checkpoint.load(output, step))
        except checkpoint.CorruptCheckpoint:
            continue
    return None


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return storage.join(request.getfixturevalue("s3_bucket"), "run")


def test_newest_complete_checkpoint_is_loaded(output):
    checkpoint.save(output, 10, {"drafter/model.safetensors": b"a" * 100, "state.json": b"{}"}, {"epoch": 0})
    checkpoint.save(output, 20, {"drafter/model.safetensors": b"b" * 100, "state.json": b"{}"}, {"epoch": 1})
    step, files, meta = load_latest(output)
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
    step, files, _ = load_latest(output)
    assert step == 10 and files["w.bin"] == b"good" * 10
    with pytest.raises(ValueError, match=r"20 bytes, the manifest lists 40 \(truncated\)"):
        checkpoint.load(output, 30)


def test_rotation_keeps_the_newest(output):
    for step in (1, 2, 3, 4):
        checkpoint.save(output, step, {"w.bin": bytes([step])})
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 0), "w.bin"), b"partial")
    assert checkpoint.rotate(output, keep=2) == [0, 1, 2]
    assert checkpoint.complete_steps(output) == [3, 4]
    assert [storage.basename(d) for d in storage.list_dirs(storage.join(output, "checkpoints"))] == [
        "step-00000003",
        "step-00000004",
    ]


def _truncate(output, step, name, keep_bytes):
    uri = storage.join(checkpoint.step_dir(output, step), name)
    storage.write_bytes(uri, storage.read_bytes(uri)[:keep_bytes])


def test_rotation_keeps_the_newest_verified_never_a_newer_broken_one(output):
    files = {"drafter/model.safetensors": b"w" * 64, "state.json": b'{"step": 0}'}
    checkpoint.save(output, 50, files)
    checkpoint.save(output, 100, files)
    _truncate(output, 100, "drafter/model.safetensors", 10)  # a run died while step 100 was replaced
    # the run resumed from 50 and has just written step 70
    checkpoint.save(output, 70, {**files, "state.json": b'{"step": 70}'})
    assert checkpoint.rotate(output, keep=1) == [50]
    assert checkpoint.complete_steps(output) == [70, 100]  # the broken 100 is left as it is
    # what a resume picks: the newest checkpoint that verifies, whose state it reads alone
    with pytest.raises(checkpoint.CorruptCheckpoint, match="truncated"):
        checkpoint.verify(output, 100)
    manifest = checkpoint.verify(output, 70)
    assert checkpoint.read_file(output, 70, "state.json", manifest) == b'{"step": 70}'
    assert load_latest(output)[0] == 70


def test_rotation_never_deletes_the_newest_verified_one(output):
    checkpoint.save(output, 1, {"w.bin": b"a" * 8})
    checkpoint.save(output, 2, {"w.bin": b"b" * 8})
    _truncate(output, 2, "w.bin", 4)
    assert checkpoint.rotate(output, keep=1) == []  # 1 is the newest that verifies: it stays
    assert checkpoint.complete_steps(output) == [1, 2]
    storage.delete(storage.join(checkpoint.step_dir(output, 1), "w.bin"))
    assert checkpoint.rotate(output, keep=1) == []  # none verifies: nothing is deleted
    assert checkpoint.complete_steps(output) == [1, 2]


def test_rotation_upto_the_step_just_written_ignores_later_ones(output):
    for step in (10, 20, 30):
        checkpoint.save(output, step, {"w.bin": bytes([step]) * 8})
    # 30 is a later run's step, corrupt at the same size: it verifies by size, so only `upto` spares 20
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 30), "w.bin"), b"z" * 8)
    assert checkpoint.rotate(output, keep=1, upto=20) == [10]
    assert checkpoint.complete_steps(output) == [20, 30]


def test_verify_reads_sizes_and_read_file_the_checksum(output):
    checkpoint.save(output, 5, {"a.bin": b"a" * 32, "b.bin": b"b" * 32})
    storage.write_bytes(storage.join(checkpoint.step_dir(output, 5), "a.bin"), b"x" * 32)  # same size
    assert set(checkpoint.verify(output, 5)["files"]) == {"a.bin", "b.bin"}
    with pytest.raises(checkpoint.CorruptCheckpoint, match="a.bin.*checksum"):
        checkpoint.read_file(output, 5, "a.bin")
    assert checkpoint.read_file(output, 5, "b.bin") == b"b" * 32
    with pytest.raises(checkpoint.CorruptCheckpoint, match="not listed"):
        checkpoint.read_file(output, 5, "c.bin")
    storage.delete(storage.join(checkpoint.step_dir(output, 5), "b.bin"))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="b.bin: listed in the manifest but missing"):
        checkpoint.verify(output, 5)
    storage.write_text(storage.join(checkpoint.step_dir(output, 5), checkpoint.MANIFEST), "{not json")
    with pytest.raises(checkpoint.CorruptCheckpoint, match="unreadable manifest"):
        checkpoint.verify(output, 5)
    with pytest.raises(checkpoint.CorruptCheckpoint, match="no manifest"):
        checkpoint.read_manifest(output, 6)


def test_rewriting_a_step_unmarks_it_until_committed(output):
    checkpoint.save(output, 3, {"w.bin": b"old"})
    checkpoint.begin(output, 3)  # an earlier run's manifest must not vouch for files being replaced
    checkpoint.write_file(output, 3, "w.bin", b"new!")
    assert checkpoint.complete_steps(output) == []
    checkpoint.commit(output, 3, {"w.bin": checkpoint.write_file(output, 3, "w.bin", b"new!")})
    assert checkpoint.load(output, 3)[0] == {"w.bin": b"new!"}


def test_a_background_upload_returns_at_once_and_the_checkpoint_exists_only_once_committed(output):
    """The storage is held shut (a gate in the writer) while the caller goes on: the checkpoint
    has no manifest, so nothing uses it; once the files are written their entries commit it. A
    failed write is raised to the caller, and that checkpoint is never committed."""
    import threading

    checkpoint.save(output, 4, {"w.bin": b"old"})
    gate, files = threading.Event(), {"drafter/model.safetensors": b"w" * 64, "optimizer.pt": b"o" * 32}

    def held(*args):
        assert gate.wait(30)
        return checkpoint.write_file(*args)

    checkpoint.begin(output, 8)
    upload = checkpoint.Upload(lambda: {name: held(output, 8, name, data) for name, data in files.items()})
    assert not upload.done()  # the caller is free while the storage is shut
    assert checkpoint.complete_steps(output) == [4] and load_latest(output)[0] == 4
    gate.set()
    entries = upload.result()
    assert upload.done() and set(entries) == set(files)
    checkpoint.commit(output, 8, entries)
    step, loaded, _ = load_latest(output)
    assert step == 8 and loaded == files

    def broken(output, step, name, data):
        raise OSError(f"storage refused {name}")

    failed = checkpoint.Upload(lambda: {name: broken(output, 12, name, data) for name, data in files.items()})
    with pytest.raises(OSError, match="storage refused"):
        failed.result()
    assert checkpoint.complete_steps(output) == [4, 8]


def test_a_manifest_listing_a_file_outside_its_checkpoint_is_never_used(output):
    import json

    checkpoint.save(output, 10, {"state.json": b"{}"})
    checkpoint.save(output, 20, {"state.json": b"{}"})
    uri = storage.join(checkpoint.step_dir(output, 20), checkpoint.MANIFEST)
    body = json.loads(storage.read_text(uri))
    body["files"]["../step-00000010/state.json"] = body["files"]["state.json"]  # a file that exists, same bytes
    storage.write_text(uri, json.dumps(body))
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"lists '../step-00000010/state.json', which climbs out"):
        checkpoint.verify(output, 20)
    assert load_latest(output)[0] == 10

"""One writer per output folder, of the output's own kind: a stage pointed at another kind of
dataset is refused and leaves it whole; a second live run into one folder is refused; a claim whose
run is gone is taken over; a run that lost its folder commits nothing. Local disk and S3 alike."""

import json
import os
import subprocess
import sys
import time

import pytest

from dflash_ray import manifest, storage, writer
from dflash_ray.config import load_config
from dflash_ray.errors import DFlashError
from dflash_ray.stages.prompts import run_prompts

NO_BUDGET = load_config(None, ["prompts.max_prompt_tokens=0"])


def _records(path, n=3):
    path.write_text("".join(json.dumps({"instruction": f"question {i}?", "output": "answer"}) + "\n" for i in range(n)))
    return str(path)


def test_prompts_into_a_tokenized_folder_is_refused_and_the_dataset_stays_whole(tmp_path):
    out = tmp_path / "tokenized"
    out.mkdir()
    (out / "tokenized-a.parquet").write_bytes(b"data")
    manifest.write_manifest(str(out), kind="tokenized", files=[{"name": "tokenized-a.parquet", "rows": 1}], summary={})
    before = (out / manifest.MANIFEST).read_text()
    with pytest.raises(DFlashError) as e:
        run_prompts([_records(tmp_path / "in.jsonl")], str(out), NO_BUDGET, progress=False)
    assert e.value.file == str(out) and "'tokenized' dataset" in str(e.value)
    assert (out / manifest.MANIFEST).read_text() == before and sorted(os.listdir(out)) == [
        manifest.MANIFEST,
        "tokenized-a.parquet",
    ]
    summary = run_prompts([_records(tmp_path / "in.jsonl")], str(tmp_path / "p"), NO_BUDGET, progress=False)
    again = run_prompts([_records(tmp_path / "in.jsonl")], str(tmp_path / "p"), NO_BUDGET, progress=False)
    assert summary["prompts"] == again["prompts"] == 3  # its own kind is replaced, the claim released
    assert not (tmp_path / "p" / writer.WRITER).exists()


def _claims(folder: str) -> None:
    first = writer.claim(folder, "prompts")
    with pytest.raises(DFlashError, match="another run is writing this output") as e:
        writer.claim(folder, "prompts")
    assert e.value.file == folder
    stolen = dict(
        json.loads(storage.read_text(storage.join(folder, writer.WRITER))),
        heartbeat=time.time() - 1e4,
        pid=1,
        host="another-host",
    )
    storage.write_text(storage.join(folder, writer.WRITER), json.dumps(stolen))  # silent past the timeout
    second = writer.claim(folder, "prompts")
    assert second.took_over["host"] == "another-host"
    with pytest.raises(DFlashError, match="another run took this output"):
        first.check()  # the run that lost its folder commits nothing
    first.release()  # and leaves the new owner's claim alone
    second.check()
    second.release()
    assert not storage.exists(storage.join(folder, writer.WRITER))


def test_a_second_live_writer_is_refused_and_a_silent_one_taken_over(tmp_path):
    _claims(str(tmp_path / "out"))


def test_a_claim_on_s3_works_the_same(s3_bucket):
    _claims(f"{s3_bucket}/out")


@pytest.mark.integration
def test_the_claim_of_a_process_that_died_on_this_host_is_taken_over_at_once(tmp_path):
    folder = str(tmp_path / "out")
    code = f"from dflash_ray import writer; writer.claim({folder!r}, 'prompts'); import os; os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True)  # a crash: the claim is left behind
    held = json.loads(storage.read_text(storage.join(folder, writer.WRITER)))
    assert time.time() - held["heartbeat"] < writer.TIMEOUT_S  # fresh, but its process is gone
    with writer.claim(folder, "prompts") as c:
        assert c.took_over["pid"] == held["pid"]

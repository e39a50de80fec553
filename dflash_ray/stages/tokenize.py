"""`dflash-ray tokenize`: completion shards → tokenized Parquet shards, with Ray Data.

The driver lists the work units (one per Parquet row group of the input) and Ray Data runs them
through a pool of actors, one per CPU and at most one per `ROWS_A_WORKER` rows, each loading the
tokenizer once. An actor reads its unit, tokenizes it, writes one output file atomically under a
name fixed by the unit (a retried unit rewrites the same file) and returns only a small summary
row: rows, tokens, rejects. The tokens never travel through the object store, and no write task
competes with the actors for CPUs.
The `_manifest.json`, written last from those rows, lists exactly this run's files, so a crashed
run's leftovers are never read, and a rerun replaces an earlier dataset only once it is complete.
A bad row never stops the run: rejected rows (malformed JSON, missing or ill-typed fields, over-long
under `drop`, template errors) go to `rejected.jsonl` with their file, line (row, for Parquet) and
reason; a file or row group that cannot be read is one entry standing for its rows. A sample whose
tokens and mask an earlier one has (copies of shards or records) is kept once: the driver finds the
copies from each unit's digests and writes their files again without them (`duplicate` rejects).
Every row in is written or rejected (`rows_in` = `rows_out` + `rejected`); a run that writes no
sample is an error.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import json
import uuid
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray import manifest, storage, writer
from dflash_ray.arrow_files import checked, open_parquet, read_parquet
from dflash_ray.cluster import connect
from dflash_ray.config import RunConfig, TokenizeConfig
from dflash_ray.data import schema
from dflash_ray.data.masking import TokenizeBatch
from dflash_ray.data.records import json_lines
from dflash_ray.data.tokenized import first_copies, sample_digest
from dflash_ray.errors import DFlashError
from dflash_ray.stages import PipelineRun, Stage

REJECTED = manifest.REJECTED


def _list_column(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def to_table(columns: dict[str, list]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array(columns["id"], pa.string()),
            pa.array(columns["source"], pa.string()),
            _list_column(columns["input_ids"], pa.int32()),
            _list_column(columns["loss_mask"], pa.int8()),
            pa.array(columns["seq_len"], pa.int32()),
            pa.array(columns["truncated"], pa.bool_()),
        ],
        schema=schema.TOKENIZED,
    )


class _TokenizeUnit:
    """Ray Data actor over `TokenizeBatch`: one input row = one work unit = one output file."""

    def __init__(self, cfg: TokenizeConfig, output: str, prefix: str):
        self.tokenize = TokenizeBatch(cfg)
        self.batch_size = cfg.batch_size
        self.output, self.prefix = output, prefix

    def __call__(self, unit: dict[str, Any]) -> dict[str, Any]:
        tables, rejects, cut, digests = [], [], 0, []
        for rows, where, unreadable in _unit_rows(unit, self.batch_size):
            rejects += unreadable
            columns, batch_rejects = self.tokenize(rows, where)
            tables.append(to_table(columns))
            cut += sum(columns["cut"])
            rejects += batch_rejects
            digests += [sample_digest(i, m) for i, m in zip(columns["input_ids"], columns["loss_mask"])]
        table = pa.concat_tables(tables) if tables else schema.TOKENIZED.empty_table()
        name = f"{self.prefix}-{int(unit['index']):06d}.parquet"
        sink = io.BytesIO()
        pq.write_table(table, sink)
        data = sink.getvalue()
        storage.write_bytes(storage.join(self.output, name), data)
        seq_len = table["seq_len"].to_numpy()
        return {
            "name": name,
            "rows": table.num_rows,
            **manifest.file_entry(data),
            "tokens": int(seq_len.sum()),
            "tokens_cut": cut,
            "truncated": int(table["truncated"].to_numpy(zero_copy_only=False).sum()),
            "rejects": json.dumps(rejects),
            "digests": b"".join(digests),  # the samples' contents, for the driver's dedup across files
        }


def _drop_duplicates(results: list[dict[str, Any]], output: str) -> list[dict[str, Any]]:
    """Keep the first of samples with the same content, across every file (a completions folder
    holding copies of its shards, the same record in two inputs): the copies' files are written
    again without them (removed when nothing is left), `results` updated; returns the reject
    entries of the dropped, each naming the sample it copies."""
    digests = [np.frombuffer(r["digests"], dtype=np.uint64).reshape(-1, 2) for r in results]
    first = first_copies(np.concatenate(digests) if digests else np.zeros((0, 2), dtype=np.uint64))
    starts = np.concatenate([[0], np.cumsum([len(d) for d in digests])]).astype(np.int64)
    if not len(first) or (first == np.arange(len(first))).all():
        return []
    names = [r["name"] for r in results]
    ids: dict[int, str] = {}  # ids of the kept samples that are copied, read back from their files

    def file_of(k: int) -> int:
        return int(np.searchsorted(starts, k, "right")) - 1

    copied = sorted({int(k) for k in first[first != np.arange(len(first))]})
    for f in sorted({file_of(k) for k in copied}):
        column = read_ids(storage.join(output, names[f]))
        ids.update({k: column[k - starts[f]] for k in copied if file_of(k) == f})
    rejects, gone = [], set()
    for f, result in enumerate(results):
        mine = first[starts[f] : starts[f + 1]]
        drop = np.flatnonzero(mine != np.arange(starts[f], starts[f + 1]))
        if not drop.size:
            continue
        uri = storage.join(output, result["name"])
        table = read_parquet(io.BytesIO(storage.read_bytes(uri)), uri)
        keep = np.ones(table.num_rows, dtype=bool)
        keep[drop] = False
        for k in drop:
            kept = int(mine[k])
            rejects.append(
                {
                    "id": table["id"][int(k)].as_py(),
                    "file": uri,
                    "row": int(k) + 1,
                    "kind": "duplicate",
                    "reason": f"the same tokens and loss mask as sample {ids[kept]} "
                    f"({names[file_of(kept)]} row {kept - starts[file_of(kept)] + 1}): dropped, kept once",
                }
            )
        table = table.filter(pa.array(keep))
        result["rows"] = table.num_rows
        result["tokens"] = int(table["seq_len"].to_numpy().sum())
        result["truncated"] = int(table["truncated"].to_numpy(zero_copy_only=False).sum())
        if table.num_rows == 0:  # every sample a copy: the file goes
            storage.delete(uri)
            gone.add(result["name"])
            continue
        sink = io.BytesIO()
        pq.write_table(table, sink)
        storage.write_bytes(uri, sink.getvalue())
        result.update(manifest.file_entry(sink.getvalue()))
    results[:] = [r for r in results if r["name"] not in gone]
    return rejects


def read_ids(uri: str) -> list[str]:
    return read_parquet(io.BytesIO(storage.read_bytes(uri)), uri, columns=["id"])["id"].to_pylist()


def _unreadable(uri: str, reason: str, rows: int, **where: Any) -> dict[str, Any]:
    """The reject entry of a file (or row group) that cannot be read; it stands for `rows` rows."""
    return {"id": None, "file": uri, **where, "rows": rows, "kind": "corrupt_file", "reason": reason}


def _unit_rows(unit: dict[str, Any], batch_size: int) -> Iterator[tuple[list, list[dict], list[dict]]]:
    """A unit's rows in batches: (rows, where each row is, rejects of rows that cannot be read)."""
    uri = unit["uri"]
    if uri.endswith(".jsonl"):
        rows, where, bad = [], [], []
        for item in json_lines(uri, storage.read_bytes(uri)):
            if item.error is not None:
                bad.append({"id": None, **item.where(), "kind": item.error.kind, "reason": str(item.error)})
            else:
                rows.append(item.record)
                where.append(item.where())
            if len(rows) >= batch_size:
                yield rows, where, bad
                rows, where, bad = [], [], []
        yield rows, where, bad
        return
    fs, path = storage.arrow_filesystem(uri)
    group, first = int(unit["row_group"]), int(unit["first_row"])
    try:
        with fs.open_input_file(path) as f:
            table = open_parquet(f, uri).read_row_group(group)
    except (pa.ArrowException, OSError) as e:
        yield [], [], [_unreadable(uri, f"row group {group} unreadable: {e}", int(unit["rows"]), row_group=group)]
        return
    for batch in table.to_batches(max_chunksize=batch_size):
        yield batch.to_pylist(), [{"file": uri, "line": first + k + 1} for k in range(batch.num_rows)], []
        first += batch.num_rows


def work_units(
    files: list[str], listed: dict[str, int] | None = None
) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
    """One unit per Parquet row group (per JSONL file), the number of input rows, and the rejects
    of files that cannot be read: each counts as the rows its manifest lists (`listed`), or one row
    when no manifest says.

    The driver hands Ray Data this explicit list rather than using a Ray Data reader: the reader's
    file-listing task would wait for a CPU that the tokenizer actors hold.
    """
    units: list[dict[str, Any]] = []
    rows = 0
    unreadable: list[dict[str, Any]] = []
    for uri in files:
        if uri.endswith(".jsonl"):
            count = sum(1 for _ in json_lines(uri, storage.read_bytes(uri)))
            units.append({"index": len(units), "uri": uri, "row_group": 0, "first_row": 0, "rows": count})
            rows += count
        elif uri.endswith(".parquet"):
            fs, path = storage.arrow_filesystem(uri)
            try:
                with fs.open_input_file(path) as f:
                    parquet = pq.ParquetFile(f)
                    checked(parquet.schema_arrow, uri)  # before any row, in any worker
                    meta = parquet.metadata
            except (pa.ArrowException, OSError) as e:
                lost = (listed or {}).get(uri, 1)
                unreadable.append(
                    _unreadable(
                        uri,
                        f"not a readable Parquet file ({lost} rows lost"
                        f"{'' if uri in (listed or {}) else ', count unknown'}): {e}",
                        lost,
                    )
                )
                rows += lost
                continue
            first = 0
            for g in range(meta.num_row_groups):
                count = meta.row_group(g).num_rows
                units.append({"index": len(units), "uri": uri, "row_group": g, "first_row": first, "rows": count})
                first += count
            rows += meta.num_rows
        else:
            raise DFlashError("completions must be .parquet or .jsonl files", file=uri)
    return units, rows, unreadable


def _load_tokenizer(name: str) -> Any:
    """`tokenize.tokenizer`, loaded once here: one that does not load, or has no chat template to
    render the conversations with, is refused before any worker starts (each would fail alike, or
    reject every row as a template error)."""
    from dflash_ray.registry import load_tokenizer

    try:
        tokenizer = load_tokenizer(name)
    except DFlashError as e:
        raise DFlashError(
            f"{e.message} (the tokenizer to tokenize with: --tokenizer)",
            file=e.file,
            record=e.record,
            field=e.field or "tokenize.tokenizer",
        ) from None
    if not tokenizer.chat_template:
        raise DFlashError(
            "a tokenizer with no chat template: the conversations cannot be rendered; give the chat model's "
            "own tokenizer (--tokenizer)",
            file=name,
            field="tokenize.tokenizer",
        )
    return tokenizer


def _check_tokenizer(tokenizer: Any, name: str, model: str, input_uri: str) -> None:
    """Refuse `tokenize.tokenizer` when it is not the tokenizer of the model that generated the
    completions: their answers' token ids are replayed as the engine made them, and would be read
    (validated, decoded, trained on) in another vocabulary."""
    from dflash_ray.registry import load_tokenizer

    try:
        theirs = load_tokenizer(model)
    except (DFlashError, OSError, ValueError):  # the model is not at hand here: each record's own check runs
        return
    if tokenizer.get_vocab() != theirs.get_vocab():
        raise DFlashError(
            f"the completions were generated by {model}, whose tokenizer is not {name!r}: their "
            f"token ids would be read in another vocabulary; set tokenize.tokenizer={model}",
            file=input_uri,
            field="tokenize.tokenizer",
        )


# an actor's start (imports, the tokenizer's load) is ~5 s of a core, the time one core takes to
# tokenize ~1,000 rows of the seed's size (2,323 tokens at 388k tokens/s; bench/RESULTS.md): a
# smaller share of the rows than that costs more to start than it saves
ROWS_A_WORKER = 1000


def pool_size(units: list[dict[str, Any]], concurrency: int | None, cpus: int) -> int:
    """The tokenizer actors to start: `tokenize.concurrency`, or one per CPU and per
    `ROWS_A_WORKER` rows; never more than the units."""
    if concurrency is None:
        rows = sum(u["rows"] for u in units)
        concurrency = min(max(1, cpus), max(1, -(-rows // ROWS_A_WORKER)))
    return max(1, min(len(units), concurrency))


def run_tokenize(input_uri: str, output: str, cfg: RunConfig, *, replace: bool = False) -> dict[str, Any]:
    """`replace`: make the output anew when it holds a dataset made from another input or settings."""
    if storage.overlaps(input_uri, output):  # a commit replaces the output's shards: never among the input's
        raise DFlashError(
            f"the output {output} and the input {input_uri} overlap (one is, or is inside, the other): writing "
            "there could replace the input's files; give an output folder of its own",
            file=output,
        )
    storage.require_folder(output)
    tokenizer = _load_tokenizer(cfg.tokenize.tokenizer)
    made_from = {"input": input_uri, **{f"tokenize.{k}": v for k, v in dataclasses.asdict(cfg.tokenize).items()}}
    with writer.claim(output, "tokenized", made_from=made_from, replace=replace) as held:
        return _tokenize(input_uri, output, cfg, held, tokenizer)


def _tokenize(input_uri: str, output: str, cfg: RunConfig, held: writer.Claim, tokenizer: Any) -> dict[str, Any]:
    import ray
    import ray.data

    tcfg = cfg.tokenize
    kind = str((manifest.read_manifest(input_uri) or {}).get("kind", ""))
    if kind.startswith("prompts") or kind == "tokenized":  # a dataset of this project's, of another stage
        raise DFlashError(
            "holds prompts, not completions: generate them first with `dflash-ray generate --prompts URI --output DIR`"
            if kind != "tokenized"
            else "holds tokenized samples already: validate or train on it as it is",
            file=input_uri,
        )
    generated_by = ((manifest.read_manifest(input_uri) or {}).get("summary") or {}).get("model")
    if generated_by:  # completions of `generate`: their answers are the engine's own token ids
        _check_tokenizer(tokenizer, tcfg.tokenizer, generated_by, input_uri)
    files = manifest.dataset_files(input_uri, (".parquet", ".jsonl"))
    units, num_rows_in, rejects = work_units(files, manifest.listed_rows(input_uri))
    connect(cfg.ray)

    prefix = f"tokenized-{uuid.uuid4().hex[:12]}"  # this run's files: an earlier run's stay whole until commit
    results, workers = [], 0
    if units:
        workers = pool_size(units, tcfg.concurrency, int(ray.cluster_resources().get("CPU", 1)))
        # Ray's stub of `map` admits functions only; callable classes are documented and supported
        ds = ray.data.from_items(units, override_num_blocks=len(units)).map(
            _TokenizeUnit,  # type: ignore[arg-type]
            fn_constructor_kwargs={"cfg": tcfg, "output": output, "prefix": prefix},
            num_cpus=1,
            compute=ray.data.ActorPoolStrategy(size=workers),
        )
        results = sorted(ds.take_all(), key=lambda r: r["name"])

    rejects += [r for res in results for r in json.loads(res["rejects"])]
    read = {key: sum(int(r[key]) for r in results) for key in ("tokens", "tokens_cut")}
    duplicates = _drop_duplicates(results, output)
    rejects += duplicates
    entries = [
        {"name": r["name"], "rows": int(r["rows"]), "bytes": int(r["bytes"]), "sha256": r["sha256"]} for r in results
    ]
    num_rows_out = sum(e["rows"] for e in entries)
    num_rejected = sum(int(r.get("rows", 1)) for r in rejects)
    kinds: collections.Counter[str] = collections.Counter()
    for r in rejects:
        kinds[r["kind"]] += int(r.get("rows", 1))
    summary = {
        "stage": "tokenize",
        "output": output,
        "tokenizer": tcfg.tokenizer,
        "rows_in": num_rows_in,
        "rows_out": num_rows_out,
        "workers": workers,  # tokenizer actors started
        "rejected": num_rejected,
        "rejected_kinds": dict(kinds),
        "rejected_file": storage.join(output, REJECTED),
        "truncated": sum(int(r["truncated"]) for r in results),
        "tokens": sum(int(r["tokens"]) for r in results),
        "files": len(entries),
        # samples whose tokens and mask an earlier one has (copies of files or records): kept once
        "duplicates": len(duplicates),
    }
    # what truncation threw away of what was generated: the cost of a generation length the training
    # length does not keep (config.check_lengths); of every sample read, copies included
    summary["tokens_cut"] = read["tokens_cut"]
    summary["share_kept"] = round(read["tokens"] / max(1, read["tokens"] + read["tokens_cut"]), 4)
    if num_rows_in != num_rows_out + num_rejected:
        raise DFlashError(
            f"{num_rows_in} rows in, {num_rows_out} written and {num_rejected} rejected: rows were lost", file=input_uri
        )
    report = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects)
    if num_rows_out == 0:
        for entry in entries:  # this run's empty files
            storage.delete(storage.join(output, entry["name"]))
        summary["rejected_file"] = manifest.report_uri(output, REJECTED)
        storage.write_text(summary["rejected_file"], report)
        kinds_text = ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) or "none"
        raise DFlashError(
            f"no samples out of {num_rows_in} rows ({num_rejected} rejected, by kind "
            f"{kinds_text}); the reasons are in {summary['rejected_file']}",
            file=input_uri,
        ).with_summary(summary)
    held.check()
    storage.write_text(storage.join(output, REJECTED), report)
    manifest.commit(
        output,
        kind="tokenized",
        files=entries,
        summary=summary,
        config=cfg.to_dict(),
        prefix="tokenized-",
        made_from=held.made_from,
    )
    return summary


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    if args.tokenizer:
        cfg = dataclasses.replace(cfg, tokenize=dataclasses.replace(cfg.tokenize, tokenizer=args.tokenizer))
    return run_tokenize(args.input, args.output, cfg, replace=args.replace)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, metavar="URI")
    p.add_argument("--output", required=True, metavar="URI")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="short name (qwen3, smollm2-135m-instruct) or path")
    p.add_argument(
        "--replace", action="store_true", help="make the output anew when it holds one from another input or settings"
    )


def _step(run: PipelineRun) -> dict[str, Any]:
    tokenized = run.timed("tokenize", run_tokenize, run.at("completions"), run.at("tokenized"), run.cfg)
    return {
        "samples": tokenized["rows_out"],
        "tokens": tokenized["tokens"],
        "tokens_cut": tokenized["tokens_cut"],
        "share_kept": tokenized["share_kept"],
    }


STAGES = (
    Stage(
        name="tokenize",
        help="completions → input_ids + loss_mask (Ray Data)",
        command=_command,
        arguments=_arguments,
        section="tokenize",
        order=30,
        inputs=("completions",),
        outputs=("tokenized",),
        step=_step,
    ),
)

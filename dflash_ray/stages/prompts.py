"""`dflash-ray prompts`: raw chat datasets → normalized, deduplicated prompt shards.

Output folder: `prompts-RUN-NNNNN.parquet` (schema `PROMPTS`), `quarantine.jsonl` (one line per
bad record: file, line (and item, for an element of a JSON array), kind, reason, raw record) and
`_manifest.json`, written last. One bad record never stops the run, nor does a file that cannot be
read (one quarantine entry): every record read ends up either in a shard, in quarantine, or counted
as a duplicate (`records` = `records_ok` + `quarantined`). A run that yields no prompt is an error.
A rerun replaces an earlier run's output only when it is complete (see `manifest.commit`).

Inputs are files, folders and Hugging Face dataset splits (`hf://datasets/ORG/NAME:SPLIT`, see
`hub`); `prompts.sources` mixes them with counts or weights (see `mix`). The summary has a
`sources` entry per source with the same figures (and its requested count, weight and, for a
dataset, the commit read); a source that runs short of its count is a warning (`warnings`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import io
import json
import uuid
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray import manifest, storage, writer
from dflash_ray.config import RunConfig
from dflash_ray.data import mix, schema
from dflash_ray.data.formats import Answered, BadRecord, Prompt, normalize, normalize_answered, template_opens_thinking
from dflash_ray.data.masking import conversation_fields, refuse_special_tokens
from dflash_ray.data.records import RawRecord, raw_preview
from dflash_ray.errors import DFlashError
from dflash_ray.stages import PipelineRun, Stage

QUARANTINE = manifest.QUARANTINE


class PromptBudget:
    """Counts a prompt's tokens as the target will see them: chat template, tools, generation header."""

    def __init__(self, tokenizer_name: str, max_tokens: int):
        from dflash_ray.registry import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_name)
        self.max_tokens = max_tokens

    def check(self, prompt: Prompt) -> None:
        tools = json.loads(prompt.tools) if prompt.tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                prompt.messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja errors carry no common base class
            raise BadRecord(f"chat template error: {e}", "template_error") from None
        count = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if count > self.max_tokens:
            raise BadRecord(f"prompt has {count} tokens, over the budget of {self.max_tokens}", "over_budget")


def shard_bytes(rows: list[dict[str, Any]], table_schema: pa.Schema = schema.PROMPTS) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=table_schema), sink)
    return sink.getvalue()


def run_prompts(
    inputs: list[str],
    output: str,
    cfg: RunConfig,
    *,
    progress: bool = True,
    responses: bool = False,
    replace: bool = False,
) -> dict[str, Any]:
    """Prompt shards for generation; with `responses`, completion shards of the records' own last
    assistant answers instead (existing responses: tokenize reads them as it reads generated ones).
    The sources are `inputs` (all of each) and the mix of `prompts.sources` (see `mix`)."""
    from dflash_ray.data import hub

    for uri in inputs:  # a commit replaces the output's shards: never where the user's own files are read
        if not hub.is_hub_dataset(uri) and storage.overlaps(uri, output):
            raise DFlashError(
                f"the output {output} and the input {uri} overlap (one is, or is inside, the other): "
                "writing there could replace the input's files; give an output folder of its own",
                file=output,
            )
    for uri in inputs:  # a missing input is the error to give, before any about the output
        if not hub.is_hub_dataset(uri) and not storage.is_s3(uri) and not storage.local_path(uri).exists():
            raise DFlashError("no such file or folder", file=uri)
    storage.require_folder(output)
    made_from = {"inputs": list(inputs), **{f"prompts.{k}": v for k, v in dataclasses.asdict(cfg.prompts).items()}}
    kind = "completions" if responses else "prompts"
    with writer.claim(output, kind, made_from=made_from, replace=replace) as held:
        return _prompts(inputs, output, cfg, progress, responses, held)


class _Output:
    """What the run keeps as it reads: the deduplicated rows, cut into shards as they fill, and one
    quarantine line per bad record, so that every record read is accounted for."""

    def __init__(self, output: str, stage: str, responses: bool, shard_size: int):
        self.output = output
        self.prefix = f"{stage}-{uuid.uuid4().hex[:8]}"  # this run's shards: an earlier run's stay whole until commit
        self.table_schema = schema.COMPLETIONS if responses else schema.PROMPTS
        self.shard_size = shard_size
        self.seen: set[str] = set()
        self.rows: list[dict[str, Any]] = []
        self.shards: list[dict[str, Any]] = []
        self.quarantine: list[str] = []
        self.kinds: collections.Counter[str] = collections.Counter()
        self.thinking = 0  # answers with a thinking block
        self.mode = 0o666  # no wider than the inputs' (`storage.narrowest_mode`)

    def flush(self) -> None:
        name = f"{self.prefix}-{len(self.shards):05d}.parquet"
        data = shard_bytes(self.rows, self.table_schema)
        storage.write_bytes(storage.join(self.output, name), data, self.mode)
        self.shards.append({"name": name, "rows": len(self.rows), **manifest.file_entry(data)})
        self.rows.clear()

    def quarantined(self, item: RawRecord, error: BadRecord, tally: collections.Counter[str]) -> None:
        self.kinds[error.kind] += 1
        tally["quarantined"] += 1
        self.quarantine.append(
            json.dumps(
                {**item.where(), "kind": error.kind, "reason": str(error), "record": raw_preview(item)},
                ensure_ascii=False,
            )
        )

    def keep(self, made: Sequence[Prompt | Answered], name: str, count: int | None, tally: collections.Counter[str]):
        """A good record's prompts, less those seen before and those past its source's `count`."""
        for one in made:
            if _prompt(one).id in self.seen:
                tally["duplicates"] += 1
                continue
            if tally["prompts"] == count:  # a record's later turns past the count
                tally["over_count"] += 1
                continue
            self.seen.add(_prompt(one).id)
            tally["prompts"] += 1
            self.thinking += getattr(one, "reasoning", None) is not None
            self.rows.append(one.row(name))
            if len(self.rows) >= self.shard_size:
                self.flush()


def _made(
    item: RawRecord,
    responses: bool,
    multi_turn: Any,
    budget: PromptBudget | None,
    opened: bool = False,
    tokenizer: Any = None,
) -> Sequence[Prompt | Answered]:
    """What one record makes, each within the budget, its text free of `tokenizer`'s special tokens.
    `BadRecord` quarantines the record, a read error of its own included, so that every bad record
    takes the same path."""
    if item.error is not None:
        raise item.error
    made: Sequence[Prompt | Answered] = (
        [normalize_answered(item.record, opened)] if responses else normalize(item.record, multi_turn)
    )
    for one in made:
        if tokenizer is not None:
            refuse_special_tokens(tokenizer, _text_fields(one))
        if budget is not None:
            budget.check(_prompt(one))
    return made


def _text_fields(made: Prompt | Answered) -> list[tuple[str, Any]]:
    """The text of a prompt, or of an answer and its context, named by field."""
    prompt = _prompt(made)
    fields = conversation_fields(prompt.messages, prompt.tools)
    if isinstance(made, Answered):
        fields += [("text", made.text), ("reasoning", made.reasoning), ("tool_calls", made.tool_calls)]
    return fields


def _read_source(
    source: Any, out: _Output, pcfg: Any, responses: bool, budget, bar, opened: bool = False, tokenizer: Any = None
) -> collections.Counter[str]:
    """One source's records until it has given its count (read no further); the tally keeps
    records = records_ok + quarantined, as the whole run does."""
    tally: collections.Counter[str] = collections.Counter()
    for item in source.records(pcfg.seed, pcfg.shuffle_buffer):
        tally["records"] += 1
        bar.update(1)
        try:
            made = _made(item, responses, pcfg.multi_turn, budget, opened, tokenizer)
        except BadRecord as error:
            out.quarantined(item, error, tally)
            continue
        tally["records_ok"] += 1
        out.keep(made, source.name_of(item), source.count, tally)
        if tally["prompts"] == source.count:
            break
    return tally


def _source_entry(source: Any, tally: collections.Counter[str], warnings: list[str], stage: str) -> dict[str, Any]:
    """The source's figures for the summary; one that ran short of its count is warned of, not hidden."""
    import sys

    entry = {
        **source.entry(),
        **{k: tally[k] for k in ("records", "records_ok", "quarantined", "duplicates", "prompts")},
    }
    if tally["over_count"]:
        entry["over_count"] = tally["over_count"]
    if source.count is not None and tally["prompts"] < source.count:
        warnings.append(
            f"{entry['uri']} gave {tally['prompts']} of the {source.count} prompts "
            "asked of it: it has no more that pass quarantine and dedup"
        )
        print(f"dflash-ray {stage}: warning: {warnings[-1]}", file=sys.stderr)
    return entry


def _skipped_files(sources: list, warnings: list[str], stage: str) -> list[str]:
    """Files of the input folders not read: never without a word (`_b.jsonl`, `notes.txt` and the like
    are named)."""
    import sys

    skipped = [f for s in sources for f in s.skipped()]
    if skipped:
        warnings.append(
            f"{len(skipped)} file(s) in the input folders were not read (not .jsonl/.json/.parquet, "
            f"named with a leading . or _, or links that lead out of the folder): {', '.join(skipped[:10])}"
        )
        print(f"dflash-ray {stage}: warning: {warnings[-1]}", file=sys.stderr)
    return skipped


def _nothing_kept(summary: dict[str, Any], out: _Output, report: str, sources: list, responses: bool) -> DFlashError:
    """A run that kept no prompt: its quarantine is still written, where the error points to it."""
    summary["quarantine_file"] = manifest.report_uri(out.output, QUARANTINE)
    storage.write_text(summary["quarantine_file"], report, out.mode)
    kinds_text = ", ".join(f"{k}: {v}" for k, v in sorted(out.kinds.items())) or "none"
    return DFlashError(
        f"no {'answers' if responses else 'prompts'} out of {summary['records']} records in "
        f"{summary['input_files']} files or datasets "
        f"({len(out.quarantine)} quarantined, by kind {kinds_text}); the reasons are in "
        f"{summary['quarantine_file']}",
        file=", ".join(s.uri for s in sources),
    ).with_summary(summary)


def _prompts(
    inputs: list[str], output: str, cfg: RunConfig, progress: bool, responses: bool, held: writer.Claim
) -> dict[str, Any]:
    from tqdm import tqdm

    from dflash_ray.registry import load_tokenizer

    pcfg = cfg.prompts
    stage = "responses" if responses else "prompts"
    sources = mix.plan(inputs, pcfg)
    if not sources:
        raise DFlashError("no input: give input URIs or a mix in prompts.sources", field="prompts.sources")
    for source in sources:
        source.open()
    budget = PromptBudget(pcfg.tokenizer, pcfg.max_prompt_tokens) if pcfg.max_prompt_tokens > 0 else None
    # the target's tokenizer, where the run has it at hand: text holding its special tokens is quarantined
    tokenizer = budget.tokenizer if budget is not None else load_tokenizer(pcfg.tokenizer) if responses else None
    opened = responses and template_opens_thinking(tokenizer)  # answers only close the block
    out = _Output(output, stage, responses, pcfg.shard_size)
    out.mode = storage.narrowest_mode([f for source in sources for f in source.files])
    counts: collections.Counter[str] = collections.Counter()
    per_source: list[dict[str, Any]] = []
    warnings: list[str] = []
    bar = tqdm(desc=stage, unit=" records", disable=not progress)
    for source in sources:
        tally = _read_source(source, out, pcfg, responses, budget, bar, opened, tokenizer)
        counts.update(tally)
        per_source.append(_source_entry(source, tally, warnings, stage))
    bar.close()
    summary: dict[str, Any] = {
        "stage": stage,
        "output": output,
        "input_files": sum(len(s.files) if s.dataset is None else 1 for s in sources),
        "skipped_files": _skipped_files(sources, warnings, stage),
        # every record read is quarantined or makes prompts: records = records_ok + quarantined
        "records": counts["records"],
        "records_ok": counts["records_ok"],
        "prompts": len(out.seen),
        "duplicates": counts["duplicates"],
        "quarantined": len(out.quarantine),
        "quarantine_kinds": dict(sorted(out.kinds.items())),
        "quarantine_file": storage.join(output, QUARANTINE),
        "shards": len(out.shards) + bool(out.rows),
        "sources": per_source,
        "warnings": warnings,
    }
    report = "".join(line + "\n" for line in out.quarantine)
    if not out.seen:
        raise _nothing_kept(summary, out, report, sources, responses)
    if responses:
        checks = _response_checks(len(out.seen), out.thinking, pcfg.tokenizer)
        summary.update({**checks, "warnings": warnings + checks["warnings"]})
    if out.rows:
        out.flush()
    held.check()
    storage.write_text(storage.join(output, QUARANTINE), report, out.mode)
    manifest.commit(
        output,
        kind="completions" if responses else "prompts",
        files=out.shards,
        summary=summary,
        config=cfg.to_dict(),
        prefix=f"{stage}-",
        made_from=held.made_from,
    )
    return summary


def _prompt(made: Prompt | Answered) -> Prompt:
    """The prompt a record made, or the context of its answer: what is budgeted and deduplicated."""
    return made.prompt if isinstance(made, Answered) else made


def _response_checks(answers: int, thinking: int, tokenizer: str) -> dict[str, Any]:
    """Existing responses that look unlike the target's own: a thinking target's chat template and
    answers that mostly have no thinking block. A warning, not an error; the gate still guards
    the tokenized data."""
    import sys

    from dflash_ray.registry import load_tokenizer

    template = load_tokenizer(tokenizer).chat_template or ""
    thinking_target = "<think>" in template or "enable_thinking" in template
    share = thinking / answers if answers else 0.0
    warnings = []
    if thinking_target and share < 0.5:
        warnings.append(
            f"{tokenizer}'s chat template is a thinking model's, but only {share:.0%} of the answers "
            "have a thinking block: responses not written by the target teach the drafter "
            "another model's text; regenerating them (`dflash-ray generate`) is safer"
        )
        print(f"dflash-ray responses: warning: {warnings[-1]}", file=sys.stderr)
    return {"thinking_share": round(share, 4), "thinking_target": thinking_target, "warnings": warnings}


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    return run_prompts(
        args.input or [],
        args.output,
        cfg,
        progress=not args.json,
        responses=args.command == "responses",
        replace=args.replace,
    )


def _arguments(output_help: str):
    def add(p: argparse.ArgumentParser) -> None:
        from dflash_ray.stages import INPUTS_HELP

        p.add_argument("--input", nargs="+", action="extend", metavar="URI", help=INPUTS_HELP)
        p.add_argument("--output", required=True, metavar="URI", help=output_help)
        p.add_argument(
            "--replace",
            action="store_true",
            help="make the output anew when it holds one from other inputs or settings",
        )

    return add


def split_prompts(
    prompts: str, train_out: str, eval_out: str, eval_count: int, seed: int, answered: bool = False
) -> int:
    """Keep `eval_count` prompts (a seeded choice by id) out of generation and training. `answered`:
    the rows are completions (existing responses); the kept-aside part keeps their prompt fields."""
    from dflash_ray.data import schema

    train_schema = schema.COMPLETIONS if answered else schema.PROMPTS
    rows = manifest.read_rows(prompts, list(train_schema.names), 10**9)
    if eval_count >= len(rows):
        raise DFlashError(
            f"{eval_count} prompts kept aside for evaluation out of {len(rows)}: none would be left "
            "to train on; allowed: fewer than the prompts",
            field="pipeline.eval_prompts",
        )
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest())
    held = {r["id"] for r in order[:eval_count]}
    for out, part, table_schema in (
        (eval_out, [r for r in rows if r["id"] in held], schema.PROMPTS),
        (train_out, [r for r in rows if r["id"] not in held], train_schema),
    ):
        kind = "completions" if table_schema is schema.COMPLETIONS else "prompts"
        rows_part = [{k: r.get(k) for k in table_schema.names} for r in part]
        storage.write_bytes(storage.join(out, f"{kind}-00000.parquet"), shard_bytes(rows_part, table_schema))
        manifest.write_manifest(
            out, kind=kind, files=[{"name": f"{kind}-00000.parquet", "rows": len(part)}], summary={kind: len(part)}
        )
    return len(rows) - len(held)


def unseen_prompts(inputs: list, trained: str, output: str, cfg: RunConfig) -> int:
    """The `pipeline.unseen_prompts` files as a prompts dataset at `output`; one that is also among the
    run's own prompts (`trained`: the same conversation, by its content id) is refused, naming it."""
    summary = run_prompts(list(inputs), output, cfg, progress=False)
    own = {r["id"] for r in manifest.read_rows(trained, ["id"], 10**9)}
    shared = [r["id"] for r in manifest.read_rows(output, ["id"], 10**9) if r["id"] in own]
    if shared:
        raise DFlashError(
            f"{len(shared)} of its prompts are among the run's own inputs (first id {shared[0]}): "
            "they would not be unseen",
            field="pipeline.unseen_prompts",
        )
    return int(summary["prompts"])


def _step(run: PipelineRun) -> dict[str, Any]:
    """The pipeline's prompts (with those the target wrote itself), the prompts of other kinds kept
    for the unseen figures, and the split: a few prompts kept aside for evaluation, the rest trained
    on (generated for, or with `pipeline.responses` their own answers as the completions)."""
    pcfg, cfg = run.cfg.pipeline, run.cfg
    inputs = list(pcfg.inputs) + ([run.at("self-prompts")] if cfg.selfprompt.count > 0 else [])
    prompts = run.timed(
        "prompts", run_prompts, inputs, run.at("prompts"), cfg, progress=run.progress, responses=pcfg.responses
    )
    if pcfg.unseen_prompts:
        run.timed(
            "prompts_unseen", unseen_prompts, pcfg.unseen_prompts, run.at("prompts"), run.at("prompts-unseen"), cfg
        )
    part = {k: prompts[k] for k in ("records", "prompts", "quarantined", "quarantine_kinds")}
    part["eval_prompts"] = pcfg.eval_prompts
    if not pcfg.responses:
        split_prompts(run.at("prompts"), run.at("prompts-train"), run.at("prompts-eval"), pcfg.eval_prompts, cfg.seed)
        return part
    kept = split_prompts(
        run.at("prompts"), run.at("completions"), run.at("prompts-eval"), pcfg.eval_prompts, cfg.seed, answered=True
    )
    generated = {"completions": kept, "generation_rejected": {}, "generator_nodes": [], "generated_tokens": 0}
    return {**part, **generated, "generate_tokens_per_s": None}


STAGES = (
    Stage(
        name="prompts",
        help="normalize chat datasets into prompt shards",
        command=_command,
        arguments=_arguments("a prompts folder `dflash-ray generate` reads"),
        section="prompts",
        order=10,
        inputs=("self-prompts",),
        outputs=("prompts", "prompts-train", "prompts-eval", "prompts-unseen", "completions"),
        step=_step,
    ),
    Stage(
        name="responses",
        help="existing responses (the last assistant turns of chat datasets) as completions",
        command=_command,
        arguments=_arguments("a completions folder `dflash-ray tokenize` reads"),
        section="prompts",
        order=11,
    ),
)

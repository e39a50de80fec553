"""Loss-mask statistics over a tokenized dataset, the gate's rules and the report (`stages/validate.py` runs them).

The seed project trained for days on data where 87% of samples had a loss-mask sum of exactly 6
(`<think>\\n\\n</think>\\n\\nOK.<|im_end|>`); nobody had decoded a sample. This stage streams over
the whole dataset, computes the distributions that expose such data, decodes samples of the
dominant mode and at random, and refuses the dataset when a gate rule (in config) fails. It reads
any tokenized dataset, this project's or another's (see `dflash_ray.data.tokenized`): only
`input_ids` and `loss_mask` are needed; per-source figures appear when there is a `source` column.

Distributions do not show where the mask sits: a mask inverted onto the prompt, or one of all ones,
passes them. So the gate also checks placement, with the tokenizer's chat template: each run of loss
tokens must start after an assistant header (the first line of the template's generation prompt,
`<|im_start|>assistant`) that follows the sample's start and the run before, and no loss token may
be a turn's header; and no sample may be all loss. Such a mask is a fault of the data, never a
distribution: a single sample fails these rules, and the report decodes it. A mask one token off
passes them all; `mask_bounds` checks where each run of loss begins and ends.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_ray import storage
from dflash_ray.config import GateConfig
from dflash_ray.data import mask_bounds
from dflash_ray.data.mask_bounds import assistant_header, matches
from dflash_ray.data.tokenized import TokenizedData, first_copies, iter_batches, read_table, sample_digest
from dflash_ray.errors import DFlashError

TOP_VALUES = 5
DECODE_CHARS = 1500


@dataclass(slots=True)
class _Scan:
    """Per-sample figures of one pass, in dataset order."""

    loss_sums: np.ndarray
    seq_lens: np.ndarray
    empty_thinking: int
    sources: collections.Counter
    source_loss: dict[str, list[np.ndarray]]
    locations: list[tuple[str, int]]  # (file, rows in file), to fetch examples back
    prompt_loss: np.ndarray  # bool per sample: loss tokens on its prompt (`prompt_loss`)
    first_copy: np.ndarray  # per sample, the first sample of the same content (itself when none before)
    # per boundary rule (`mask_bounds.RULES`), per sample: its first offending token (-1: none); or why
    # the rules were skipped
    bounds: dict[str, np.ndarray] | str


def _offsets_values(column: pa.ChunkedArray | pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values[offsets[0] : offsets[-1]]


def _first_null(column: pa.ChunkedArray | pa.ListArray) -> int | None:
    """The row of the first missing list, or of the first list holding a missing value; None if none."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = []
    if array.null_count:
        rows.append(int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0]))
    values = array.values
    if values.null_count:
        offsets = array.offsets.to_numpy().astype(np.int64)
        k = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        rows.append(int(np.searchsorted(offsets, k, "right")) - 1)
    return min(rows) if rows else None


def _empty_thinking(
    ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, think: int, think_end: int, blank: set[int]
) -> int:
    """Samples whose response opens with a thinking block holding only whitespace."""
    masked = np.flatnonzero(mask)
    if think < 0 or masked.size == 0:
        return 0
    starts, ends = offsets[:-1], offsets[1:]
    j = np.searchsorted(masked, starts)
    has = j < masked.size
    first = np.where(has, masked[np.minimum(j, masked.size - 1)], -1)
    has &= (first >= starts) & (first < ends)
    count = 0
    for f, end in zip(first[has], ends[has]):
        if ids[f] != think:
            continue
        k = f + 1
        while k < end and ids[k] in blank:
            k += 1
        count += int(k < end and ids[k] == think_end)
    return count


def prompt_loss(
    ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, header: np.ndarray | None, turn: int | None
) -> np.ndarray:
    """Per sample (bool): whether loss tokens fall on its prompt. A run of loss tokens must start
    after an assistant `header` that begins at or after the sample's start and the end of the run
    before; no loss token may be a header's (nor the `turn` token that opens every turn). Without a
    header (no chat template), only a run at the sample's first token counts."""
    count = offsets.size - 1
    n = ids.size
    if n == 0:
        return np.zeros(count, dtype=bool)
    sample = np.repeat(np.arange(count), np.diff(offsets))
    m = mask.astype(bool)
    first = np.zeros(n, dtype=bool)
    first[offsets[:-1][np.diff(offsets) > 0]] = True
    before = np.roll(m, 1)  # the previous token's mask (a sample's first token is `first` anyway)
    run = m & (first | ~before)
    # the latest sample start or end of a run at or before each token: a header must come after it
    since = np.maximum.accumulate(np.where(first | (~m & before), np.arange(n), -1))
    bad = m & (ids == turn) if turn is not None else np.zeros(n, dtype=bool)
    if header is None:
        bad |= run & first
    else:
        size = header.size
        starts = matches(ids, sample, header)
        opened = np.full(n + 1, -1)
        opened[starts + size] = starts  # at the token after a header: where it began
        latest = np.maximum.accumulate(opened)[:n]  # the latest header ended at or before each token
        bad |= run & (latest < since)
        for i in range(size):  # a header under the loss
            bad[starts + i] |= m[starts + i]
    return np.bincount(sample[bad], minlength=count) > 0


def _checked(batch: pa.RecordBatch, uri: str, rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's token ids, masks and offsets, once nothing in them would break training (an error names
    the file, record and field otherwise)."""
    for name in ("input_ids", "loss_mask"):  # a null passes every range check as NaN
        row = _first_null(batch.column(name))
        if row is not None:
            raise DFlashError(
                "holds a missing (null) value: every token id and mask value must be set",
                file=uri,
                record=rows + row + 1,
                field=name,
            )
    moffsets, mvalues = _offsets_values(batch.column("loss_mask"))
    ioffsets, ivalues = _offsets_values(batch.column("input_ids"))
    if not np.array_equal(moffsets, ioffsets):
        i = int(np.flatnonzero(np.diff(moffsets) != np.diff(ioffsets))[0])
        raise DFlashError(
            f"input_ids has {ioffsets[i + 1] - ioffsets[i]} tokens but loss_mask {moffsets[i + 1] - moffsets[i]}",
            file=uri,
            record=rows + i + 1,
            field="loss_mask",
        )
    if mvalues.size and (mvalues.min() < 0 or mvalues.max() > 1):
        i = int(np.searchsorted(moffsets, np.flatnonzero((mvalues < 0) | (mvalues > 1))[0], "right")) - 1
        raise DFlashError("loss_mask values must be 0 or 1", file=uri, record=rows + i + 1, field="loss_mask")
    if ivalues.size and (ivalues.min() < 0 or ivalues.max() >= vocab):  # training would index past the table
        k = int(np.flatnonzero((ivalues < 0) | (ivalues >= vocab))[0])
        i = int(np.searchsorted(ioffsets, k, "right")) - 1
        raise DFlashError(
            f"token id {int(ivalues[k])} is outside the tokenizer's vocabulary of {vocab}: "
            "the ids were made by another tokenizer",
            file=uri,
            record=rows + i + 1,
            field="input_ids",
        )
    if "seq_len" in batch.schema.names:
        stated = np.asarray(batch.column("seq_len").to_numpy(zero_copy_only=False), dtype=np.int64)
        wrong = np.flatnonzero(stated != np.diff(ioffsets))
        if wrong.size:
            i = int(wrong[0])
            raise DFlashError(
                f"seq_len is {int(stated[i])} but input_ids has {int(ioffsets[i + 1] - ioffsets[i])} tokens",
                file=uri,
                record=rows + i + 1,
                field="seq_len",
            )
    return ivalues, mvalues, ioffsets


def scan(data: TokenizedData, tokenizer) -> _Scan:
    think = tokenizer.convert_tokens_to_ids("<think>") if "<think>" in tokenizer.get_vocab() else -1
    think_end = tokenizer.convert_tokens_to_ids("</think>") if think >= 0 else -1
    blank = {
        i
        for t, i in tokenizer.get_vocab().items()
        if len(t) <= 8 and tokenizer.convert_tokens_to_string([t]).strip() == ""
    }
    header = assistant_header(tokenizer)
    opener = None if header is None else tokenizer.convert_ids_to_tokens(int(header[0]))
    turn = int(header[0]) if header is not None and opener in tokenizer.get_added_vocab() else None
    marks = mask_bounds.markers(tokenizer)
    sums, lens, locations, on_prompt = [], [], [], []
    bounds: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    digests: list[bytes] = []
    empty = 0
    sources: collections.Counter[str] = collections.Counter()
    source_loss: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    columns = ["input_ids", "loss_mask"] + [c for c in ("source", "seq_len") if c in data.columns]
    vocab = len(tokenizer)
    from tqdm import tqdm

    for uri in tqdm(data.files, desc="validate", unit=" files"):
        rows = 0
        for batch in iter_batches(uri, columns):
            ivalues, mvalues, offsets = _checked(batch, uri, rows, vocab)
            csum = np.concatenate([[0], np.cumsum(mvalues, dtype=np.int64)])
            batch_sums = csum[offsets[1:]] - csum[offsets[:-1]]
            sums.append(batch_sums)
            lens.append(np.diff(offsets))
            empty += _empty_thinking(ivalues, mvalues, offsets, think, think_end, blank)
            on_prompt.append(prompt_loss(ivalues, mvalues, offsets, header, turn))
            if isinstance(marks, mask_bounds.Markers):
                for rule, at in mask_bounds.faults(ivalues, mvalues, offsets, marks).items():
                    bounds[rule].append(at)
            ids32, mask8 = ivalues.astype(np.int32, copy=False), mvalues.astype(np.int8, copy=False)
            digests += [
                sample_digest(ids32[a:b], mask8[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())
            ]
            if "source" in columns:
                batch_sources = [str(s) for s in batch.column("source").to_pylist()]
                sources.update(batch_sources)
                for src in set(batch_sources):
                    pick = np.asarray([s == src for s in batch_sources])
                    source_loss[src].append(batch_sums[pick])
            rows += batch.num_rows
        locations.append((uri, rows))
    empty_arr = np.zeros(0, dtype=np.int64)
    seq_lens = np.concatenate(lens) if lens else empty_arr
    prompt_flags = np.concatenate(on_prompt) if on_prompt else np.zeros(0, dtype=bool)
    return _Scan(
        np.concatenate(sums) if sums else empty_arr,
        seq_lens,
        empty,
        sources,
        source_loss,
        locations,
        prompt_flags,
        first_copies(np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(-1, 2)),
        marks if isinstance(marks, str) else mask_bounds.over_dataset(bounds, seq_lens, prompt_flags),
    )


def distribution(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "median": 0.0, "p10": 0.0, "p90": 0.0, "min": 0, "max": 0}
    p10, median, p90 = np.percentile(values, [10, 50, 90])
    return {
        "mean": float(values.mean()),
        "median": float(median),
        "p10": float(p10),
        "p90": float(p90),
        "min": int(values.min()),
        "max": int(values.max()),
    }


def gate_rules(stats: dict[str, Any], gate: GateConfig) -> list[dict[str, Any]]:
    """Each rule with its measured value, its limit and whether the dataset passes it."""
    top = stats["loss_mask_sum"]["most_common"]
    at_max = bool(top) and top[0]["value"] == stats["loss_mask_sum"]["max"]
    rules = [
        (
            "max_mode_share",
            top[0]["share"] if top else 0.0,
            gate.max_mode_share,
            "<=",
            f"one loss-mask sum value ({top[0]['value'] if top else '-'} tokens) holds "
            f"{(top[0]['share'] if top else 0):.1%} of samples"
            + (
                " and it is the longest response: answers cut at the generation's max_tokens? raise "
                "generate.max_tokens, or set generate.truncated=reject"
                if at_max
                else ""
            ),
        ),
        (
            "min_median_response",
            stats["loss_mask_sum"]["median"],
            gate.min_median_response,
            ">=",
            f"median response is {stats['loss_mask_sum']['median']:g} tokens",
        ),
        (
            "max_no_loss_share",
            stats["no_loss_share"],
            gate.max_no_loss_share,
            "<=",
            f"{stats['no_loss_share']:.1%} of samples have no loss token",
        ),
    ]
    rules += [
        (
            "prompt_loss",
            stats["prompt_loss_share"],
            gate.max_prompt_loss_share,
            "<=",
            f"{stats['prompt_loss_share']:.1%} of samples have loss tokens on their prompt (before the "
            "assistant header, or on a turn's header): the mask is inverted or shifted, and training "
            "would teach the drafter the user's words",
        ),
        (
            "all_loss",
            stats["all_loss_share"],
            gate.max_all_loss_share,
            "<=",
            f"{stats['all_loss_share']:.1%} of samples are all loss (every token masked, the prompt's too)",
        ),
        (
            "duplicates",
            stats["duplicate_share"],
            gate.max_duplicate_share,
            "<=",
            f"{stats['duplicates']} samples ({stats['duplicate_share']:.1%}) repeat an earlier one token for token "
            "(copies of files or records): training would weigh them several times; `dflash-ray tokenize` "
            "keeps each once"
            + (f" (it dropped {stats['duplicates_dropped']} here)" if stats.get("duplicates_dropped") else ""),
        ),
    ]
    if stats["empty_thinking_share"] is not None:
        rules.append(
            (
                "max_empty_thinking_share",
                stats["empty_thinking_share"],
                gate.max_empty_thinking_share,
                "<=",
                f"{stats['empty_thinking_share']:.1%} of samples have an empty thinking block",
            )
        )
    out = []
    for name, value, limit, op, text in rules:
        passed = value <= limit if op == "<=" else value >= limit
        out.append(
            {
                "rule": name,
                "value": value,
                "limit": limit,
                "passed": bool(passed),
                "message": f"{text} (limit: {op} {limit:g})",
            }
        )
    return out + mask_bounds.gate_rules(stats["mask_bounds"], gate)  # the stage sets them: `bound_stats`


def bound_stats(scan: _Scan, tokenizer, has_id: bool) -> dict[str, Any]:
    """`stats["mask_bounds"]`: per boundary rule, the share of samples that break it and the first such
    sample decoded around its offending token, the loss in ⟦ ⟧ (a mask one token off shows nowhere
    else); or why the rules were skipped."""
    if isinstance(scan.bounds, str):
        return {"skipped": scan.bounds}
    out: dict[str, Any] = {rule: float((at >= 0).mean()) for rule, at in scan.bounds.items()}
    first = {rule: int(np.argmax(at >= 0)) for rule, at in scan.bounds.items() if (at >= 0).any()}
    rows = _rows(scan, list(first.values()), has_id)
    out["examples"] = {}
    for rule, k in first.items():
        (name, ids, mask), at = rows[k], int(scan.bounds[rule][k])
        out["examples"][rule] = f"{name} at token {at}: {mask_bounds.marked(tokenizer, ids, mask, at)!r}"
    return out


def _rows(scan: _Scan, indices: list[int], has_id: bool) -> dict[int, tuple[str, np.ndarray, np.ndarray]]:
    """The samples at global row indices, read back: name, token ids and mask (bool). A dataset
    without ids names a sample by its file and row."""
    wanted = sorted(set(indices))
    out = {}
    base = 0
    for uri, rows in scan.locations:
        local = [i - base for i in wanted if base <= i < base + rows]
        if local:
            table = read_table(uri, ["input_ids", "loss_mask"] + (["id"] if has_id else [])).take(local)
            for i, row in zip(local, table.to_pylist()):
                name = row["id"] if has_id else f"{storage.basename(uri)} row {i + 1}"
                out[base + i] = (name, np.asarray(row["input_ids"]), np.asarray(row["loss_mask"], dtype=bool))
        base += rows
    return out


def examples(scan: _Scan, indices: list[int], tokenizer, has_id: bool) -> list[dict[str, Any]]:
    """Decode the samples at global row indices (prompt tail and response)."""
    rows = _rows(scan, indices, has_id)
    return [
        {
            "id": name,
            "seq_len": int(ids.size),
            "loss_mask_sum": int(mask.sum()),
            "prompt_tail": tokenizer.decode(ids[~mask].tolist())[-300:],
            "response": tokenizer.decode(ids[mask].tolist())[:DECODE_CHARS],
        }
        for name, ids, mask in (rows[i] for i in indices if i in rows)
    ]


def histogram_png(values: np.ndarray, title: str, xlabel: str) -> bytes:
    from dflash_ray.plots import COLOR, png_figure

    with png_figure() as (_, (ax,), buf):
        if values.size:
            ax.hist(values, bins=min(100, max(10, int(np.unique(values).size))), color=COLOR)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("samples")
    return buf.getvalue()


def _share(value: float | None) -> str:
    return "n/a" if value is None else format(value, ".1%")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"


def markdown(report: dict[str, Any]) -> str:
    s, lm = report["stats"], report["stats"]["loss_mask_sum"]
    lines = [
        f"# Validation report: {report['input']}",
        "",
        f"**Gate: {'PASSED' if report['passed'] else 'FAILED'}**",
        "",
    ]
    lines += [f"- {'ok  ' if r['passed'] else 'FAIL'} `{r['rule']}`: {r['message']}" for r in report["rules"]]
    lines += [
        "",
        "| figure | value |",
        "|---|---|",
        f"| samples | {s['samples']:,} |",
        f"| tokens | {s['tokens']:,} |",
        f"| loss tokens | {s['loss_tokens']:,} |",
        f"| response-token fraction | {s['response_fraction']:.1%} |",
        f"| loss-mask sum mean / median / p10 / p90 / max | {lm['mean']:.1f} / {lm['median']:g} / "
        f"{lm['p10']:g} / {lm['p90']:g} / {lm['max']} |",
        f"| seq_len mean / median / p90 / max | {s['seq_len']['mean']:.1f} / {s['seq_len']['median']:g}"
        f" / {s['seq_len']['p90']:g} / {s['seq_len']['max']} |",
        f"| samples with no loss token | {s['no_loss_share']:.1%} |",
        f"| samples with loss on their prompt / all loss | {s['prompt_loss_share']:.1%} / {s['all_loss_share']:.1%} |",
        *mask_bounds.table_row(s.get("mask_bounds")),
        f"| duplicate samples (kept here / dropped by tokenize) | {s['duplicates']:,} / "
        f"{s.get('duplicates_dropped') or 0:,} |",
        f"| empty thinking blocks | {_share(s['empty_thinking_share'])} |",
        f"| offline hidden-state storage avoided | {_human_bytes(s['offline_storage_bytes'])} |",
        "",
        "Most common loss-mask sums: " + ", ".join(f"{v['value']} ({v['share']:.1%})" for v in lm["most_common"]),
    ]
    if s["sources"]:  # only when the dataset has a `source` column
        lines += ["", "| source | samples | median response |", "|---|---|---|"]
        lines += [f"| {k} | {v['samples']:,} | {v['median_response']:g} |" for k, v in s["sources"].items()]
    for title, key in (
        ("Samples of the dominant loss-mask sum", "dominant_examples"),
        ("Random samples", "random_examples"),
        ("Samples with loss on their prompt, or all loss", "mask_examples"),
    ):
        if key == "mask_examples" and not report[key]:
            continue
        lines += ["", f"## {title}"]
        for ex in report[key]:
            lines += [
                "",
                f"`{ex['id']}`: {ex['loss_mask_sum']} response tokens of {ex['seq_len']}",
                "",
                "```",
                ex["response"],
                "```",
            ]
    lines += ["", "![loss-mask sums](loss_mask_sum.png)", "", "![seq_len](seq_len.png)", ""]
    return "\n".join(lines)

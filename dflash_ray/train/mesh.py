"""How a drafter's ranks hold its weights: the 2-D arrangement of its streams, rows that replicate
one another and columns inside a row that shard the weights (FSDP2 over a `DeviceMesh` of
(replicate, shard)).

- `fsdp`: one row of every rank: each holds 1/N of the weights; every layer's weights are gathered
  and its gradients reduce-scattered over all N, across the nodes when the ranks span several.
- `hsdp`: a row per node: the weights shard over the ranks of a node (NVLink) and replicate across
  nodes, whose bus carries only one all-reduce of a rank's gradient shard a step.
- `replicate`: every rank holds the whole drafter; one all-reduce of the gradients a step.

No torch, no Ray: the plan prices these shapes and the run builds them from its actors' nodes.
"""

from __future__ import annotations

import math

KINDS = ("fsdp", "hsdp", "replicate")


def kind_of(layout: str) -> str:
    """`train.layout` as a kind: `auto` is hsdp wherever no plan refined it (the plan's choice
    wherever the ranks span nodes; on one node it is fsdp)."""
    return "hsdp" if layout == "auto" else layout


def rows_of(kind: str, nodes: list[str]) -> list[list[int]]:
    """The ranks (stream indices; `nodes[i]`: rank i's node) as rows that replicate one another, each
    row's ranks sharding the weights. `hsdp` keeps every row inside one node; where the nodes hold
    unequal counts of ranks, the rows are the largest size that divides every node's count (FSDP2
    shards evenly), down to one rank: plain replication."""
    n = len(nodes)
    if kind == "fsdp":
        return [list(range(n))]
    if kind == "replicate":
        return [[i] for i in range(n)]
    if kind != "hsdp":
        raise ValueError(f"{kind!r} is not one of {KINDS}")
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    size = math.gcd(*[len(ranks) for ranks in by_node.values()])
    return [ranks[i : i + size] for ranks in by_node.values() for i in range(0, len(ranks), size)]


def balanced(kind: str, nodes: list[str], wanted: int, stand_in: bool = False) -> list[int]:
    """The ranks (rank i on `nodes[i]`) a mesh of `kind` is built of, for a run whose schedule is
    `wanted` streams wide. hsdp's rows are one size, each whole inside a node; where the nodes hold
    unequal counts (a GPU lost), each node gives whole rows and its ranks left over stay idle.

    - `train.lost_streams=shrink` (every training rank one batch a step): the row size that keeps
      the most ranks, among those at least half the largest node's count (a rank's shard of the
      weights and optimizer, and its gradient across the nodes, at most twice the calm run's), then
      the largest. So 8 and 7 ranks make two rows of 7 (14 train), 8 and 6 two rows of 6.
    - `stand_in` (the placed ranks take the `wanted` streams' batches): the size whose ranks make the
      fewest passes a step over them (`schedule.passes`), then the largest (less traffic across the
      nodes), then the one keeping more ranks. So 8 and 7 of 16 wanted make one row of 8 (two
      passes), not 15 rows of one rank (two passes too, with the whole drafter on every rank).

    Where a size keeps every rank, every rank is kept, as `rows_of` arranges them. fsdp and
    replicate keep every rank."""
    if kind != "hsdp" or not nodes:
        return list(range(len(nodes)))
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    counts = [len(ranks) for ranks in by_node.values()]

    def kept(size: int) -> int:
        return size * sum(c // size for c in counts)

    if stand_in:
        size = min(range(1, max(counts) + 1), key=lambda s: (-(-wanted // kept(s)), -s, -kept(s)))
    else:
        size = min(range(-(-max(counts) // 2), max(counts) + 1), key=lambda s: (-kept(s), -s))
    if kept(size) == len(nodes):
        return list(range(len(nodes)))
    return sorted(r for ranks in by_node.values() for r in ranks[: len(ranks) // size * size])


def training_ranks(kind: str, nodes: list[str], wanted: int, floor: int, stand_in: bool = False) -> list[int]:
    """The placed ranks a run trains on: `balanced`'s, unless they are fewer than `floor`
    (`train.min_streams`) while the placed ones are not, where every placed rank trains (the rows
    then the size that divides every node's count, `rows_of`)."""
    keep = balanced(kind, nodes, wanted, stand_in)
    return list(range(len(nodes))) if len(keep) < floor <= len(nodes) else keep


def balanced_count(
    kind: str, ranks: int, per_node: int, wanted: int, floor: int, stand_in: bool = False
) -> tuple[int, int]:
    """How many of `ranks` ranks, placed `per_node` to a node, node by node, train
    (`training_ranks`: the plan's view of it), and the size of their mesh's rows."""
    per_node = max(1, min(per_node, ranks))
    nodes = [f"node{i // per_node}" for i in range(ranks)]
    keep = training_ranks(kind, nodes, wanted, floor, stand_in)
    return len(keep), len(rows_of(kind, [nodes[i] for i in keep])[0])


def shape_of(kind: str, ranks: int, per_node: int) -> tuple[int, int]:
    """(replicas, shard size) of `kind` for `ranks` drafter ranks placed `per_node` to a node, filled
    node by node (the plan's view of `rows_of`)."""
    per_node = max(1, min(per_node, ranks))
    nodes = [f"node{i // per_node}" for i in range(ranks)]
    rows = rows_of(kind, nodes)
    return len(rows), len(rows[0])


def spans_nodes(ranks: list[int], per_node: int) -> bool:
    """Whether a group of ranks (placed `per_node` to a node, in order) crosses a node boundary."""
    return len({r // max(1, per_node) for r in ranks}) > 1


def dims_cross_nodes(kind: str, ranks: int, per_node: int) -> dict[str, bool]:
    """For each mesh dimension, whether its groups cross the nodes (their traffic takes the slow bus)."""
    replicas, shard = shape_of(kind, ranks, per_node)
    row = list(range(shard))  # the first row; every row alike
    column = [i * shard for i in range(replicas)]
    return {"shard": spans_nodes(row, per_node), "replicate": spans_nodes(column, per_node)}

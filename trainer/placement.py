"""Where the `ray` backend's workers go: how many on each node of the Ray cluster this process is connected to.

verl 0.9.1's `RayResourcePool(process_on_nodes=[k, k, ...])` makes one placement group per
entry, each `STRICT_PACK` (all of its bundles on one node, whichever node fits them), with
one bundle per worker: `{"CPU": max_colocate_count}`, plus `{"GPU": 1}` with `use_gpu`.
`RayWorkerGroup` then starts `process_on_nodes[0]` workers in every group, so the entries
must be equal, and numbers ranks group by group, the groups sorted by node IP.

`layout` picks k: the largest divisor of `num_workers` whose groups fit the cluster's alive
nodes, so the workers take as few nodes as can hold them (FSDP's collectives are fastest
inside a node) and spread over more only when no node can hold them all. It reads the
cluster's total resources, not what is free now: a layout that fits waits for busy
resources, as any Ray job does, while one that cannot fit is refused here instead of
leaving verl waiting forever for its placement groups. This module starts and places nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["layout", "node_capacities", "worker_bundle"]


def worker_bundle(use_gpu: bool, max_colocate_count: int) -> dict[str, float]:
    """The resources of one worker's bundle, as verl's `RayResourcePool.get_placement_groups` asks for them."""
    bundle = {"CPU": float(max_colocate_count)}
    if use_gpu:
        bundle["GPU"] = 1.0
    return bundle


def node_capacities(bundle: Mapping[str, float]) -> list[int]:
    """How many `bundle`s each alive node of the connected Ray cluster holds, by its total resources."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [
        min(int(node["Resources"].get(name, 0.0) // amount) for name, amount in bundle.items())
        for node in nodes
        if node["Alive"]
    ]


def layout(num_workers: int, capacities: Sequence[int]) -> list[int]:
    """`process_on_nodes` for `num_workers` workers on nodes that hold `capacities[i]` workers each.

    Groups of k workers, k the largest divisor of `num_workers` such that the nodes hold
    `num_workers / k` of them (a node of capacity c holds c // k). Raises `ValueError` when
    the nodes hold fewer than `num_workers` workers in all.
    """
    for per_group in range(num_workers, 0, -1):
        groups = num_workers // per_group
        if num_workers % per_group == 0 and sum(c // per_group for c in capacities) >= groups:
            return [per_group] * groups
    raise ValueError(
        f"the Ray cluster cannot hold {num_workers} workers: its alive nodes hold {list(capacities)} "
        "(one CPU per worker, and one GPU on CUDA); add nodes or lower trainer.num_workers"
    )

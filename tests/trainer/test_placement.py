"""How the `ray` backend's workers are split over a cluster's nodes (`trainer.placement`)."""

from __future__ import annotations

import pytest

from trainer.placement import layout, worker_bundle


@pytest.mark.parametrize(
    ("num_workers", "capacities", "expected"),
    [
        (2, [2], [2]),  # one node that holds them all: today's local Ray
        (2, [16, 1], [2]),  # packed on one node rather than spread: FSDP's collectives stay inside it
        (2, [1, 1], [1, 1]),  # no node holds two: one per node
        (16, [8, 8], [8, 8]),  # two 8-GPU nodes, full
        (8, [8, 8], [8]),
        (4, [3, 2], [2, 2]),  # 3 // 2 + 2 // 2 = 2 groups of 2
        (3, [2, 2], [1, 1, 1]),  # 3 is prime: groups of one, two of them on one node
        (6, [4, 4, 0], [3, 3]),  # a node with nothing to give (a CPU-only head on CUDA) holds no group
    ],
)
def test_layout_takes_the_fewest_nodes_that_hold_the_workers(num_workers: int, capacities: list[int],
                                                              expected: list[int]) -> None:
    assert layout(num_workers, capacities) == expected


@pytest.mark.parametrize(("num_workers", "capacities"), [(3, [1, 1]), (1, []), (2, [0, 0])])
def test_layout_refuses_a_cluster_that_cannot_hold_the_workers(num_workers: int, capacities: list[int]) -> None:
    with pytest.raises(ValueError, match=f"cannot hold {num_workers} workers"):
        layout(num_workers, capacities)


def test_worker_bundle_is_one_cpu_and_one_gpu_on_cuda() -> None:
    assert worker_bundle(use_gpu=False, max_colocate_count=1) == {"CPU": 1.0}
    assert worker_bundle(use_gpu=True, max_colocate_count=1) == {"CPU": 1.0, "GPU": 1.0}

"""Two verl Ray workers (FSDP2 over gloo, on CPU) give the update one process gives."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer.policy_batch import policy_batch
from tests.trainer.test_update import settings
from trainer.update import PolicyUpdater, start_ray

pytestmark = [
    # verl's engine package warns at import that optional backends (megatron, mindspeed, ...) are absent.
    pytest.mark.filterwarnings("ignore:.*engine is not available:UserWarning"),
    # verl 0.9.1 imports ray.experimental.state, which Ray 2.60 deprecates.
    pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local Ray for the module, started as PolicyUpdater starts it (2 CPUs, a small object store)."""
    import ray

    assert start_ray(settings(backend="ray", num_workers=2), "cpu")
    yield
    ray.shutdown()


@pytest.mark.parametrize("lora_rank", [8, 0], ids=["lora", "full"])
def test_two_ray_workers_match_one_process(ray_cluster: None, tiny_model_dir: Path, tmp_path: Path,
                                           lora_rank: int) -> None:
    # 8 rows in mini-batches of 4: two optimizer steps, each on the same rows in both runs.
    batch = policy_batch(tiny_model_dir, copies=2, mini_batch_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker (1 CPU): the same summation order inside matmuls
    try:
        local = PolicyUpdater(tiny_model_dir, settings(lora_rank=lora_rank))
        expected = local.update(batch)
        expected_state = local.training_state()
        expected_log_probs = local.log_probs(batch)
    finally:
        torch.set_num_threads(threads)

    with PolicyUpdater(tiny_model_dir, settings(lora_rank=lora_rank, backend="ray", num_workers=2)) as ray_updater:
        got = ray_updater.update(batch)
        assert got["mini_batches"] == expected["mini_batches"] == 4  # 2 mini-batches x 2 PPO epochs (the default)
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "tokens", "adv_mean", "is_weight_mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
        state = ray_updater.training_state()
        assert state["params"].keys() == expected_state["params"].keys()
        for name, value in expected_state["params"].items():
            torch.testing.assert_close(state["params"][name], value, atol=1e-5, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
        for name, slots in expected_state["optim"]["state"].items():
            torch.testing.assert_close(state["optim"]["state"][name]["exp_avg"], slots["exp_avg"], atol=1e-7, rtol=1e-4)
        torch.testing.assert_close(ray_updater.log_probs(batch), expected_log_probs, atol=1e-4, rtol=0)

        # a sharded checkpoint (one file per rank) restores the state it saved
        saved = ray_updater.save_checkpoint(tmp_path)
        assert sorted(p.name for p in saved.glob("model_world_size_2_rank_*.pt")) == [
            "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
        ray_updater.update(batch)
        assert ray_updater.resume(tmp_path) == 1
        restored = ray_updater.training_state()
        assert all(torch.equal(restored["params"][k], v) for k, v in state["params"].items())

        # rank 0 writes the export, gathered from both shards
        exported = ray_updater.export(tmp_path / "policy")
        assert (exported / ("adapter_model.safetensors" if lora_rank else "model.safetensors")).is_file()

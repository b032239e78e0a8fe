"""PolicyUpdater in one CPU process: verl's TrainingWorker + FSDP2 engine on the tiny model."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shared.settings import TrainerSettings
from tests.trainer.policy_batch import ADVANTAGE_SIGNS, base_model, hf_log_probs, policy_batch
from trainer.batch import Batch
from trainer.update import CheckpointError, PolicyUpdater, dp_order

pytestmark = [
    # verl's engine package warns at import that optional backends (megatron, mindspeed, ...) are absent.
    pytest.mark.filterwarnings("ignore:.*engine is not available:UserWarning"),
    # verl 0.9.1 imports ray.experimental.state, which Ray 2.60 deprecates.
    pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning"),
]


def settings(**overrides: Any) -> TrainerSettings:
    values: dict[str, Any] = {"mini_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3, "lora_rank": 8,
                              "lora_alpha": 16, "seed": 0}
    return TrainerSettings(**{**values, **overrides})


@pytest.fixture(scope="module")
def batch(tiny_model_dir: Path) -> Batch:
    return policy_batch(tiny_model_dir)


@pytest.fixture(scope="module")
def base_log_probs(tiny_model_dir: Path, batch: Batch) -> torch.Tensor:
    return hf_log_probs(base_model(tiny_model_dir), batch)


@pytest.fixture(scope="module", params=["lora", "full"])
def trained(request: pytest.FixtureRequest, tiny_model_dir: Path, batch: Batch) -> Iterator[SimpleNamespace]:
    """One update of a fresh policy (LoRA or full weights) on `batch`."""
    updater = PolicyUpdater(tiny_model_dir, settings(lora_rank=8 if request.param == "lora" else 0, ppo_epochs=1))
    before = updater.log_probs(batch)
    metrics = updater.update(batch)
    yield SimpleNamespace(kind=request.param, updater=updater, metrics=metrics, before=before,
                          after=updater.log_probs(batch))
    updater.close()


def test_dp_order_gives_each_worker_its_slice_of_every_mini_batch() -> None:
    assert dp_order(8, 4, 1).tolist() == list(range(8))
    # worker 0 gets rows 0,1 (mini-batch 0) and 4,5 (mini-batch 1); worker 1 gets 2,3 and 6,7
    assert dp_order(8, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_trainer_logprobs_match_transformers(trained: SimpleNamespace, base_log_probs: torch.Tensor) -> None:
    # Before the update the policy is the base model: the engine's logprobs, sliced to the
    # response, are exactly what transformers computes token by token.
    torch.testing.assert_close(trained.before, base_log_probs, atol=1e-4, rtol=0)


def test_one_update_moves_logprobs_with_the_advantage(trained: SimpleNamespace, batch: Batch) -> None:
    m = trained.metrics
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert m["step"] == 1 and trained.updater.step == 1
    assert m["tokens"] == float(batch.tensors["response_mask"].sum()) == 10
    assert m["mini_batches"] == 1 and m["step_time_s"] > 0
    # one mini-batch: the ratio is 1 everywhere, nothing is clipped
    assert m["clip_frac"] == m["pg_clipfrac"] == 0 and m["ppo_kl"] == pytest.approx(0, abs=1e-6)
    assert m["entropy"] > 0 and "kl" not in m  # no reference without kl_coef
    # the replica "served the base model": trainer and replica agree, IS weights are 1
    assert m["logprob_mismatch"] < 1e-5 and m["mismatch/abs_diff_max"] < 1e-4 and m["mismatch/tokens"] == 8
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m["is_clip_frac"] == 0

    mask = batch.tensors["response_mask"].bool()
    delta = ((trained.after - trained.before) * mask).sum(-1)
    for row, sign in enumerate(ADVANTAGE_SIGNS):
        assert delta[row].item() * sign > 0, f"row {row}: logprob moved {delta[row].item():+.2e}, advantage {sign:+d}"
    # masked (tool) tokens are not trained on, but do change with the weights; padding stays 0
    assert (trained.after[~batch.tensors["attention_mask"][:, batch.tensors["prompts"].shape[1]:].bool()] == 0).all()


def test_export_loads_in_transformers_and_peft(trained: SimpleNamespace, tiny_model_dir: Path, batch: Batch,
                                               base_log_probs: torch.Tensor, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = trained.updater.export(tmp_path / "policy")
    if trained.kind == "lora":
        assert (exported / "adapter_config.json").is_file() and (exported / "adapter_model.safetensors").is_file()
        config = json.loads((exported / "adapter_config.json").read_text())
        assert config["r"] == 8 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
        model = PeftModel.from_pretrained(base_model(tiny_model_dir), exported).eval()
    else:
        assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
        model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert not list(tmp_path.glob(".policy.tmp*"))
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in exported.iterdir())  # a replica may run as another user
    logp = hf_log_probs(model, batch)
    torch.testing.assert_close(logp, trained.after, atol=1e-4, rtol=0)  # the exported policy is the trained one
    assert (logp - base_log_probs).abs().max() > 1e-3  # and it is not the base model

    if trained.kind == "lora":  # merged into full weights, for replicas that take full weights
        merged = trained.updater.export(tmp_path / "merged", kind="full")
        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        torch.testing.assert_close(hf_log_probs(model, batch), trained.after, atol=1e-4, rtol=0)
        # Merging wrote a copy: the policy in training is untouched (on the CPU the gathered state is
        # the engine's own storage, and an in-place merge once added the adapter into it).
        torch.testing.assert_close(trained.updater.log_probs(batch), trained.after, atol=1e-5, rtol=0)
    else:
        with pytest.raises(ValueError, match="LoRA"):
            trained.updater.export(tmp_path / "adapter", kind="lora")


def test_trust_region_acts_by_default(tiny_model_dir: Path, batch: Batch) -> None:
    # Default: two passes over the batch; from the second on the policy is not the one that
    # sampled, so the ratio leaves 1 and PPO's clip acts.
    assert TrainerSettings().ppo_epochs == 2
    updater = PolicyUpdater(tiny_model_dir, settings(lr=0.2))
    try:
        m = updater.update(batch)
    finally:
        updater.close()
    assert m["mini_batches"] == 2
    assert m["ppo_kl"] != 0 and m["clip_frac"] > 0


def test_entropy_bonus_raises_entropy_without_any_advantage(tiny_model_dir: Path, batch: Batch) -> None:
    flat = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta_info))
    flat.tensors["advantages"] = torch.zeros_like(batch.tensors["response_mask"], dtype=torch.float32)  # all tied
    updater = PolicyUpdater(tiny_model_dir, settings(lr=5e-2, entropy_coeff=1.0, ppo_epochs=1))
    try:
        first = updater.update(flat)
        second = updater.update(flat)
    finally:
        updater.close()
    assert first["adv_abs_mean"] == 0 and first["grad_norm"] > 0  # the bonus alone moves the policy
    assert second["entropy"] > first["entropy"]


@pytest.mark.parametrize("lora_rank", [8, 0])
def test_kl_to_the_reference(tiny_model_dir: Path, batch: Batch, base_log_probs: torch.Tensor, lora_rank: int) -> None:
    # LoRA: the reference is the base with the adapter off; full weights: a frozen copy. One epoch,
    # one mini-batch: the first update's KL is then measured before the policy moved at all.
    updater = PolicyUpdater(tiny_model_dir, settings(lora_rank=lora_rank, kl_coef=0.5, lr=1e-2, ppo_epochs=1))
    first = updater.update(batch)
    assert first["kl"] == pytest.approx(0, abs=1e-6)  # the policy starts as the reference
    second = updater.update(batch)
    assert second["kl"] > 1e-6
    torch.testing.assert_close(updater.log_probs(batch, reference=True), base_log_probs, atol=1e-4, rtol=0)
    assert (updater.log_probs(batch) - base_log_probs).abs().max() > 1e-3


def test_checkpoint_resumes_identical_parameters_and_optimizer(tiny_model_dir: Path, batch: Batch,
                                                               tmp_path: Path) -> None:
    s = settings(checkpoint_dir=str(tmp_path / "ckpt"), keep_checkpoints=2)
    first = PolicyUpdater(tiny_model_dir, s)
    assert first.resume() is None  # nothing saved yet
    first.update(batch)
    saved = first.save_checkpoint()
    assert saved.name == "step_00000001" and (tmp_path / "ckpt" / "latest").read_text().strip() == saved.name
    state = first.training_state()

    second = PolicyUpdater(tiny_model_dir, s)
    assert second.resume() == 1 and second.step == 1
    resumed = second.training_state()
    assert resumed["params"].keys() == state["params"].keys() and len(state["params"]) > 0
    for name, value in state["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    assert resumed["optim"]["param_groups"] == state["optim"]["param_groups"]
    for name, slots in state["optim"]["state"].items():
        for slot, value in slots.items():
            assert torch.equal(resumed["optim"]["state"][name][slot], value), (name, slot)

    # and both continue identically
    a, b = first.update(batch), second.update(batch)
    assert a["loss"] == b["loss"] and a["step"] == b["step"] == 2
    after_a, after_b = first.training_state()["params"], second.training_state()["params"]
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)

    # rotation keeps `keep_checkpoints`; no temporary directories stay behind
    first.save_checkpoint()
    first.update(batch)
    first.save_checkpoint()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000002", "step_00000003"]


def test_checkpoint_from_another_world_size_is_refused(tiny_model_dir: Path, batch: Batch, tmp_path: Path) -> None:
    updater = PolicyUpdater(tiny_model_dir, settings(checkpoint_dir=str(tmp_path)))
    saved = updater.save_checkpoint()
    meta = json.loads((saved / "rolltap_checkpoint.json").read_text())
    (saved / "rolltap_checkpoint.json").write_text(json.dumps({**meta, "num_workers": 2}))
    with pytest.raises(CheckpointError, match="2 workers"):
        updater.resume()
    with pytest.raises(CheckpointError, match="not a complete"):
        updater.load_checkpoint(tmp_path)


def test_refusals(tiny_model_dir: Path, batch: Batch) -> None:
    with pytest.raises(ValueError, match="num_workers"):
        PolicyUpdater(tiny_model_dir, settings(num_workers=2))
    with pytest.raises(ValueError, match="ray_address"):
        PolicyUpdater(tiny_model_dir, settings(ray_address="auto"))
    with pytest.raises(ValueError, match="micro_batch_size"):
        PolicyUpdater(tiny_model_dir, settings(backend="ray", num_workers=2, mini_batch_size=2, micro_batch_size=2))
    updater = PolicyUpdater(tiny_model_dir, settings(mini_batch_size=8, micro_batch_size=4, adv_estimator="gae"))
    with pytest.raises(ValueError, match="multiple of mini_batch_size"):
        updater.update(batch)
    eight = policy_batch(tiny_model_dir, copies=2, mini_batch_size=8)
    with pytest.raises(ValueError, match="critic"):
        updater.update(eight)
    metrics = updater.update(eight, values=torch.zeros_like(eight.tensors["token_level_rewards"]))
    assert math.isfinite(metrics["loss"])

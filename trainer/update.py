"""One PPO/GRPO update of the policy, run by verl's `TrainingWorker` and FSDP2 engine.

`PolicyUpdater` owns the policy (model, optimizer, step) through `trainer.worker.PolicyWorker`
(verl's `TrainingWorker`), either in this process (`backend = "local"`) or as a verl
`RayWorkerGroup` of `num_workers` FSDP2 ranks (`backend = "ray"`), on a local Ray it starts
or on a running cluster it attaches to (`ray_address`), its ranks placed over the cluster's
nodes by `trainer.placement`. The same calls run every way; device choices live in
`trainer/verl_cpu.py`.

One `update(batch)`, on a `trainer.batch.Batch`:

1. old logprobs (and entropy) of the response tokens under the current weights (`infer_batch`),
   each row at its own sampling temperature (the batch's `temperature`);
2. reference logprobs when `kl_coef > 0` (the adapter switched off, or a frozen copy);
3. advantages: the batch's own (per-attempt group statistics, `trainer.data`), or for `gae`
   `algos.compute_advantages` over tokens;
4. the replica-vs-trainer logprob mismatch and truncated importance weights
   (`algos.logprob_mismatch`, `algos.rollout_is_weights`);
5. verl's `train_mini_batch`: per mini-batch of `mini_batch_size` rows, verl's `ppo_loss`
   (clipped surrogate, KL loss, entropy bonus), backward over micro-batches, grad clip,
   AdamW step.

Rows are reordered before dispatch so that with N workers each global mini-batch is the
same set of rows as in one process (verl hands worker r the r-th contiguous chunk and
splits it into mini-batches itself).

Policy export (`export`) writes a PEFT adapter or a full HF directory; `stage_weights` holds
the full weights in memory for vLLM's weight-transfer engine instead (trainer/transfer.py); checkpoints
(`save_checkpoint`, `resume`) are verl's sharded FSDP checkpoints, one directory per step,
renamed into place when complete, with a `latest` pointer.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from shared.settings import TrainerSettings
from trainer import algos, placement, transfer, verl_cpu
from trainer.batch import Batch

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["CheckpointError", "PolicyUpdater", "dp_order", "start_ray"]

logger = logging.getLogger(__name__)

# The tensors of a Batch the engine reads; the rest (rewards, flags) stays in the driver.
_ENGINE_KEYS = (
    "prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "temperature"
)
CHECKPOINT_META = "rolltap_checkpoint.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used here (incomplete, other world size, other model)."""


def dp_order(num_rows: int, mini_batch_size: int, num_workers: int) -> torch.Tensor:
    """Row order such that worker r's contiguous chunk holds, for every global mini-batch k,
    rows `k*M + r*M/N ... k*M + (r+1)*M/N` (M = mini_batch_size, N = num_workers).

    verl gives worker r the r-th of N contiguous chunks and cuts it into mini-batches of
    M/N rows; in this order the k-th mini-batch of all workers together is rows
    `k*M ... (k+1)*M` of the batch, as in one process. Identity for one worker.
    """
    per = mini_batch_size // num_workers
    order = [k * mini_batch_size + r * per + i
             for r in range(num_workers) for k in range(num_rows // mini_batch_size) for i in range(per)]
    return torch.tensor(order, dtype=torch.long)


def start_ray(settings: TrainerSettings, device: verl_cpu.Device) -> bool:
    """Connect this process to Ray unless it is; True when this call connected it.

    With `settings.ray_address`, attach to that running cluster (`ray start`); else start a
    local Ray sized for `settings`: one CPU per worker on CPU, and a capped object store
    (`trainer.verl_cpu.ray_options`). `ray.shutdown()` undoes either: it stops a local Ray
    and only disconnects from a cluster, which keeps running.
    """
    import ray

    if ray.is_initialized():
        return False
    init, _ = verl_cpu.ray_options(device, settings.num_workers)
    if settings.ray_address:
        # `ray start` sized the cluster; Ray refuses num_cpus or an object store size when attaching.
        ray.init(address=settings.ray_address, runtime_env=init["runtime_env"])
    else:
        # "local" rather than None: a RAY_ADDRESS left in the environment must not turn this into an attach.
        ray.init(address="local", object_store_memory=settings.ray_object_store_mb << 20, **init)
    return True


def _mean(values: Any) -> float:
    """Mean of a verl metric: a number or a list of one per mini-batch."""
    vals = values if isinstance(values, list) else [values]
    return float(np.mean([float(v) for v in vals]))


def _last(values: Any) -> float:
    return float(values[-1] if isinstance(values, list) else values)


class PolicyUpdater:
    """The policy and its optimizer, updated by verl; see the module docstring.

        updater = PolicyUpdater(model_dir, settings.trainer)   # resume() to continue a run
        metrics = updater.update(build_batch(samples, mini_batch_size=settings.trainer.mini_batch_size))
        updater.save_checkpoint()                              # checkpoint_dir/step_00000001
        updater.export(out_dir)                                # PEFT adapter (LoRA) or HF directory
        updater.close()                                        # stops Ray workers, if any
    """

    def __init__(self, model_path: str | Path, settings: TrainerSettings) -> None:
        s = settings
        if s.backend == "local" and s.num_workers != 1:
            raise ValueError(f"backend 'local' runs one worker, not num_workers={s.num_workers}; use backend 'ray'")
        if s.backend == "local" and s.ray_address:
            raise ValueError(f"ray_address ({s.ray_address!r}) is for backend 'ray'; backend 'local' runs no Ray")
        per_worker = s.mini_batch_size // s.num_workers
        if s.mini_batch_size % s.num_workers or per_worker % s.micro_batch_size:
            raise ValueError(
                f"mini_batch_size ({s.mini_batch_size}) must split into num_workers ({s.num_workers}) equal "
                f"parts that are multiples of micro_batch_size ({s.micro_batch_size})"
            )
        self.settings = s
        self.model_path = str(Path(model_path).resolve())
        self.device = verl_cpu.pick_device(s.device)
        self.is_lora = s.lora_rank > 0
        # What each version is exported as: an adapter, or full weights (LoRA merged in with `lora_serve = merged`).
        self.export_kind: Literal["lora", "full"] = "lora" if self.is_lora and s.lora_serve == "adapter" else "full"
        self._step = 0
        self._ray: Any = None  # (worker group, resource pool, whether we connected to Ray)
        verl_cpu.setup(self.device)  # before anything imports verl's engines (trainer.worker does)
        from verl.workers.utils.losses import ppo_loss

        loss_fn = functools.partial(
            ppo_loss,
            config=algos.policy_loss_config(
                clip_ratio_low=s.clip_ratio_low,
                clip_ratio_high=s.clip_ratio_high,
                clip_ratio_c=s.clip_ratio_c,
                loss_agg_mode=s.loss_agg_mode,
                entropy_coeff=s.entropy_coeff,
                kl_coef=s.kl_coef,
                kl_type=s.kl_type,
                mini_batch_size=s.mini_batch_size,
                micro_batch_size=s.micro_batch_size,
            ),
        )
        config = self._worker_config()
        with_ref = s.kl_coef > 0 and not self.is_lora
        if s.backend == "local":
            from trainer.worker import PolicyWorker

            self._worker: Any = PolicyWorker(config, self.device, with_ref)
        else:
            self._worker = self._start_ray(config, with_ref)
        self._call("set_loss_fn", loss_fn)
        self._call("init_model", s.seed)

    # -- construction ---------------------------------------------------------------

    def _worker_config(self) -> Any:
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

        s, opts = self.settings, verl_cpu.engine_options(self.device)
        targets: str | list[str] = s.lora_target_modules
        if targets == ["all-linear"]:
            targets = "all-linear"  # PEFT's spelling for "every linear layer but the head"
        model = HFModelConfig(
            path=self.model_path,
            override_config={"attn_implementation": opts["attn_implementation"]},
            use_remove_padding=opts["use_remove_padding"],
            enable_gradient_checkpointing=opts["gradient_checkpointing"],
            lora_rank=s.lora_rank,
            lora_alpha=s.lora_alpha,
            target_modules=targets,
        )
        engine = FSDPEngineConfig(
            strategy=opts["strategy"],
            model_dtype=opts["model_dtype"],
            mixed_precision=opts["mixed_precision"],
            use_torch_compile=opts["use_torch_compile"],
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=s.micro_batch_size,
            infer_micro_batch_size_per_gpu=s.micro_batch_size,
            seed=s.seed,
        )
        optim = FSDPOptimizerConfig(
            lr=s.lr, weight_decay=s.weight_decay, clip_grad=s.grad_clip, lr_scheduler_type="constant"
        )
        return TrainingWorkerConfig(
            model_type="language_model",
            model_config=model,
            engine_config=engine,
            optimizer_config=optim,
            checkpoint_config=CheckpointConfig(),
        )

    def _start_ray(self, config: Any, with_ref: bool) -> Any:
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        from trainer.worker import PolicyWorker

        s, env = self.settings, verl_cpu.worker_env(self.device)
        started = start_ray(s, self.device)
        pool_options = verl_cpu.ray_options(self.device, s.num_workers)[1]
        capacities = placement.node_capacities(placement.worker_bundle(**pool_options))
        per_group = placement.layout(s.num_workers, capacities)
        logger.info("Ray backend: %d workers, %d per placement group (one node each), on %d alive nodes "
                    "that hold %s workers", s.num_workers, per_group[0], len(capacities), capacities)
        pool = RayResourcePool(process_on_nodes=per_group, **pool_options)
        cls = RayClassWithInitArgs(ray.remote(PolicyWorker), config=config, device=self.device, with_ref_model=with_ref)
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name=self.device, worker_env=env)
        self._ray = (group, pool, started)
        return group

    # -- plumbing -------------------------------------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a worker method; for several workers, rank 0's answer (data is already gathered)."""
        out = getattr(self._worker, method)(*args, **kwargs)
        if self._ray is None:
            return out
        if hasattr(out, "get"):
            out = out.get()
        return out[0] if isinstance(out, list) else out

    @staticmethod
    def _tensordict(tensors: dict[str, torch.Tensor], **meta: Any) -> TensorDict:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        batch: dict[str, torch.Tensor | list[Any]] = dict(tensors)  # a copy, typed as verl takes it
        if "temperature" not in batch:  # a batch built elsewhere: vLLM's default
            batch["temperature"] = torch.ones(tensors["input_ids"].shape[0])
        # Per-row temperature (B,): verl's engine divides each row's logits by its own, so the
        # logprobs are those of the distribution the replica sampled from.
        td = left_right_2_no_padding(tu.get_tensordict(tensor_dict=batch))
        tu.assign_non_tensor(td, **meta)
        return td

    def _infer(self, tensors: dict[str, torch.Tensor], *, reference: bool = False) -> dict[str, torch.Tensor]:
        """{"log_probs": (B, R), "entropy": (B, R)} of the response tokens, 0 past each response."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        td = self._tensordict({k: tensors[k] for k in _ENGINE_KEYS if k in tensors}, calculate_entropy=not reference,
                              compute_loss=False)
        out = self._call("ref_log_prob" if reference else "infer_batch", td)
        valid = tensors["attention_mask"][:, tensors["prompts"].shape[1]:].float()
        result = {"log_probs": no_padding_2_padding(tu.get(out, "log_probs"), td).float() * valid}
        if not reference:
            result["entropy"] = no_padding_2_padding(tu.get(out, "entropy"), td).float() * valid
        return result

    def _check_batch(self, batch: Batch) -> None:
        s, rows = self.settings, len(batch)
        if rows % s.mini_batch_size:
            raise ValueError(
                f"batch of {rows} rows is not a multiple of mini_batch_size ({s.mini_batch_size}); "
                "build it with trainer.batch.build_batch(..., mini_batch_size=settings.mini_batch_size)"
            )

    # -- public API -----------------------------------------------------------------

    @property
    def step(self) -> int:
        """Updates applied so far (restored by `resume`/`load_checkpoint`)."""
        return self._step

    def log_probs(self, batch: Batch, *, reference: bool = False) -> torch.Tensor:
        """(B, R) logprobs of `batch`'s response tokens under the current (or reference) policy."""
        self._check_batch(batch)
        return self._infer(batch.tensors, reference=reference)["log_probs"]

    def update(self, batch: Batch, *, values: torch.Tensor | None = None) -> dict[str, float]:
        """One PPO/GRPO update on `batch` (see the module docstring); returns its metrics.

        `values` (B, R): a critic's values, required by `adv_estimator = "gae"`.
        Metrics (means over mini-batches): `loss`, `pg_loss`, `grad_norm` (before clipping),
        `lr`, `clip_frac` (= `pg_clipfrac`, tokens where PPO's clip is active),
        `pg_clipfrac_lower` (dual clip), `ppo_kl` (approximate KL between the updated and
        the old policy), `entropy` (of the old policy, mean per response token), `kl` (to
        the reference; only with `kl_coef > 0`), `adv_mean`, `adv_abs_mean`, `rows` (real
        rows), `tokens` (generated tokens), `mini_batches`, `step`, `step_time_s`,
        `is_weight_mean` and `is_clip_frac` (with `rollout_is`), `logprob_mismatch` (mean
        |trainer - replica| logprob) and `mismatch/*` (`algos.logprob_mismatch`), both only
        when some row carries replica logprobs.

        Raises `FloatingPointError` when a mini-batch's loss or gradient is not finite
        (verl skips that optimizer step; the step is not counted).
        """
        from verl.utils import tensordict_utils as tu

        start = time.perf_counter()
        s = self.settings
        self._check_batch(batch)
        rows = len(batch)
        order = dp_order(rows, s.mini_batch_size, s.num_workers)
        t = {k: v[order] for k, v in batch.tensors.items()}
        uid = batch.non_tensors["uid"][order.numpy()]
        mask = t["response_mask"]
        if not mask.any():
            raise ValueError("the batch has no generated tokens to train on (response_mask is all 0)")

        old = self._infer(t)
        old_lp = old["log_probs"]
        train = {k: t[k] for k in _ENGINE_KEYS if k in t}
        train["old_log_probs"] = old_lp
        if s.kl_coef > 0:
            train["ref_log_prob"] = self._infer(t, reference=True)["log_probs"]

        if s.adv_estimator == "gae" or "advantages" not in t:
            adv, _ = algos.compute_advantages(
                s.adv_estimator,
                token_level_rewards=t["token_level_rewards"],
                response_mask=mask,
                index=uid,
                values=None if values is None else values[order],
                gamma=s.adv_gamma,
                lam=s.gae_lambda,
                norm_adv_by_std_in_grpo=s.norm_adv_by_std_in_grpo,
            )
        else:
            # Per-attempt statistics spread over triplets by the credit rule (trainer.data):
            # each attempt counts once in its group, whatever its number of triplets.
            adv = t["advantages"] * mask.to(t["advantages"].dtype)
        train["advantages"] = adv

        metrics: dict[str, float] = {}
        has_lp = t["has_rollout_log_probs"]
        replica_lp = t["rollout_log_probs"]
        mismatch = algos.logprob_mismatch(old_lp, replica_lp, mask, has_lp)
        metrics.update({f"mismatch/{k}": v for k, v in mismatch.items()})
        # Rows whose calls came without replica logprobs (`proxy.rollout_logprobs` off or not
        # sampled, hosted or re-tokenised calls): no importance weight, no share in the mismatch.
        without = int(((mask.sum(-1) > 0) & ~has_lp.bool()).sum())
        metrics["rows_without_rollout_logprobs"] = without
        if without:
            logger.info("%d of %d rows carry no replica logprobs: the train/replica mismatch is %s and %s",
                        without, int((mask.sum(-1) > 0).sum()),
                        "measured on the others" if mismatch else "not reported this step",
                        "they get no importance correction" if s.rollout_is != "off" else "no correction is on")
        if mismatch:
            metrics["logprob_mismatch"] = mismatch["abs_diff_mean"]
        if s.rollout_is != "off":
            weights, is_metrics = algos.rollout_is_weights(
                old_lp, replica_lp, mask, has_lp, level=s.rollout_is, threshold=s.rollout_is_threshold
            )
            train["rollout_is_weights"] = weights
            metrics.update(is_metrics)

        td = self._tensordict(
            train,
            calculate_entropy=s.entropy_coeff > 0,
            global_batch_size=s.mini_batch_size,
            mini_batch_size=s.mini_batch_size,
            epochs=s.ppo_epochs,
            seed=s.seed,
            dataloader_kwargs={"shuffle": False},
            compute_loss=True,
        )
        raw = tu.get(self._call("train_mini_batch", td), "metrics")
        norms = raw["grad_norm"]
        grad_norms = [float(g) for g in (norms if isinstance(norms, list) else [norms])]
        losses = raw["loss"] if isinstance(raw["loss"], list) else [raw["loss"]]
        if not (np.isfinite(grad_norms).all() and np.isfinite([float(x) for x in losses]).all()):
            raise FloatingPointError(
                f"non-finite loss {losses} or gradient norm {grad_norms}: verl skipped those optimizer steps; "
                "resume from the last checkpoint"
            )
        self._step += 1
        metrics.update(
            loss=_mean(raw["loss"]),
            pg_loss=_mean(raw["actor/pg_loss"]),
            grad_norm=float(np.mean(grad_norms)),
            lr=_last(raw.get("lr", s.lr)),
            clip_frac=_mean(raw["actor/pg_clipfrac"]),
            pg_clipfrac=_mean(raw["actor/pg_clipfrac"]),
            pg_clipfrac_lower=_mean(raw["actor/pg_clipfrac_lower"]),
            ppo_kl=_mean(raw["actor/ppo_kl"]),
            entropy=float(algos.masked_mean(old["entropy"], mask)),
            adv_mean=float(algos.masked_mean(adv, mask)),
            adv_abs_mean=float(algos.masked_mean(adv.abs(), mask)),
            rows=float(int(batch.meta_info.get("num_real_rows", rows))),
            tokens=float(mask.sum()),
            mini_batches=float(len(grad_norms)),
            step=float(self._step),
        )
        if "kl_loss" in raw:
            metrics["kl"] = _mean(raw["kl_loss"])
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics

    def training_state(self) -> dict[str, Any]:
        """{"params": {name: tensor} of trainable parameters, "optim": optimizer state}, gathered on CPU."""
        state: dict[str, Any] = self._call("training_state")
        return state

    def worker_nodes(self) -> list[str]:
        """The Ray node id each worker runs on, by rank, as the workers report it; empty for `local`."""
        if self._ray is None:
            return []
        nodes: list[str] = self._worker.node_id()  # one answer per rank
        return nodes

    def export(self, out_dir: str | Path, kind: Literal["lora", "full"] | None = None) -> Path:
        """Write the current policy to `out_dir` (replaced atomically) and return it.

        `kind` defaults to `export_kind`: `lora` when training LoRA with `lora_serve = adapter` (a
        PEFT adapter directory for vLLM's `/v1/load_lora_adapter`), else `full` (an HF safetensors
        directory for vLLM's `reload_weights`); `full` with LoRA merges the adapter into the base weights.
        """
        kind = kind or self.export_kind
        out = Path(out_dir).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        self._call("export_policy", str(out), kind)
        return out

    def stage_weights(self, backend: transfer.Backend) -> dict[str, Any]:
        """The full weights held in memory for vLLM's weight-transfer engine, as `/update_weights`'s
        `update_info` (trainer/transfer.py); `release_weights()` once every replica has loaded them.
        A LoRA run stages its merged weights (`lora_serve = merged`)."""
        if self.export_kind == "lora":
            raise ValueError("an in-memory weight transfer moves full weights; lora_serve = adapter pushes adapters")
        info: dict[str, Any] | None = self._call("stage_weights", backend)
        if info is None:
            raise RuntimeError("rank 0 staged no weights")
        return info

    def release_weights(self) -> None:
        self._call("release_weights")

    # -- checkpoints ----------------------------------------------------------------

    def _checkpoint_root(self, root: str | Path | None) -> Path:
        root = root if root is not None else self.settings.checkpoint_dir
        if root is None:
            raise ValueError("no checkpoint directory: set trainer.checkpoint_dir or pass one")
        return Path(root).resolve()

    def save_checkpoint(self, root: str | Path | None = None) -> Path:
        """Save model, optimizer, LR schedule, RNG and step to `root/step_NNNNNNNN` and point `latest` at it.

        Written into a temporary directory first and renamed when every worker is done, so
        a crash leaves either the previous `latest` or the new one, never half a checkpoint.
        Older checkpoints beyond `keep_checkpoints` are removed.
        """
        root = self._checkpoint_root(root)
        root.mkdir(parents=True, exist_ok=True)
        name = f"step_{self._step:08d}"
        final, tmp = root / name, root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self._call("save_checkpoint", str(tmp), global_step=self._step, max_ckpt_to_keep=None)
        meta = {"step": self._step, "num_workers": self.settings.num_workers, "lora_rank": self.settings.lora_rank,
                "model_path": self.model_path}
        (tmp / CHECKPOINT_META).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # the same step saved again: the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name + "\n")
        os.replace(pointer, root / LATEST)
        kept = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in kept[: -self.settings.keep_checkpoints]:
            shutil.rmtree(old)
        return final

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore model, optimizer, LR schedule, RNG and step from a checkpoint directory; returns the step."""
        path = Path(path).resolve()
        meta_file = path / CHECKPOINT_META
        if not meta_file.is_file():
            raise CheckpointError(f"{path} is not a complete rolltap checkpoint (no {CHECKPOINT_META})")
        meta = json.loads(meta_file.read_text())
        if meta["num_workers"] != self.settings.num_workers:
            raise CheckpointError(
                f"{path} was saved by {meta['num_workers']} workers (sharded per rank); this run has "
                f"{self.settings.num_workers}"
            )
        if meta["lora_rank"] != self.settings.lora_rank:
            raise CheckpointError(f"{path} has lora_rank {meta['lora_rank']}, this run {self.settings.lora_rank}")
        self._call("load_checkpoint", str(path), del_local_after_load=False)
        self._step = int(meta["step"])
        return self._step

    def resume(self, root: str | Path | None = None) -> int | None:
        """Load the checkpoint `latest` points to, if any; returns its step (None: nothing to resume)."""
        root = self._checkpoint_root(root)
        pointer = root / LATEST
        if not pointer.is_file():
            return None
        return self.load_checkpoint(root / pointer.read_text().strip())

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Stop the Ray workers and, if this updater connected to Ray, disconnect; a no-op for `local`.

        Disconnecting stops a local Ray this updater started; a cluster it attached to
        (`ray_address`) keeps running for the next run.
        """
        if self._ray is None:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        group, pool, started = self._ray
        self._ray = None
        for handle in group.workers:
            ray.kill(handle)
        for pg in pool.pgs or []:
            remove_placement_group(pg)
        if started:
            ray.shutdown()

    def __enter__(self) -> PolicyUpdater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

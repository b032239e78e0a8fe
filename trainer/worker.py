"""The verl worker that holds the policy: verl's `TrainingWorker` plus what rolltap adds.

`PolicyWorker` is verl's `TrainingWorker` (FSDP2 engine, optimizer, `infer_batch`,
`train_mini_batch`, sharded checkpoints) with these additions, each a registered worker
method so it runs the same in-process and on every worker of a Ray `RayWorkerGroup`:

- `init_model(seed)`: seeds torch before the engine builds the model, so the LoRA
  initialisation is the same in every run (rank 0's copy is broadcast to the others);
- `ref_log_prob(data)`: logprobs under the reference policy (for the KL loss): the base
  model with the adapter switched off when training LoRA, else a second, frozen copy;
- `export_policy(out_dir, kind)`: the policy as a PEFT adapter or a full HF directory;
- `training_state()`: full trainable parameters and optimizer state (checks and tests).
- `node_id()`: the Ray node the worker runs on (where the workers went);
- `stage_weights(backend)` / `release_weights()`: the full weights held in memory for vLLM's
  weight-transfer engine (trainer/transfer.py), until every replica has loaded them.

Importing this module imports verl's engines, which read the platform once: in the driver,
call `trainer.verl_cpu.setup()` first (`trainer.update` does); Ray workers get it from
their environment (`trainer.verl_cpu.worker_env`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker

from trainer import transfer, verl_cpu

__all__ = ["PolicyWorker"]

_F = TypeVar("_F", bound=Callable[..., Any])
_ONE_TO_ALL = Dispatch.ONE_TO_ALL  # type: ignore[attr-defined]  # verl builds Dispatch's members at runtime
_PER_RANK_DATA = make_nd_compute_dataproto_dispatch_fn(mesh_name="train")  # type: ignore[no-untyped-call]


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP2 shard gathered from every rank (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def _worker_method(dispatch_mode: Any, blocking: bool = True) -> Callable[[_F], _F]:
    """verl's `register` (untyped) keeping the method's type: how the worker group calls it."""
    decorator: Callable[[_F], _F] = register(  # type: ignore[no-untyped-call]
        dispatch_mode=dispatch_mode, blocking=blocking
    )
    return decorator


class PolicyWorker(TrainingWorker):
    """verl's `TrainingWorker` for the policy, with a reference, export and inspection."""

    def __init__(self, config: TrainingWorkerConfig, device: verl_cpu.Device, with_ref_model: bool = False) -> None:
        verl_cpu.init_process_group(device)  # before TrainingWorker picks a backend (verl_cpu item 3)
        super().__init__(config)
        self.ref: TrainingWorker | None = None
        self._staged: transfer.StagedWeights | None = None
        if with_ref_model:
            ref_config = deepcopy(config)
            ref_config.engine_config.forward_only = verl_cpu.engine_options(device)["ref_forward_only"]
            self.ref = TrainingWorker(ref_config)

    @property
    def _is_lora(self) -> bool:
        return bool(self.model_config.lora_rank > 0)

    @_worker_method(_ONE_TO_ALL)
    def init_model(self, seed: int) -> None:
        torch.manual_seed(seed)
        for worker in (self, self.ref):
            if worker is not None:
                engine: Any = worker.engine
                engine.initialize()

    @_worker_method(_PER_RANK_DATA, blocking=False)
    def ref_log_prob(self, data: TensorDict) -> TensorDict | None:
        if self.ref is not None:
            out: TensorDict | None = self.ref.infer_batch(data)
            return out
        if not self._is_lora:
            raise RuntimeError("no reference model: full-weight training needs with_ref_model=True for KL")
        tu.assign_non_tensor(data, no_lora_adapter=True)
        out = self.infer_batch(data)
        return out

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        from verl.utils.fsdp_utils import get_fsdp_full_state_dict

        engine: Any = self.engine
        state: dict[str, torch.Tensor] = get_fsdp_full_state_dict(engine.module, offload_to_cpu=True, rank0_only=True)
        return state

    @_worker_method(_ONE_TO_ALL)
    def node_id(self) -> str:
        """The Ray node this worker runs on (`PolicyUpdater.worker_nodes`)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    @_worker_method(_ONE_TO_ALL)
    def training_state(self) -> dict[str, Any] | None:
        """On rank 0: {"params": trainable parameters, "optim": optimizer state}, full tensors on CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        engine: Any = self.engine
        module, optim = engine.module, engine.optimizer
        params = self._full_state_dict()
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        optim_state = get_optimizer_state_dict(
            module, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if dist.get_rank() != 0:
            return None
        return {"params": {k: v for k, v in params.items() if k in trainable}, "optim": optim_state}

    @_worker_method(_ONE_TO_ALL)
    def export_policy(self, out_dir: str, kind: str) -> str | None:
        """Write the policy to `out_dir` (rank 0), through a temporary directory renamed into place.

        `lora`: a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`),
        what vLLM's `/v1/load_lora_adapter` reads. `full`: a Hugging Face model directory
        (safetensors, config, tokenizer), the adapter merged in when training LoRA, what
        vLLM's `reload_weights` reads. Returns the directory on rank 0, None elsewhere.
        """
        if kind not in ("lora", "full"):
            raise ValueError(f"export kind must be 'lora' or 'full', not {kind!r}")
        if kind == "lora" and not self._is_lora:
            raise ValueError("a LoRA adapter export needs LoRA training (lora_rank > 0)")
        # Collective: every rank takes part. An adapter needs only the LoRA tensors: gathering the
        # whole model for it took 21 s of an 8B-class step on the H200 (docs/scale.md).
        state = self._lora_state_dict() if kind == "lora" else self._full_state_dict()
        if dist.get_rank() != 0:
            dist.barrier()
            return None
        try:
            out = Path(out_dir)
            tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if kind == "lora":
                self._write_adapter(state, tmp)
            else:
                self._write_full(state, tmp)
            for f in tmp.iterdir():
                f.chmod(0o644)  # safetensors writes 0600; a replica may run as another user
            tmp.chmod(0o755)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            dist.barrier()
        return str(out)

    @_worker_method(_ONE_TO_ALL)
    def stage_weights(self, backend: transfer.Backend) -> dict[str, Any] | None:
        """The full weights (a LoRA run's merged with its adapter) as `/update_weights`'s `update_info`
        (rank 0; None elsewhere), kept alive until `release_weights`. A collective: every rank gathers
        each parameter whole."""
        if backend not in ("ipc", "shm"):
            raise ValueError(f"weight transfer backend must be 'ipc' or 'shm', not {backend!r}")
        self.release_weights()
        engine: Any = self.engine
        # ipc: the copy a replica reads stays on this GPU until it is loaded, so it is made in the dtype the
        # replica serves (the checkpoint's, vLLM's `dtype auto`), half of the fp32 master weights. shm: as
        # the disk export writes them, so both pushes give a replica the same numbers.
        wire = getattr(self.model_config.hf_config, "torch_dtype", None) if backend == "ipc" else None
        named = transfer.merged_parameters(engine.module, _whole) if self._is_lora else (
            (name, _whole(p)) for name, p in engine.module.named_parameters())
        self._staged = transfer.stage(named, backend, wire if isinstance(wire, torch.dtype) else None)
        return self._staged.update_info

    @_worker_method(_ONE_TO_ALL)
    def release_weights(self) -> None:
        if self._staged is not None:
            self._staged.release()
            self._staged = None

    def _lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors, whole, on rank 0's CPU (empty elsewhere); a collective over the shards."""
        engine: Any = self.engine
        state: dict[str, torch.Tensor] = {}
        for name, param in engine.module.named_parameters():
            if "lora_" not in name:
                continue
            whole = _whole(param)
            if dist.get_rank() == 0:
                state[name] = whole.detach().to("cpu", copy=True)
        return state

    def _write_full(self, state: dict[str, torch.Tensor], tmp: Path) -> None:
        """A Hugging Face model directory, the adapter merged in when training LoRA."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        hf_config = self.model_config.hf_config
        with init_empty_weights():
            model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                hf_config, dtype=next(iter(state.values())).dtype
            )
        if self._is_lora:
            from peft import get_peft_model
            from torch.distributed.tensor import DTensor

            engine: Any = self.engine
            peft_config = deepcopy(engine.module.peft_config["default"])
            model = get_peft_model(model, peft_config)
            # Training on the CPU, the gathered state is the engine's own storage: merging into it would
            # add the adapter to the base weights being trained, once more at every export.
            own = {(p.to_local() if isinstance(p, DTensor) else p).data_ptr() for p in engine.module.parameters()}
            state = {k: v.clone() if v.data_ptr() in own else v for k, v in state.items()}
        # The gathered tensors become the model's parameters (no copy); tied weights stay tied.
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or any(k for k in missing if "lm_head" not in k):
            raise RuntimeError(f"export: state does not fit the model: missing={missing} unexpected={unexpected}")
        if getattr(hf_config, "tie_word_embeddings", False):
            model.tie_weights()
        if self._is_lora:
            model = model.merge_and_unload()
        model.save_pretrained(str(tmp), safe_serialization=True)
        self.model_config.tokenizer.save_pretrained(str(tmp))

    def _write_adapter(self, state: dict[str, torch.Tensor], tmp: Path) -> None:
        """A PEFT adapter directory from the LoRA tensors: what `PeftModel.save_pretrained` writes."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        engine: Any = self.engine
        config = deepcopy(engine.module.peft_config["default"])
        adapter = get_peft_model_state_dict(engine.module, state_dict=state, adapter_name="default")
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        config.inference_mode = True  # as PEFT saves it: loaded for serving, not training
        config.save_pretrained(str(tmp))

"""Full weights handed to replicas in memory, through vLLM's weight-transfer engine.

A replica started with `--weight-transfer-config '{"backend": ...}'` takes new weights as
`POST /update_weights {"update_info": ...}` between `/start_weight_update` and
`/finish_weight_update` (the trainer sends these through the proxy's admin API, as every
replica control call). This module builds `update_info` from the trainer's tensors and keeps
those tensors (or their copy) alive until the replicas have loaded them:

- `ipc` (vLLM's own backend; replicas on the trainer's GPUs): CUDA IPC handles of the
  tensors, pickled as vLLM's HTTP route takes them (`ipc_handles_pickled`; the replica needs
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1`). Nothing is copied on the trainer's side when a tensor
  is already contiguous and in the wire dtype; each replica copies from the trainer's memory.
  With several trainer ranks, every rank offers its own copy and rank 0 merges the handles by
  GPU, so each replica reads the copy on its own GPU.
- `shm` (Rolltap's backend, registered by the `rolltap_vllm` plugin; CPU replicas on the
  trainer's host): one POSIX shared-memory segment holding every tensor, named in `update_info`.

Disk (`reload_weights` from an exported folder) stays the fallback: it needs neither, only a
path every replica reads.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["Backend", "StagedWeights", "merged_parameters", "stage"]

Backend = Literal["ipc", "shm"]

_ALIGN = 64  # each tensor starts on a cache line in the shared segment


@dataclass
class StagedWeights:
    """Weights ready for `/update_weights`: `update_info` (None off rank 0) and what keeps it valid."""

    update_info: dict[str, Any] | None
    tensors: list[torch.Tensor] = field(default_factory=list)
    segment: shared_memory.SharedMemory | None = None
    bytes: int = 0

    def release(self) -> None:
        """Once every replica has loaded them: drop the tensors, remove the segment."""
        self.tensors.clear()
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


def merged_parameters(module: Any, whole: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT LoRA model's base parameters by the base model's own names (what a replica loads),
    each adapted weight with the adapter merged in: W + scaling * B @ A, as PEFT's
    `merge_and_unload` makes it, without changing `module`. `whole` makes a parameter whole (an
    FSDP shard gathered: a collective, so every rank walks them in the same order)."""
    from peft.tuners.lora import LoraLayer

    adapted = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    for name, param in module.named_parameters():
        if "lora_" in name:
            continue
        tensor = whole(param).detach()
        owner, base, field_name = name.rpartition(".base_layer.")
        if base and field_name == "weight":
            layer: Any = adapted[owner]
            a = whole(layer.lora_A["default"].weight).detach()
            b = whole(layer.lora_B["default"].weight).detach()
            tensor = tensor + (b.to(tensor.dtype) @ a.to(tensor.dtype)) * layer.scaling["default"]
        yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stage(named: Iterable[tuple[str, torch.Tensor]], backend: Backend, dtype: torch.dtype | None = None) -> StagedWeights:
    """`(name, tensor)` pairs (full tensors, Hugging Face names) as `update_info` for `backend`.

    `dtype` is the wire dtype (the replica's, so it loads a plain copy); None keeps each tensor's.
    """
    names: list[str] = []
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, tensor in named:
        t = tensor.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        t = t.contiguous()
        names.append(name)
        shapes.append(list(t.shape))
        dtypes.append(_dtype_name(t.dtype))
        tensors.append(t)
    size = sum(t.numel() * t.element_size() for t in tensors)
    info: dict[str, Any] = {"names": names, "dtype_names": dtypes, "shapes": shapes}
    if backend == "ipc":
        return _stage_ipc(info, tensors, size)
    if backend == "shm":
        return _stage_shm(info, tensors, size)
    raise ValueError(f"weight transfer backend must be 'ipc' or 'shm', not {backend!r}")


def _stage_ipc(info: dict[str, Any], tensors: list[torch.Tensor], size: int) -> StagedWeights:
    from torch.multiprocessing.reductions import reduce_tensor

    if any(not t.is_cuda for t in tensors):
        raise ValueError("the ipc weight transfer needs the weights on a CUDA device (device = cuda)")
    uuid = str(torch.cuda.get_device_properties(tensors[0].device).uuid)
    # reduce_tensor's arguments rebuild the tensor in another process while this one keeps it.
    handles: list[dict[str, Any]] = [{uuid: reduce_tensor(t)[1]} for t in tensors]  # type: ignore[no-untyped-call]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, handles)
        if dist.get_rank() != 0:
            return StagedWeights(None, tensors, bytes=size)
        handles = [{k: v for rank in gathered for k, v in rank[i].items()} for i in range(len(tensors))]
    info = {**info, "packed": False,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii")}
    return StagedWeights(info, tensors, bytes=size)


def _stage_shm(info: dict[str, Any], tensors: list[torch.Tensor], size: int) -> StagedWeights:
    if dist.is_initialized() and dist.get_rank() != 0:
        return StagedWeights(None)
    offsets: list[int] = []
    at = 0
    for t in tensors:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    segment = shared_memory.SharedMemory(create=True, size=max(at, 1))
    try:
        for t, offset in zip(tensors, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            view = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes, offset=offset)
            view.copy_(t.cpu().view(-1).view(torch.uint8))
            del view  # no export of the buffer may outlive it, or close() fails
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    return StagedWeights({**info, "segment": segment.name, "offsets": offsets}, segment=segment, bytes=size)

"""vLLM weight-transfer backend `rolltap_shm`: full weights from a POSIX shared-memory segment.

For replicas on the trainer's host without a GPU to share (vLLM's `ipc` backend is CUDA IPC):
the trainer writes every tensor once into one segment (`trainer/transfer.py`) and names it, with
each tensor's name, dtype, shape and offset, in `/update_weights`'s `update_info`; each replica
maps the segment, loads the tensors as its checkpoint loader would, and unmaps it. The trainer
removes the segment once every replica has answered.

Start a replica with `--weight-transfer-config '{"backend": "rolltap_shm"}'` (the plugin registers
the name in every vLLM process). Nothing is deserialized but numbers and names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

__all__ = ["ShmWeightTransferEngine"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ShmInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped where mypy runs
    """Nothing to set up: the segment is named per update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    segment: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n):
            raise ValueError(f"update_info: names, dtype_names, shapes and offsets differ in length "
                             f"({n}, {len(self.dtype_names)}, {len(self.shapes)}, {len(self.offsets)})")
        unknown = sorted(set(self.dtype_names) - set(_DTYPES))
        if unknown:
            raise ValueError(f"update_info: dtypes {unknown} are not among {sorted(_DTYPES)}")


class ShmWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc]
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        # As vLLM's checkpoint-format backends do: layers are re-processed once all their weights came.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        segment = shared_memory.SharedMemory(name=update_info.segment)
        # Attaching registers the segment for removal at this process's exit (before Python 3.13): the
        # trainer owns it and removes it.
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        try:
            self.model.load_weights(self._tensors(segment, update_info))
        finally:
            segment.close()

    def _tensors(self, segment: shared_memory.SharedMemory, info: ShmUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        for name, dtype_name, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets,
                                                   strict=True):
            dtype = _DTYPES[dtype_name]
            count = 1
            for d in shape:
                count *= d
            if offset < 0 or offset + count * dtype.itemsize > segment.size:
                raise ValueError(f"update_info: {name} lies outside the segment ({segment.size} bytes)")
            # A copy, on the model's device: the segment is unmapped when the load returns.
            view = torch.frombuffer(segment.buf, dtype=dtype, count=count, offset=offset).view(shape)
            yield name, view.to(self.device, copy=True)
            del view

    def shutdown(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Iterator[Any], trainer_args: dict[str, Any] | Any) -> None:
        raise NotImplementedError("the trainer side is Rolltap's trainer/transfer.py, over the proxy's admin API")

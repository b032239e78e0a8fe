"""Trainer drivers for `test_update_ray_cluster`, each in its own process: the test SIGKILLs the
first, and Ray's connection state (its token authentication above all) is per process.

    python -m tests.trainer.cluster_driver nodes RAY_ADDRESS
    python -m tests.trainer.cluster_driver first|resume RAY_ADDRESS MODEL_DIR CHECKPOINT_DIR OUT

`nodes` prints the cluster's alive node ids (JSON). `first` attaches a two-worker `ray`
PolicyUpdater to the cluster, applies one update to `policy_batch(MODEL_DIR, copies=2)`, saves
a checkpoint to CHECKPOINT_DIR, writes its results to OUT and waits to be killed: the kill, not a
clean exit, is what `resume` must survive. `resume` attaches a new PolicyUpdater, resumes from
CHECKPOINT_DIR, applies the next update, writes its results to OUT and exits. OUT is written
with `torch.save` and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.trainer.policy_batch import policy_batch
from tests.trainer.test_update import settings
from trainer.update import PolicyUpdater


def alive_node_ids(address: str) -> list[str]:
    import ray

    ray.init(address=address)
    try:
        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        return sorted(n["NodeID"] for n in nodes if n["Alive"])
    finally:
        ray.shutdown()


def _save(result: dict[str, Any], out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    torch.save(result, tmp)
    os.replace(tmp, out)


def run(phase: str, address: str, model_dir: Path, checkpoint_dir: Path, out: Path) -> None:
    batch = policy_batch(model_dir, copies=2, mini_batch_size=4)
    updater = PolicyUpdater(model_dir, settings(backend="ray", num_workers=2, ray_address=address,
                                                checkpoint_dir=str(checkpoint_dir)))
    result: dict[str, Any] = {"nodes": updater.worker_nodes()}
    if phase == "first":
        result["metrics"] = updater.update(batch)
        updater.save_checkpoint()
        result["state"] = updater.training_state()
        _save(result, out)
        while True:  # the test kills this process; the workers stay up until then
            time.sleep(60)
    result["resumed_step"] = updater.resume()
    result["resumed_state"] = updater.training_state()
    result["metrics"] = updater.update(batch)
    result["state"] = updater.training_state()
    updater.close()
    _save(result, out)


if __name__ == "__main__":
    if sys.argv[1] == "nodes":
        print(json.dumps(alive_node_ids(sys.argv[2])))
    else:
        phase, address, model_dir, checkpoint_dir, out = sys.argv[1:]
        run(phase, address, Path(model_dir), Path(checkpoint_dir), Path(out))

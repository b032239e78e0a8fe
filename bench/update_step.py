"""One verl update, measured on whatever device is here: the step the trainer repeats.

    python -m bench.update_step [--device auto|cpu|cuda] [--rows 32] [--response 64] [--steps 5]

Builds a tiny Qwen2 on the spot (no hub), a GRPO batch of `rows` random prompt/response
pairs in four groups, and runs `PolicyUpdater.update` `steps` times (LoRA and full
weights). Prints per step: loss, grad norm, time; and checks what a working update must
show: finite loss, non-zero gradient, response tokens of positive advantage more likely.
Used to record the GPU run (CI has no GPU; the CPU path is covered by tests/trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shared.settings import TrainerSettings
from tools.tiny_model import build_tiny_model
from trainer.batch import Batch, build_batch
from trainer.data import Sample
from trainer.trajectory import Triplet
from trainer.update import PolicyUpdater


def _batch(rows: int, prompt_len: int, response_len: int, vocab: int) -> tuple[Batch, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    samples, rewards = [], []
    for i in range(rows):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        response = torch.randint(3, vocab, (response_len,), generator=gen).tolist()
        reward = float(torch.rand((), generator=gen))
        rewards.append(reward)
        triplet = Triplet(prompt_ids=prompt, response_ids=response, response_mask=[1] * response_len,
                          response_logprobs=None)
        samples.append(Sample(triplet=triplet, group_id=f"g{i % 4}", rollout_id=f"g{i % 4}", attempt_id=str(i),
                              attempt_pk=i, index=0, reward=reward, final_reward=reward))
    r = torch.tensor(rewards)
    groups = torch.tensor([i % 4 for i in range(rows)])
    advantage = torch.stack([r[i] - r[groups == groups[i]].mean() for i in range(rows)])
    return build_batch(samples, mini_batch_size=rows), advantage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    batch, advantage = _batch(args.rows, args.prompt, args.response, 400)
    results = {}
    for kind, rank, lr in (("lora", 8, 1e-2), ("full", 0, 1e-4)):
        settings = TrainerSettings(model=str(model), device=args.device, lora_rank=rank, lr=lr,
                                   mini_batch_size=args.rows, micro_batch_size=min(args.rows, 16))
        with PolicyUpdater(model, settings) as updater:
            before = updater.log_probs(batch)
            times, losses, grads = [], [], []
            for _ in range(args.steps):
                t = time.perf_counter()
                metrics = updater.update(batch)
                times.append(time.perf_counter() - t)
                losses.append(metrics["loss"])
                grads.append(metrics["grad_norm"])
            after = updater.log_probs(batch)
            device = str(updater.device)
        change = (after - before).mean(dim=1)
        ok = all(map(lambda x: x == x and abs(x) != float("inf"), losses)) and min(grads) > 0 and \
            float(change[advantage > 0].mean()) > float(change[advantage < 0].mean())
        results[kind] = {"device": device, "first_step_s": times[0],
                         "median_step_s": statistics.median(times[1:] or times), "loss": losses,
                         "grad_norm": grads, "logprob_change_pos_adv": float(change[advantage > 0].mean()),
                         "logprob_change_neg_adv": float(change[advantage < 0].mean()), "checks_pass": ok}
        print(f"{kind}: device {device} | first step {times[0]:.2f}s | median {results[kind]['median_step_s']:.3f}s | "
              f"loss {losses[0]:.4f}->{losses[-1]:.4f} | grad {grads[0]:.3f} | dlogp +adv "
              f"{results[kind]['logprob_change_pos_adv']:+.4f} -adv {results[kind]['logprob_change_neg_adv']:+.4f} "
              f"| {'OK' if ok else 'FAILED'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

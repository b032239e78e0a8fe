"""One verl update, measured on whatever device is here: the step the trainer repeats.

    python -m bench.update_step [--device auto|cpu|cuda] [--rows 32] [--response 64] [--steps 5]
                                [--shape tiny|qwen2.5-1.5b|llama3-8b|smollm2-135m] [--kinds lora:8,full]

Builds the model on the spot (no hub): a tiny Qwen2, or a real model's shape from `bench.shapes`
with random weights (timing depends on the shape, not on the weights). Then a GRPO batch of
`rows` random prompt/response pairs in four groups, and `PolicyUpdater.update` `steps` times for
each kind (`lora:RANK` or `full`). Prints per kind: the updater's start (model load, engine,
optimizer), first and median step, the LoRA adapter's export, peak device memory; and checks what
a working update must show: finite loss, non-zero gradient, response tokens of positive advantage
more likely. Used to record GPU runs (CI has no GPU; the CPU path is covered by tests/trainer).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import shapes
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


def _random_model(shape: str, out: Path, device: str) -> Path:
    """`bench.shapes`' folder for `shape` with random bf16 weights, made on `device` (fast for 8B on a GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes.build(shape, out)
    config = AutoConfig.from_pretrained(out)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.save_pretrained(out)
    del model
    return out


def _ranks(spec: str) -> list[int]:
    """`lora:8,full` -> [8, 0]: the LoRA rank of each kind, 0 for full weights."""
    ranks = []
    for item in spec.split(","):
        name, _, rank = item.strip().partition(":")
        if name not in ("lora", "full") or (name == "lora") != rank.isdigit():
            raise SystemExit(f"--kinds: {item!r} is neither lora:RANK nor full")
        ranks.append(int(rank or 0))
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--shape", default="tiny", choices=["tiny", *sorted(shapes.SHAPES)])
    parser.add_argument("--kinds", default="lora:8,full", help="comma-separated lora:RANK and full")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the results here (after each kind)")
    args = parser.parse_args()
    if args.rows < 8 or args.rows % 4:  # groups of one have advantage 0: nothing to check the update against
        parser.error("--rows: a multiple of 4, at least 8 (4 GRPO groups of 2 or more)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp())
    cuda = args.device != "cpu" and torch.cuda.is_available()
    started = time.perf_counter()
    if args.shape == "tiny":
        model, vocab = build_tiny_model(work / "tiny"), 400
    else:
        model = _random_model(args.shape, work / args.shape, "cuda" if cuda else "cpu")
        vocab = int(shapes.SHAPES[args.shape]["vocab_size"])
    print(f"model {args.shape}: built in {time.perf_counter() - started:.1f}s", flush=True)
    batch, advantage = _batch(args.rows, args.prompt, args.response, vocab)
    results: dict[str, Any] = {"shape": args.shape, "rows": args.rows, "prompt": args.prompt,
                                  "response": args.response}
    for rank in _ranks(args.kinds):
        # Small steps for real sizes: the check below wants the update's direction, not a jump.
        lr = (1e-2 if rank else 1e-4) if args.shape == "tiny" else (1e-4 if rank else 1e-5)
        settings = TrainerSettings(model=str(model), device=args.device, lora_rank=rank, lora_alpha=max(rank, 1) * 2,
                                   lr=lr, mini_batch_size=args.rows, micro_batch_size=min(args.rows, args.micro_batch))
        if cuda:  # the previous kind's updater is gone: its memory must not count in this one's peak
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        with PolicyUpdater(model, settings) as updater:
            start_s = time.perf_counter() - t
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
            export_s = None
            if rank:  # what a LoRA push hands the replicas
                t = time.perf_counter()
                updater.export(work / f"adapter-{rank}", "lora")
                export_s = time.perf_counter() - t
        peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        change = (after - before).mean(dim=1)
        ok = all(map(lambda x: x == x and abs(x) != float("inf"), losses)) and min(grads) > 0 and \
            float(change[advantage > 0].mean()) > float(change[advantage < 0].mean())
        label = f"lora{rank}" if rank else "full"
        results[label] = {"device": device, "start_s": start_s, "first_step_s": times[0],
                          "median_step_s": statistics.median(times[1:] or times), "export_lora_s": export_s,
                          "peak_device_gib": peak_gib, "loss": losses, "grad_norm": grads,
                          "logprob_change_pos_adv": float(change[advantage > 0].mean()),
                          "logprob_change_neg_adv": float(change[advantage < 0].mean()), "checks_pass": ok}
        print(f"{label}: device {device} | start {start_s:.1f}s | first step {times[0]:.2f}s | median "
              f"{statistics.median(times[1:] or times):.3f}s | export {'-' if export_s is None else f'{export_s:.2f}s'}"
              f" | peak {'-' if peak_gib is None else f'{peak_gib:.1f} GiB'} | loss {losses[0]:.4f}->{losses[-1]:.4f}"
              f" | grad {grads[0]:.3f} | dlogp +adv {results[label]['logprob_change_pos_adv']:+.4f} -adv "
              f"{results[label]['logprob_change_neg_adv']:+.4f} | {'OK' if ok else 'FAILED'}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

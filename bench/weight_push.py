"""How long a policy takes to reach a replica, per method, through the proxy's admin API.

    python -m bench.weight_push [--shape tiny|qwen2.5-1.5b|llama3-8b|smollm2-135m] [--backend ipc|shm]
                                [--repeat 3] [--lora-ranks 16,64] [--lora-transports path,bytes] [--out JSON]
                                [--servers N] [--api-servers A] [--merge-rank R] [--methods memory,disk]

Full weights, each round on freshly changed weights, both ways in turn, to one replica started
for both (`--weight-transfer-config`, dev mode):
- in memory: the trainer's tensors staged by `trainer.transfer` (`ipc`: CUDA IPC handles, the
  replica on the same GPU; `shm`: a host shared-memory segment, CPU replicas), then
  `WeightPusher.push_full_in_memory`;
- disk: the same weights written as a Hugging Face folder (`save_pretrained`, what the trainer's
  export does) and `WeightPusher.push_full` (`reload_weights`).
After each push, greedy completions through the proxy in waves until every front end has answered
one (each of `--servers` servers behind the proxy, and each of its `--api-servers` API server
processes, read from the server's access log): every front end must answer, none of the calls may
give an answer the version before gave (a front end left on the old weights would), the two methods
must give the same answer each round (the same numbers arrived), and the answers must change from
round to round. Whether the calls of one version all gave one answer is reported too
(`every_front_end_agrees`): on CPU they do, but a GPU serving random weights in bf16 breaks the
near-ties of their flat logits differently as the batch around a call changes (the 8B shape on an
H100, 2026-12-07: two or three answers among 32 greedy calls, the base model's included), so it is
not what the run is judged on.

`--merge-rank R` pushes what `trainer.lora_serve = merged` pushes: each round a fresh random
rank-R adapter on every linear layer (PEFT, as the trainer trains one), merged into the base
weights by the trainer's own `trainer.transfer.merged_parameters` while they are staged; in memory
only (`--methods memory`).

LoRA (with `--lora-ranks`): a second replica with runtime LoRA behind its own proxy; per rank and
transport, three versions of a random adapter of that rank on every linear layer, each pushed
(`WeightPusher.push_lora`) and then called once (the first call on a new adapter).

Model shapes come from `bench.shapes` with random weights made on the spot (nothing downloaded;
push time depends on the shape, not the weights); the full-weight replica reads them from disk at
start (one started from dummy weights refuses a reload), the LoRA replica starts with
`--load-format dummy`. `tiny` is the tests' tiny model. Needs vLLM (`ROLLTAP_VLLM_PYTHON` or `.venv-vllm`)
with the `rolltap_vllm` plugin (for `shm` and the `bytes` transport).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from bench import shapes
from bench.harness import REPO_ROOT, free_port, machine, stop_process, wait_ready
from bench.lora_push import LORA_TARGETS, random_adapter
from tools.replica import VllmReplica
from trainer import transfer
from trainer.weights import WeightPusher

TOKEN = "bench-admin-token"
ADAPTER_TOKEN = "bench-adapter-token"
# Greedy calls a wave sends at once: enough open connections that each API server of a server
# accepts some (the kernel hands a server's connections to its API server processes).
WAVE_CALLS = 32
MAX_WAVES = 10


def _model_dir(shape: str, out: Path) -> Path:
    if shape == "tiny":
        from tools.tiny_model import build_tiny_model

        return build_tiny_model(out)
    return shapes.build(shape, out)


def _random_model(model_dir: Path, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    model.requires_grad_(False)
    return model


@contextmanager
def _proxy(replicas: list[str], mode: str, logs: Path, port: int | None = None) -> Iterator[str]:
    port = port or free_port()
    env = {**os.environ, "ROLLTAP_PROXY__ADMIN_TOKEN": TOKEN, "ROLLTAP_PROXY__ADAPTER_TOKEN": ADAPTER_TOKEN,
           "ROLLTAP_PROXY__OPEN_ACCESS": "true", "ROLLTAP_PROXY__POOL__WEIGHT_MODE": mode,
           "ROLLTAP_PROXY__LOG_LEVEL": "warning", "ROLLTAP_PROXY__RECORDER__SPOOL_DIR": str(logs / f"spool-{mode}")}
    log = open(logs / f"proxy-{mode}.log", "wb")  # noqa: SIM115
    flags = [arg for url in replicas for arg in ("--replica", url)]
    proc = subprocess.Popen([sys.executable, "-m", "proxy.main", "--port", str(port), *flags,
                             "--db", f"sqlite:///{logs / f'proxy-{mode}.db'}"], env=env, cwd=REPO_ROOT,
                            stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, "/readyz", proc, 120.0, log_path=logs / f"proxy-{mode}.log")
        yield url
    finally:
        stop_process(proc, 10.0)
        log.close()


def _greedy(proxy: str, rollout: str, model: str = "x") -> tuple[list[int], float]:
    started = time.perf_counter()
    r = httpx.post(f"{proxy}/rollout/{rollout}/attempt/0/v1/completions", timeout=600, json={
        "model": model, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"]), time.perf_counter() - started


def _perturb(model: Any, seed: int) -> None:
    """New weights: noise on every parameter, or (a PEFT model) a new random adapter."""
    torch.manual_seed(seed)
    adapter = hasattr(model, "peft_config")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not adapter:
                p.add_(torch.randn_like(p), alpha=0.02)
            elif "lora_" in name:
                p.normal_(0.0, 0.05)  # B @ A then moves a weight by ~0.01: greedy answers change


def _with_adapter(model: Any, rank: int) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0)
    return get_peft_model(model, config)


def _replica_weights(model: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """What a replica loads: the parameters, or a PEFT model's merged as the trainer merges them."""
    return transfer.merged_parameters(model) if hasattr(model, "peft_config") else model.named_parameters()


class _Staging:
    """The trainer's side of one in-memory push: the model's tensors staged, then released."""

    def __init__(self, model: Any, backend: transfer.Backend) -> None:
        self._model, self._backend = model, backend
        self._staged: transfer.StagedWeights | None = None

    def stage(self) -> dict[str, Any]:
        self._staged = transfer.stage(_replica_weights(self._model), self._backend)
        assert self._staged.update_info is not None
        return self._staged.update_info

    def release(self) -> None:
        if self._staged is not None:
            self._staged.release()


def _replica_args(args: argparse.Namespace, device: str, dummy: bool) -> list[str]:
    extra = ["--load-format", "dummy"] if dummy else []
    if device == "cuda":
        extra += ["--enforce-eager", "--gpu-memory-utilization", "0.08", "--kv-cache-memory", str(args.kv_bytes)]
    return extra + list(args.replica_arg)


class _FrontEnds:
    """Which front ends (server, API server process) answered completions, from the servers' logs."""

    def __init__(self, replicas: list[VllmReplica], api_servers: int) -> None:
        self._replicas = replicas
        self.expected = {(i, f"ApiServer_{k}" if api_servers > 1 else "server")
                         for i in range(len(replicas)) for k in range(api_servers)}
        self._offsets: list[int] = []

    def mark(self) -> None:
        self._offsets = [r.log_size() for r in self._replicas]

    def served(self) -> set[tuple[int, str]]:
        return {(i, name) for i, (replica, offset) in enumerate(zip(self._replicas, self._offsets, strict=True))
                for name in replica.front_ends_served(offset, "completions")}


def _spread(proxy: str, fronts: _FrontEnds, name: str, pool: ThreadPoolExecutor) -> dict[str, Any]:
    """Greedy calls through the proxy in waves until every front end answered one (or `MAX_WAVES`)."""
    fronts.mark()
    answers: set[tuple[int, ...]] = set()
    calls = 0
    for wave in range(MAX_WAVES):
        got = [answer for answer, _ in pool.map(_greedy, [proxy] * WAVE_CALLS,
                                                 [f"{name}-{wave}-{i}" for i in range(WAVE_CALLS)])]
        answers |= {tuple(a) for a in got}
        calls += len(got)
        if fronts.served() >= fronts.expected:
            break
    served = fronts.served()
    return {"answer": sorted(answers)[0], "answers": len(answers), "calls": calls,
            "front_ends": len(served & fronts.expected), "of_front_ends": len(fronts.expected),
            "all_answers": sorted(answers)}


def _full_rounds(args: argparse.Namespace, model_dir: Path, work: Path, device: str, dtype: str,
                 results: dict[str, Any]) -> dict[str, Any]:
    """The full-weight rounds, written to `--out` after each (`results["full"]`): a run cut short keeps them."""
    backend = "ipc" if args.backend == "ipc" else "rolltap_shm"
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if args.backend == "ipc" else {}
    methods = args.methods.split(",")
    # A replica that started from dummy weights cannot reload from disk (vLLM refuses): the shape's random
    # weights are written first and the replica reads them at start.
    model = _random_model(model_dir, device, getattr(torch, dtype))
    if args.shape != "tiny":
        model.save_pretrained(model_dir, safe_serialization=True)
    if args.merge_rank:
        model = _with_adapter(model, args.merge_rank)
    replicas = [VllmReplica(model_dir, served_model_name="x", dev_mode=True, dtype=dtype, max_model_len=256,
                            extra_env=env, log_path=work / f"replica-full-{i}.log", api_servers=args.api_servers,
                            extra_args=["--weight-transfer-config", json.dumps({"backend": backend}),
                                        *_replica_args(args, device, dummy=False)])
                for i in range(args.servers)]
    fronts = _FrontEnds(replicas, args.api_servers)
    rounds: list[dict[str, Any]] = []
    with ExitStack() as stack:
        for replica in replicas:  # one after another: vLLM's memory profiling breaks when they start together
            stack.enter_context(replica)
        proxy = stack.enter_context(_proxy([r.url for r in replicas], "full", work))
        pusher = stack.enter_context(WeightPusher(proxy, TOKEN, timeout_s=900))
        pool = stack.enter_context(ThreadPoolExecutor(WAVE_CALLS))
        # What a replica loads is the base parameters' size (a merged weight keeps its base's shape and dtype).
        size = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "lora_" not in name)
        print(f"full weights: {size / 2**30:.2f} GiB in {dtype} on {device}, {args.servers} server(s) of "
              f"{args.api_servers} API server(s)", flush=True)
        base = _spread(proxy, fronts, "base", pool)
        full = results["full"] = {"bytes": size, "servers": args.servers, "api_servers": args.api_servers,
                                  "merge_rank": args.merge_rank, "base": base, "rounds": rounds}
        version = 0
        before = {tuple(a) for a in base["all_answers"]}  # what the version before answered
        for r in range(args.repeat):
            _perturb(model, r)
            row: dict[str, Any] = {"round": r}
            said: list[str] = []
            if "memory" in methods:
                staging = _Staging(model, args.backend)
                version += 1
                mem = pusher.push_full_in_memory(version, served_name="x", stage=staging.stage,
                                                 release=staging.release)
                row |= {"in_memory_s": round(mem.seconds, 3), "staged_s": round(mem.staged_s, 3),
                        "memory": _spread(proxy, fronts, f"mem-{r}", pool)}
                said.append(f"in memory ({args.backend}) {mem.seconds:.2f}s (staging {mem.staged_s:.2f}s)")
            if "disk" in methods:
                folder = work / "weights"
                t = time.perf_counter()
                model.save_pretrained(folder, safe_serialization=True)
                export_s = time.perf_counter() - t
                version += 1
                disk = pusher.push_full(version, folder, served_name="x")
                row |= {"disk_export_s": round(export_s, 3), "disk_reload_s": round(disk.seconds, 3),
                        "disk_total_s": round(export_s + disk.seconds, 3),
                        "disk": _spread(proxy, fronts, f"disk-{r}", pool)}
                said.append(f"disk {export_s + disk.seconds:.2f}s (export {export_s:.2f}s, reload {disk.seconds:.2f}s)")
            checks = [row[m] for m in methods]
            now = {tuple(a) for c in checks for a in c["all_answers"]}
            row |= {"answer": checks[0]["answer"], "same_answer": len({tuple(c["answer"]) for c in checks}) == 1,
                    "every_front_end_reached": all(c["front_ends"] == c["of_front_ends"] for c in checks),
                    "no_answer_of_the_version_before": not now & before,
                    "every_front_end_agrees": all(c["answers"] == 1 and c["front_ends"] == c["of_front_ends"]
                                                  for c in checks)}
            before = now
            rounds.append(row)
            _write(results, args.out)
            print(f"round {r}: {'; '.join(said)}; same answer: {row['same_answer']}; every front end "
                  f"({checks[0]['of_front_ends']}) reached: {row['every_front_end_reached']}, none answering as "
                  f"the version before: {row['no_answer_of_the_version_before']}, all alike: "
                  f"{row['every_front_end_agrees']}", flush=True)
    return full


def _lora_rounds(args: argparse.Namespace, model_dir: Path, work: Path, device: str, dtype: str) -> list[dict[str, Any]]:
    ranks = [int(r) for r in args.lora_ranks.split(",") if r]
    port = free_port()
    env = {"ROLLTAP_LORA_SOURCE": f"http://127.0.0.1:{port}", "ROLLTAP_LORA_TOKEN": ADAPTER_TOKEN,
           "ROLLTAP_LORA_CACHE_DIR": str(work / "replica-adapters")}
    replica = VllmReplica(model_dir, served_model_name="x", enable_lora=True, dtype=dtype, max_model_len=256,
                          extra_env=env, log_path=work / "replica-lora.log",
                          extra_args=[*_replica_args(args, device, dummy=args.shape != "tiny"),
                                      "--max-lora-rank", str(max(ranks))])
    rows: list[dict[str, Any]] = []
    # The replica's plugin fetches adapters from the proxy on the port it was told at its start.
    with replica, _proxy([replica.url], "lora", work, port) as proxy:
        version = 0
        for transport in args.lora_transports.split(","):
            with WeightPusher(proxy, TOKEN, timeout_s=900, lora_transport=transport) as pusher:
                for rank in ranks:
                    for _ in range(3):
                        version += 1
                        adapter = random_adapter(model_dir, rank, work / f"adapter-v{version}", seed=version)
                        result = pusher.push_lora(version, adapter, base_model="x")
                        _, first_call_s = _greedy(proxy, f"lora-{version}")
                        row = {"transport": transport, "rank": rank, "version": version,
                               "bytes": (adapter / "adapter_model.safetensors").stat().st_size,
                               "push_s": round(result.seconds, 3), "first_call_s": round(first_call_s, 3)}
                        rows.append(row)
                        print(f"LoRA r{rank} {transport} v{version}: push {result.seconds * 1000:.0f} ms, "
                              f"first call {first_call_s:.2f}s", flush=True)
    return rows


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def _write(results: dict[str, Any], out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *sorted(shapes.SHAPES)])
    parser.add_argument("--backend", choices=["ipc", "shm"], default=None,
                        help="in-memory transfer: ipc (CUDA; default with a GPU) or shm (host shared memory)")
    parser.add_argument("--repeat", type=int, default=3, help="full-weight rounds (each pushes both ways)")
    parser.add_argument("--lora-ranks", default="", help="LoRA ranks to push, e.g. 16,64 (empty: no LoRA replica)")
    parser.add_argument("--lora-transports", default="path,bytes")
    parser.add_argument("--kv-bytes", type=int, default=4_000_000_000, help="each GPU replica's KV cache")
    parser.add_argument("--servers", type=int, default=1, help="full-weight servers behind the proxy")
    parser.add_argument("--api-servers", type=int, default=1, help="API server processes per full-weight server")
    parser.add_argument("--merge-rank", type=int, default=0,
                        help="push a random LoRA adapter of this rank merged into the weights (lora_serve = merged)")
    parser.add_argument("--methods", default="memory,disk", help="full-weight pushes: memory, disk or both")
    parser.add_argument("--replica-arg", action="append", default=[], metavar="ARG", help="extra vLLM argument")
    parser.add_argument("--work", type=Path, default=None, help="folder for models, logs, adapters (default: temp)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if set(args.lora_transports.split(",")) - {"path", "bytes"}:
        parser.error("--lora-transports: path, bytes or both")
    if not args.methods or set(args.methods.split(",")) - {"memory", "disk"}:
        parser.error("--methods: memory, disk or both")
    if args.merge_rank and "disk" in args.methods.split(","):
        parser.error("--merge-rank: in memory only (--methods memory)")
    cuda = torch.cuda.is_available()
    args.backend = args.backend or ("ipc" if cuda else "shm")
    device = "cuda" if args.backend == "ipc" else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    work = args.work or Path(tempfile.mkdtemp(prefix="rolltap-weight-push-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(args.shape, work / args.shape)
    results: dict[str, Any] = {"shape": args.shape, "backend": args.backend, "device": device, "dtype": dtype,
                               "machine": machine()}
    if cuda:
        results["gpu"] = torch.cuda.get_device_name(0)
    full = _full_rounds(args, model_dir, work, device, dtype, results)
    answers = [tuple(full["base"]["answer"]), *(tuple(r["answer"]) for r in full["rounds"])]
    results["full_summary"] = {
        **{key: _summary([r[key] for r in full["rounds"]]) for key in ("in_memory_s", "staged_s", "disk_total_s",
                                                                      "disk_reload_s") if key in full["rounds"][0]},
        "same_answer_every_round": all(r["same_answer"] for r in full["rounds"]),
        "every_front_end_reached_every_round": all(r["every_front_end_reached"] for r in full["rounds"]),
        "no_answer_of_the_version_before_every_round": all(r["no_answer_of_the_version_before"]
                                                           for r in full["rounds"]),
        "every_front_end_agrees_every_round": all(r["every_front_end_agrees"] for r in full["rounds"]),
        "answers_change_between_rounds": len(set(answers)) == len(answers)}
    _write(results, args.out)  # kept should the LoRA part not finish
    if args.lora_ranks:
        results["lora"] = _lora_rounds(args, model_dir, work, device, dtype)
        _write(results, args.out)
    print(json.dumps(results["full_summary"]), flush=True)
    return 0 if all(results["full_summary"][key] for key in (
        "same_answer_every_round", "answers_change_between_rounds", "every_front_end_reached_every_round",
        "no_answer_of_the_version_before_every_round")) else 1


if __name__ == "__main__":
    raise SystemExit(main())

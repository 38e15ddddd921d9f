"""Which attention backend a device runs: Triton on CUDA, the compiled kernel on CPU, or the
torch reference."""

from __future__ import annotations

import logging

import torch

from gpu.attention.backend import AttentionBackend

log = logging.getLogger("weir.attention")


BACKENDS = ("auto", "cpu", "torch", "triton")


def triton_usable(device: torch.device) -> bool:
    """Triton runs compiled on CUDA, or anywhere under its interpreter (TRITON_INTERPRET=1)."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda"


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """auto: Triton on CUDA; on CPU the compiled kernel, or the torch reference (with a warning)
    when it cannot be built here."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            from gpu.cpu import build as cpu_build

            try:
                cpu_build.load()
                name = "cpu"
            except cpu_build.BuildError as e:
                log.warning("CPU attention kernel unavailable, using the torch reference: %s", e)
                name = "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("--attention-backend cpu runs on the CPU only")
        from gpu.cpu.attention import CpuAttention

        return CpuAttention()
    if name == "torch":
        from gpu.attention.torch_ref import TorchAttention

        return TorchAttention()
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(
                "--attention-backend triton needs a CUDA device (or TRITON_INTERPRET=1 "
                "to run the kernels in Triton's interpreter on CPU)"
            )
        from gpu.cuda.attention import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r} (choose one of {', '.join(BACKENDS)})")

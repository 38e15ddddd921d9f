"""What every CPU step reads whole (packed weights, the paged KV cache) lives in memory advised
for transparent huge pages (gpu/cpu/csrc/huge_pages.h): 2 MiB-aligned, in a mapping of its own
whose VmFlags carry `hg` (MADV_HUGEPAGE) wherever the kernel has THP and the process has not
turned it off; smaller tensors come from torch's allocator. Whether the kernel then gives huge
pages is the system's policy: not tested."""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpu import kv_cache
from gpu.cpu import build as cpu_build, gemm, quant
from gpu.quant.formats import FORMATS
from gpu.quant.gguf_random import random_blocks

HUGE = 2 << 20
PR_GET_THP_DISABLE = 42


def thp_allowed() -> bool:
    """The kernel has transparent huge pages and this process has not turned them off
    (prctl PR_SET_THP_DISABLE, which some service managers set): where madvise can mark memory."""
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) == 0


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= address < hi
        elif mapping and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def assert_huge(t: torch.Tensor) -> None:
    assert t.data_ptr() % HUGE == 0
    flags = vm_flags(t.data_ptr())  # read either way: the mapping must exist
    if thp_allowed():
        assert "hg" in flags


def test_packed_weights_are_advised_for_huge_pages():
    rng = np.random.default_rng(0)
    q4 = quant.pack(random_blocks("q4_k", 4096, 1024, rng), FORMATS["q4_k"], (4096, 1024))
    assert q4.packed.numel() >= HUGE
    assert_huge(q4.packed)
    w = torch.randn(1024, 1024)
    f32 = gemm.prepare(w, None)
    assert_huge(f32.packed)
    # the products read them as before
    x = torch.randn(3, 1024)
    torch.testing.assert_close(gemm.linear(x, f32), x @ w.T, rtol=1e-4, atol=1e-4)
    small = quant.pack(random_blocks("q8_0", 16, 64, rng), FORMATS["q8_0"], (16, 64))
    assert small.packed.numel() < HUGE  # torch's allocator: nothing to align
    torch.testing.assert_close(
        quant.linear(torch.ones(1, 64), small), torch.ones(1, 64) @ quant.dequantize(small).T
    )


def test_huge_zeros_is_zeroed_at_any_size_and_checks_its_size():
    ops = cpu_build.load()
    for shape, dtype in (([300, 16, 8, 64], torch.bfloat16), ([3, 5], torch.float32)):
        t = ops.huge_zeros(shape, dtype)
        assert list(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        t.fill_(1)  # writable, and freed when dropped
    with pytest.raises(ValueError, match="size"):
        ops.huge_zeros([4, -1], torch.float32)


def test_cpu_kv_cache_is_advised_for_huge_pages():
    cpu_build.load()
    spec = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=64)  # what allocate reads
    caches = kv_cache.allocate(spec, 512, 16, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == (512, 16, 2, 64) and not k.any() and not v.any()
        assert_huge(k)
        assert_huge(v)

"""The machine's memory read bandwidth: a 1 GiB buffer summed by 1 and by every core (OpenMP,
compiled here with the host's g++ once, -O3 -march=native), the best of 5 passes each. The
buffer is advised for transparent huge pages, as weir's weights are (gpu/cpu/csrc/huge_pages.h):
on 4 KiB pages the same VM read 5-10% less, a floor below what a server can reach. A model's
weights are read once a token at one stream, so this over the weights' bytes is the floor
(the fastest a token can be) that the serving benchmarks' one-stream figures are read against.

    python -m benchmarks.read_bandwidth          # prints {"1": GB/s, "N": GB/s}
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#include <sys/mman.h>
int main(int argc, char** argv) {
    const size_t n = size_t(1) << 27;  // 1 GiB of uint64
    uint64_t* buf = static_cast<uint64_t*>(aligned_alloc(size_t(2) << 20, n * 8));
    madvise(buf, n * 8, MADV_HUGEPAGE);  // before the first touch; advice only
#pragma omp parallel for
    for (size_t i = 0; i < n; ++i) buf[i] = i;
    for (int a = 1; a < argc; ++a) {
        const int threads = atoi(argv[a]);
        double best = 0;
        uint64_t sink = 0;
        for (int rep = 0; rep < 5; ++rep) {
            const auto t0 = std::chrono::steady_clock::now();
            uint64_t s = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : s) schedule(static)
            for (size_t i = 0; i < n; ++i) s += buf[i];
            const double dt =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            sink += s;
            if (n * 8 / dt / 1e9 > best) best = n * 8 / dt / 1e9;
        }
        printf("%d %.2f %llu\n", threads, best, (unsigned long long)(sink & 1));
    }
    return 0;
}
"""


def binary() -> Path:
    from gpu.cache import cache_dir

    key = hashlib.sha1(SOURCE.encode()).hexdigest()[:10]
    exe = cache_dir() / f"read_bandwidth-{key}"
    if not exe.exists():
        src = exe.with_suffix(".cpp")
        src.write_text(SOURCE)
        cxx = os.environ.get("CXX", "g++")
        flags = ["-O3", "-march=native", "-fopenmp"]
        subprocess.run([cxx, *flags, str(src), "-o", str(exe)], check=True)
    return exe


def measure(threads: list[int] | None = None) -> dict[int, float]:
    """GB/s read by each thread count (default: 1 and every core)."""
    threads = threads or sorted({1, len(os.sched_getaffinity(0))})
    out = subprocess.run(
        [str(binary()), *map(str, threads)], capture_output=True, text=True, check=True
    ).stdout
    return {int(line.split()[0]): float(line.split()[1]) for line in out.splitlines()}


if __name__ == "__main__":
    print(json.dumps(measure()))

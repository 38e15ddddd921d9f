"""Build and load the CPU kernels (cpu_attention.cpp, cpu_norm_rope.cpp, cpu_mask.cpp,
cpu_gemm.cpp, cpu_forward.cpp, cpu_sample.cpp, on the thread pool of cpu_pool.cpp) with the
host's C++ compiler.

The sources have a plain C ABI and no torch headers, so they compile in about a second. They are
built once per source, compiler and CPU into one library in weir's cache ($WEIR_CACHE, default
~/.cache/weir) with -march=native, and loaded with ctypes (whose calls release the GIL).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from gpu.cache import cache_dir

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / n
    for n in (
        "pool.cpp",
        "attention.cpp",
        "norm_rope.cpp",
        "mask.cpp",
        "gemm.cpp",
        "forward.cpp",
        "sample.cpp",
    )
]
HEADERS = [CSRC / n for n in ("pool.h", "attention_simd.h")]
# -ffast-math lets g++ vectorize exp (glibc's libmvec) and reassociate the dot products; it is
# given to the compile step only, so the link does not add crtfastmath.o, which would switch
# denormals to zero for the whole process (torch included). The kernel never forms inf or NaN.
COMPILE = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++17"]
LINK = ["-shared", "-fopenmp"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class BuildError(RuntimeError):
    pass


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cxx: str) -> Path:

    key = hashlib.sha256()
    for part in (
        *(src.read_bytes() for src in SOURCES + HEADERS),
        cxx.encode(),
        " ".join(COMPILE + LINK).encode(),
        _cpu_id().encode(),
    ):
        key.update(part)
    return cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile (if not already cached) and return the shared library's path."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    path = library_path(cxx)
    if path.exists():
        return path
    try:
        return _compile(cxx, path)
    except OSError as e:  # an unwritable cache, a vanished compiler: fall back, don't crash
        raise BuildError(f"could not build {path.name}: {e}") from e


def _compile(cxx: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objs = [str(Path(tmp) / (src.stem + ".o")) for src in SOURCES]
        out = Path(tmp) / path.name
        compiles = [[cxx, *COMPILE, "-c", str(src), "-o", o] for src, o in zip(SOURCES, objs)]
        for cmd in (*compiles, [cxx, *LINK, *objs, "-o", str(out)]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BuildError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(out, path)  # atomic: concurrent builders each publish a whole file
    return path


def load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            path = build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise BuildError(f"could not load {path}: {e}") from e
            fn = lib.weir_paged_attention
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            fn.argtypes = [p] * 7 + [i64] * 6 + [ctypes.c_float, i64, i64] + [ctypes.c_int] * 2
            fn.restype = ctypes.c_int
            fn = lib.weir_rms_norm_rope
            fn.argtypes = [p, i64, i64, i64, i64, p, ctypes.c_float, p, p, p, i64]
            fn.restype = None
            fn = lib.weir_apply_token_bitmask
            fn.argtypes = [p, i64, p, i64, p, i64, i64, ctypes.c_int]
            fn.restype = None
            fn = lib.weir_gemm_packed_size
            fn.argtypes = [i64, i64, ctypes.c_int]
            fn.restype = i64
            fn = lib.weir_gemm_pack
            fn.argtypes = [p, p, i64, i64, ctypes.c_int, p]
            fn.restype = None
            fn = lib.weir_gemm
            fn.argtypes = [p, i64, i64, i64, p, i64, ctypes.c_int, p, p, i64, p, i64, i64]
            fn.restype = None
            fn = lib.weir_decoder_forward
            fn.argtypes = [p, p]
            fn.restype = ctypes.c_int
            fn = lib.weir_argmax
            fn.argtypes = [p, i64, i64, i64, p, i64]
            fn.restype = None
            fn = lib.weir_forward_profile
            fn.argtypes = [p, ctypes.c_int]
            fn.restype = None
            fn = lib.weir_pool_selftest
            fn.argtypes = [i64, i64, i64, i64, p, p]
            fn.restype = None
            _lib = lib
        return _lib

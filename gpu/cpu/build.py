"""Build and load weir's CPU kernels as torch operators (torch.ops.weir, torch.classes.weir).

The kernel sources (csrc/*.cpp, declared once in csrc/weir.h) include no torch header: they
compile in about a second each with -O3 -march=native -ffast-math. Two sources, csrc/ops.cpp and
csrc/stack.cpp, register the operators and the stack's class with TORCH_LIBRARY and check every
tensor before it reaches a kernel (csrc/checks.h); they are compiled against torch's headers
with the include and library paths, C++ ABI and C++ standard torch.utils.cpp_extension gives,
then everything is linked into one library that torch.ops.load_library loads, against the
shared libstdc++ torch uses (never a static copy of it: check_runtime), exporting none of weir's
own symbols. The build runs the compiler directly (in parallel, no ninja needed on a fresh
machine) and is cached by the sources, compiler, flags, torch version and CPU in weir's cache
folder (gpu/cache.py), so it happens once per machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from gpu.cache import cache_dir

CSRC = Path(__file__).with_name("csrc")
KERNELS = [
    CSRC / n
    for n in (
        "pool.cpp",
        "attention.cpp",
        "norm_rope.cpp",
        "mask.cpp",
        "gemm.cpp",
        "forward.cpp",
        "moe.cpp",
        "sample.cpp",
        "lora.cpp",
    )
]
# The block- and 16-bit-format products: exact integer arithmetic and float operations in one
# order on every path, so no -ffast-math; the x86 paths are built for their instruction sets
# whatever this CPU has (quant.cpp runs each only where the CPU has it).
QUANT = [CSRC / "quant.cpp", CSRC / "quant_pack.cpp", CSRC / "gguf_blocks.cpp"]
QUANT_PATHS = {
    CSRC / "quant_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    CSRC / "quant_avx512.cpp": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
        "-mavx512bf16",
        "-mfma",
        "-mf16c",
    ],
}
X86 = platform.machine().lower() in ("x86_64", "amd64")
# the torch operators and the stack's class
BINDINGS = [CSRC / "ops.cpp", CSRC / "quant_ops.cpp", CSRC / "stack.cpp"]
HEADERS = [
    CSRC / n
    for n in (
        "weir.h",
        "decoder.h",
        "attention_simd.h",
        "checks.h",
        "huge_pages.h",
        "activation.h",
        "quant_layout.h",
        "gguf_blocks.h",
        "stack_gpt_oss.h",
        "stack_lora.h",
        "stack_kv_scales.h",
        "stack_gemma.h",
        "stack_shared.h",
        "stack_bias.h",
    )
]
# -ffast-math lets g++ vectorize exp (glibc's libmvec) and reassociate the dot products; it is
# given to the kernels' compile step only, so the link does not add crtfastmath.o, which would
# switch denormals to zero for the whole process (torch included). The kernels never form inf
# or NaN. OpenMP: mask.cpp's row loop and the kernels' simd loops.
COMPILE = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++17"]
# ops.cpp, stack.cpp: torch's headers need C++20; nothing there is hot.
COMPILE_BINDINGS = ["-O2", "-fPIC", "-std=c++20", "-w"]
COMPILE_QUANT = ["-O3", "-fopenmp", "-fPIC", "-std=c++17", "-ffp-contract=off"]
# The library exports nothing of its own: the operators reach torch through TORCH_LIBRARY's
# static registration, not through symbols. Every source is compiled with hidden visibility
# (what stays exported is torch's and the standard library's types' typeinfo and vtables), and
# what a static archive brings (libgcc's CPU detection) stays inside, so none of weir's
# definitions stands in for another library's, nor another library's for one of weir's.
HIDDEN = ["-fvisibility=hidden"]
LINK = ["-shared", "-fopenmp", "-shared-libgcc", "-Wl,--exclude-libs,ALL"]


# The C++ runtime must be the process's own libstdc++.so.6, the one torch's libraries use: a
# compiler that links libstdc++ statically (-static-libstdc++ in its specs or wrapper: seen on a
# GPU machine's image) gives the library a private copy whose locale code runs on the process's
# facet ids (GNU-unique symbols bind process-wide), so the first `<<` of an integer into a
# check's message crashed, or the message lost its numbers. Named here, after the objects and
# torch's libraries and before anything the driver appends, the shared library resolves every
# reference first, and a static archive after it is never pulled in. It is named by the path
# of the file this process has loaded: on that image `-lstdc++` found only the static archive
# (no libstdc++.so in the linker's search path), even under -Bdynamic. check_runtime() verifies.
def link_runtime() -> list[str]:
    """The link flags that make the library need the process's own shared libstdc++."""
    loaded = _loaded_libstdcxx()
    return ["-Wl,--push-state,--no-as-needed,-Bdynamic", loaded or "-lstdc++", "-Wl,--pop-state"]


def _loaded_libstdcxx() -> str | None:
    """The path of the libstdc++.so this process has mapped (torch's libraries need it), or None
    (not Linux, or not loaded)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:  # address, permissions, offset, device, inode, path
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libstdc++.so"):
            return fields[5]
    return None


_lock = threading.Lock()
_ops = None  # torch.ops.weir once the library is loaded


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


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags for a source built against torch, as cpp_extension builds one."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    link = [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
    link += ["-lc10", "-ltorch_cpu", "-ltorch"]
    return [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes], link


def library_path(cxx: str) -> Path:
    key = hashlib.sha256()
    for part in (
        *(src.read_bytes() for src in [*KERNELS, *QUANT, *QUANT_PATHS, *BINDINGS, *HEADERS]),
        cxx.encode(),
        " ".join(
            COMPILE + COMPILE_BINDINGS + COMPILE_QUANT + HIDDEN + LINK + link_runtime()
        ).encode(),
        str(QUANT_PATHS).encode(),
        torch.__version__.encode(),
        _cpu_id().encode(),
    ):
        key.update(part)
    return cache_dir() / "kernels" / f"weir_ops-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile (if not already cached) and return the shared library's path."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    path = library_path(cxx)
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One builder at a time: processes starting together (test workers, tensor-parallel
        # ranks) wait for the first one's library instead of each compiling it on the same
        # cores (eight pytest workers on a 16-core GPU machine took over two minutes each).
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return path if path.exists() else _compile(cxx, path)
    except OSError as e:  # an unwritable cache, a vanished compiler: fall back, don't crash
        raise BuildError(f"could not build {path.name}: {e}") from e


def _run_all(cmds: list[list[str]]) -> None:
    """Run the compile commands side by side; the first failure is a BuildError."""
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for cmd in cmds
    ]
    failed = None
    for cmd, proc in zip(cmds, procs):
        _, err = proc.communicate()
        if proc.returncode != 0 and failed is None:
            failed = f"{' '.join(cmd)} failed:\n{err[-4000:]}"
    if failed:
        raise BuildError(failed)


def link_command(cxx: str, objs: list[str], out: Path, libs: list[str]) -> list[str]:
    """The command that links `objs` into the shared library `out` against `libs` (torch's)."""
    return [cxx, *LINK, *objs, "-o", str(out), *libs, *link_runtime()]


# Definitions that only a copy of the C++ runtime has (libstdc++'s locale, libsupc++'s throw).
_RUNTIME_SYMBOLS = {"_ZNSt6locale7classicEv", "__cxa_throw", "__gxx_personality_v0"}


def elf_dynamic(path: Path) -> tuple[list[str], set[str]]:
    """(DT_NEEDED entries, names of the dynamic symbols it defines) of a 64-bit little-endian
    ELF shared library; ([], set()) for any other file."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return [], set()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]  # name, type, flags, addr, offset, size, link, info, addralign, entsize

    def string(table: int, at: int) -> str:
        start = sections[table][4] + at
        return data[start : data.index(b"\0", start)].decode()

    needed, defined = [], set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind == 6:  # SHT_DYNAMIC
            for at in range(offset, offset + size, entsize or 16):
                tag, val = struct.unpack_from("<qQ", data, at)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(string(link, val))
        elif kind == 11:  # SHT_DYNSYM
            for at in range(offset + (entsize or 24), offset + size, entsize or 24):
                name, info, other, shndx = struct.unpack_from("<IBBH", data, at)
                if shndx != 0 and info >> 4 in (1, 2, 10) and other & 3 in (0, 3):
                    defined.add(string(link, name))  # global, weak or unique; not hidden
    return needed, defined


def check_runtime(lib: Path) -> None:
    """A BuildError unless `lib` uses the process's shared libstdc++ and brings no copy of the
    C++ runtime of its own (see link_runtime)."""
    needed, defined = elf_dynamic(lib)
    if not needed and not defined:
        return  # not an ELF library: nothing to check here
    own = sorted(_RUNTIME_SYMBOLS & defined)
    if own or not any(n.startswith("libstdc++.so") for n in needed):
        raise BuildError(
            f"{lib.name}: the C++ runtime was linked into the library (needs {needed}, defines "
            f"{own}), not taken from the shared libstdc++; a compiler that links libstdc++ "
            "statically cannot build weir's kernels (set CXX to another)"
        )


def _compile(cxx: str, path: Path) -> Path:
    torch_compile, torch_link = _torch_flags()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        flags = {src: COMPILE for src in KERNELS}
        flags.update({src: [*COMPILE_QUANT, "-march=native"] for src in QUANT})
        if X86:
            flags.update({src: [*COMPILE_QUANT, *isa] for src, isa in QUANT_PATHS.items()})
        flags.update({src: [*COMPILE_BINDINGS, *torch_compile] for src in BINDINGS})
        sources = list(flags)
        objs = [str(Path(tmp) / (src.stem + ".o")) for src in sources]
        out = Path(tmp) / path.name
        compiles = [
            [cxx, *flags[src], *HIDDEN, "-c", str(src), "-o", o] for src, o in zip(sources, objs)
        ]
        _run_all(compiles)
        _run_all([link_command(cxx, objs, out, torch_link)])
        check_runtime(out)
        os.replace(out, path)  # atomic: concurrent builders each publish a whole file
    return path


def load():
    """torch.ops.weir, the library built and loaded on first use (BuildError when it cannot
    be built here)."""
    global _ops
    if _ops is not None:
        return _ops
    with _lock:
        if _ops is None:
            path = build()
            try:
                torch.ops.load_library(str(path))
            except OSError as e:
                raise BuildError(f"could not load {path}: {e}") from e
            _ops = torch.ops.weir
    return _ops


def loaded():
    """torch.ops.weir if this process has loaded it already, else None (never builds)."""
    return _ops


def classes():
    """torch.classes.weir (DecoderStack), the library loaded first."""
    load()
    return torch.classes.weir

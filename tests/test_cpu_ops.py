"""The CPU kernels' torch operators (gpu/cpu/csrc/ops.cpp): each is declared once, by its
schema, and every tensor is checked before a kernel sees a pointer. A wrong argument is an
exception, never a read or write out of bounds."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from gpu.cpu import build as cpu_build


@pytest.fixture(scope="module")
def ops():
    return cpu_build.load()


def test_the_schema_checks_types_and_arity(ops):
    x, w = torch.randn(3, 8), torch.randn(70, 8)
    packed = ops.gemm_pack(w, None)
    assert torch.allclose(ops.gemm(x, packed, 70, 0, None, None), x @ w.T, atol=1e-5)
    with pytest.raises(RuntimeError):
        ops.gemm(x, packed, 70, 0, None)  # an argument short
    with pytest.raises(RuntimeError):
        ops.gemm(x.data_ptr(), packed, 70, 0, None, None)  # a pointer is not a tensor


@pytest.mark.parametrize(
    "case",
    [
        "wrong n",  # packed for 70 outputs, asked for 200: it would read past the panels
        "wrong k",  # x wider than the weight
        "bias length",
        "residual shape",
        "float64 x",
        "strided x",
        "gated with a bias",
    ],
)
def test_a_wrong_argument_is_an_exception(ops, case):
    x, w = torch.randn(3, 8), torch.randn(70, 8)
    packed = ops.gemm_pack(w, None)
    args = dict(x=x, packed=packed, n=70, gated=0, bias=None, residual=None)
    if case == "wrong n":
        args["n"] = 200
    elif case == "wrong k":
        args["x"] = torch.randn(3, 9)
    elif case == "bias length":
        args["bias"] = torch.randn(69)
    elif case == "residual shape":
        args["residual"] = torch.randn(3, 60)
    elif case == "float64 x":
        args["x"] = x.double()
    elif case == "strided x":
        args["x"] = torch.randn(8, 3).T
    elif case == "gated with a bias":
        args.update(gated=1, bias=torch.randn(70))
    with pytest.raises((ValueError, RuntimeError)):
        ops.gemm(*args.values())


def test_paged_indexes_are_checked(ops):
    """Block ids, sequence lengths and query offsets: what the attention kernel follows."""
    q = torch.randn(2, 4, 16)
    k = torch.randn(3, 4, 2, 16)
    v = torch.randn(3, 4, 2, 16)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    qs = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([6], dtype=torch.int32)
    ok = ops.paged_attention(q, k, v, tables, qs, lens, 0.25, 0)
    assert ok.shape == q.shape
    for bad_tables, bad_qs, bad_lens in (
        (torch.tensor([[0, 7]], dtype=torch.int32), qs, lens),  # a block past the cache
        (tables, qs, torch.tensor([9], dtype=torch.int32)),  # keys past the table
        (tables, torch.tensor([0, 3], dtype=torch.int32), lens),  # rows past the query
        (tables, qs, torch.tensor([1], dtype=torch.int32)),  # fewer keys than query rows
    ):
        with pytest.raises(IndexError):
            ops.paged_attention(q, k, v, bad_tables, bad_qs, bad_lens, 0.25, 0)
    with pytest.raises(ValueError):  # a cache wider than its query
        ops.paged_attention(q.bfloat16(), k, v, tables, qs, lens, 0.25, 0)
    with pytest.raises(IndexError):
        ops.apply_token_bitmask_(
            torch.zeros(2, 40), torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int32)
        )


def test_a_checks_message_keeps_its_numbers(ops):
    """A message is formatted with the C++ runtime's streams: with a private copy of libstdc++ in
    the library (a compiler that linked it statically) the first integer crashed the process on
    one machine and cut the message short on another."""
    x, w = torch.randn(3, 8), torch.randn(70, 8)
    packed = ops.gemm_pack(w, None)
    want = ops.gemm_pack(torch.randn(200, 8), None).numel()
    with pytest.raises(ValueError, match=rf"^packed: needs {want} elements, got {packed.numel()}$"):
        ops.gemm(x, packed, 200, 0, None, None)
    with pytest.raises(ValueError, match=r"^bias: needs 70 elements, got 69$"):
        ops.gemm(x, packed, 70, 0, torch.randn(69), None)


def test_the_library_uses_the_processes_cpp_runtime_and_hides_its_own_symbols(ops):
    """The library needs the shared libstdc++ (torch's), defines no part of a C++ runtime, and
    exports none of weir's own functions: nothing in it can stand in for another library's
    definition, nor another's for one of it."""
    needed, defined = cpu_build.elf_dynamic(cpu_build.build())
    assert any(n.startswith("libstdc++.so") for n in needed), needed
    assert not {"_ZNSt6locale7classicEv", "__cxa_throw", "__gxx_personality_v0"} & defined
    ours = ("_ZN4weir", "_ZN8weir_ops", "_ZN12DecoderStack", "_Z12stack_weight", "__cpu_")
    assert not sorted(d for d in defined if d.startswith(ours))


def _static_libstdcxx_compiler(tmp_path):
    """A compiler whose every link takes libstdc++ statically, and where `-lstdc++` finds only
    the static archive (as a GPU machine's image did: there `-Bdynamic -lstdc++` still linked the
    archive), and an object that formats an integer with a stream."""
    cxx = cpu_build.compiler()
    assert cxx is not None, "no C++ compiler: weir's CPU kernels cannot be built either"
    archive = subprocess.run(
        [cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(archive).is_file(), f"{cxx} has no static libstdc++ to emulate that image with"
    static_only = tmp_path / "static-only"
    static_only.mkdir()
    (static_only / "libstdc++.a").symlink_to(archive)
    wrapper = tmp_path / "cxx-static"
    wrapper.write_text(f'#!/bin/sh\nexec "{cxx}" "$@" -L"{static_only}" -static-libstdc++\n')
    wrapper.chmod(0o755)
    src = tmp_path / "fmt.cpp"
    src.write_text(
        "#include <sstream>\n#include <string>\n"
        "std::string fmt(long v) { std::ostringstream s; s << v; return s.str(); }\n"
    )
    obj = tmp_path / "fmt.o"
    subprocess.run([str(wrapper), "-fPIC", "-c", str(src), "-o", str(obj)], check=True)
    return str(wrapper), str(obj)


def test_a_compiler_that_links_libstdcxx_statically_still_gets_the_shared_one(tmp_path):
    wrapper, obj = _static_libstdcxx_compiler(tmp_path)
    lib = tmp_path / "good.so"
    subprocess.run(cpu_build.link_command(wrapper, [obj], lib, []), check=True)
    cpu_build.check_runtime(lib)  # no BuildError
    needed, _ = cpu_build.elf_dynamic(lib)
    assert any(n.startswith("libstdc++.so") for n in needed), needed


def test_a_library_with_its_own_cpp_runtime_is_a_build_error(tmp_path):
    wrapper, obj = _static_libstdcxx_compiler(tmp_path)
    lib = tmp_path / "bad.so"
    subprocess.run([wrapper, "-shared", obj, "-o", str(lib)], check=True)  # the link as it was
    with pytest.raises(cpu_build.BuildError, match="C\\+\\+ runtime was linked into"):
        cpu_build.check_runtime(lib)

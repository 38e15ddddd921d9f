"""The CPU kernels' torch operators (gpu/cpu/csrc/ops.cpp): each is declared once, by its
schema, and every tensor is checked before a kernel sees a pointer. A wrong argument is an
exception, never a read or write out of bounds."""

from __future__ import annotations

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

"""A weight as a checkpoint holds it in a block format (GGUF's Q8_0, Q4_K, ...): its rows of
bytes, read in place from the file (a memory map) or made by weir's quantizers, until a backend
takes it into its own form (gpu/cpu/quant.py packs it for weir's kernels; torch's backends
dequantize it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.quant.formats import Format


@dataclass
class BlockTensor:
    rows: np.ndarray  # uint8 [n, fmt.row_bytes(k)]
    fmt: Format
    shape: tuple[int, int]  # (n, k): output rows, weights per row

    def __post_init__(self) -> None:
        n, k = self.shape
        if k % self.fmt.block_size or self.rows.shape != (n, self.fmt.row_bytes(k)):
            raise ValueError(
                f"{self.fmt.name} tensor of shape {self.shape}: {self.rows.shape} bytes do not fit"
            )

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def take_rows(self, index: np.ndarray) -> BlockTensor:
        """The tensor with its output rows reordered (or a subset of them): whole rows of
        blocks move, so nothing is requantized."""
        rows = np.ascontiguousarray(self.rows[index])
        return BlockTensor(rows, self.fmt, (len(rows), self.shape[1]))

    def take_cols(self, start: int, stop: int, name: str = "tensor") -> BlockTensor:
        """The weights [start, stop) of every row (a row-parallel rank's share): whole blocks,
        so nothing is requantized; CheckpointError when the range cuts a block."""
        from core.config import CheckpointError

        size = self.fmt.block_size
        if start % size or stop % size or not 0 <= start < stop <= self.shape[1]:
            raise CheckpointError(
                f"{name}: columns [{start}, {stop}) are not whole {self.fmt.name} blocks of "
                f"{size}: this tensor-parallel size does not split it"
            )
        per = self.fmt.block_bytes
        rows = np.ascontiguousarray(self.rows[:, start // size * per : stop // size * per])
        return BlockTensor(rows, self.fmt, (self.shape[0], stop - start))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weights (the `gguf` package's reference dequantization)."""
        import gguf

        qtype = gguf.GGMLQuantizationType(self.fmt.ggml_type)
        return torch.from_numpy(gguf.quants.dequantize(self.rows, qtype)).to(dtype)


def cat_rows(parts: list[BlockTensor]) -> BlockTensor | None:
    """Weights stacked by output rows (Q/K/V as one product), or None when their formats
    differ."""
    fmt = parts[0].fmt
    if any(p.fmt != fmt or p.shape[1] != parts[0].shape[1] for p in parts):
        return None
    rows = np.concatenate([p.rows for p in parts])
    return BlockTensor(rows, fmt, (len(rows), parts[0].shape[1]))

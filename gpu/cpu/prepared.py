"""How the CPU backend holds a layer's product when it is not one packed weight: parts of
different formats sharing an input, or a gated MLP's gate and up as two products. Made by
backend.py (CpuBackend), read by it and by the compiled stack (forward.py)."""

from __future__ import annotations

from typing import Any, NamedTuple


class Stacked(NamedTuple):
    """Weights of different formats sharing an input (Q, K and V of a Q4_K_M file: V in Q6_K),
    each its own product, their outputs side by side; `bias` their biases joined (made once, at
    load: the parts' own are what a part's product alone adds)."""

    parts: list[Any]
    bias: Any = None


class GatedPair(NamedTuple):
    """A gated MLP's gate and up as two products (formats that differ, or biases)."""

    gate: Any
    up: Any
    act: str

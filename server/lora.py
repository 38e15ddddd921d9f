"""The LoRA adapters a server serves, by name (`--lora-modules`, and at runtime vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` with --allow-runtime-lora-updating): a
request's `model` names one of them or the base model.

An adapter is checked when it is registered (core/lora.py read_adapter: its config and its
tensors' shapes against the base model, without torch) and registered whole or not at all; the
engine reads its weights when a request first needs them. Each registration is named by its
content (LoraRef.key), so an adapter reloaded under its old name with other weights shares no
cached KV with the old one. The registry counts the HTTP requests using each adapter: one in use
is not unloaded.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from core.lora import (
    AdapterInfo,
    LoraBase,
    LoraError,
    LoraRef,
    parse_lora_modules,
    read_adapter,
)
from server.errors import APIError


@dataclass
class Adapter:
    ref: LoraRef
    base_model_name: str | None
    created: int


@dataclass
class LoraRegistry:
    base: LoraBase
    max_rank: int
    adapters: dict[str, Adapter] = field(default_factory=dict)
    in_use: Counter = field(default_factory=Counter)  # name -> HTTP requests using it
    num_loads: int = 0

    def check(self, name: str, path: str) -> AdapterInfo:
        """Read and check the adapter in `path` (files are read: off the event loop at
        runtime); LoraError names what is wrong."""
        if not name:
            raise LoraError("a LoRA adapter needs a name", "lora_name")
        self._unused(name)
        return read_adapter(name, path, self.base, self.max_rank)

    def add(self, info: AdapterInfo, base_model_name: str | None = None) -> Adapter:
        """Register a checked adapter under its name (again refused if the name was taken
        meanwhile)."""
        self._unused(info.ref.name)
        adapter = Adapter(info.ref, base_model_name, int(time.time()))
        self.adapters[info.ref.name] = adapter
        self.num_loads += 1
        return adapter

    def _unused(self, name: str) -> None:
        if name in self.adapters:
            raise LoraError(f"The lora adapter '{name}' has already been loaded.", "lora_name")

    def load(self, name: str, path: str, base_model_name: str | None = None) -> Adapter:
        return self.add(self.check(name, path), base_model_name)

    def load_modules(self, values: list[str]) -> None:
        """--lora-modules, at start-up: a bad one stops the server with its message."""
        for name, path, base_model_name in parse_lora_modules(values):
            self.load(name, path, base_model_name)

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found"
            )
        if self.in_use[name]:
            raise APIError(
                409,
                f"The lora adapter '{name}' is in use by {self.in_use[name]} request(s); "
                "unload it when they have finished.",
                "lora_name",
                "adapter_in_use",
            )
        del self.adapters[name]

    def ref(self, name: str) -> LoraRef | None:
        adapter = self.adapters.get(name)
        return adapter.ref if adapter is not None else None

    def acquire(self, name: str) -> None:
        self.in_use[name] += 1

    def release(self, name: str) -> None:
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]


def bad_adapter(e: LoraError) -> APIError:
    return APIError(400, str(e), e.param, "invalid_lora_adapter")


def add_arguments(s: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags of `weir serve`."""
    lora = s.add_argument_group("LoRA adapters (vLLM's flags)")
    lora.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters beside the base model"
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        help="adapters served from start-up: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    lora.add_argument(
        "--max-loras", type=int, default=1, help="distinct adapters in one batch (default 1)"
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=16, help="the highest rank an adapter may have"
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory, least recently used dropped (default: --max-loras)",
    )
    lora.add_argument(
        "--lora-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the dtype adapters are held in (default auto: the activations'; on CPU float32 or "
        "bfloat16, which halves the bytes each step reads)",
    )
    lora.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM)",
    )

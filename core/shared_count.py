"""Counters several processes add to and any of them reads: one 64-bit slot per process in a
small file each maps. A process writes only its own slot (one aligned 8-byte store: no lock),
a reader sums them. The API servers count the requests they have sent the engine here, so the
admission limit (--max-waiting-requests) holds for the whole server, not per API server."""

from __future__ import annotations

import mmap
import os


class SharedCounts:
    def __init__(self, path: str, slots: int, slot: int) -> None:
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} outside 0..{slots - 1}")
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, slots * 8)
        finally:
            os.close(fd)
        self._counts = memoryview(self._map).cast("q")
        self.slot = slot

    @staticmethod
    def create(path: str, slots: int) -> None:
        """The file, every slot 0 (by the process that starts the others)."""
        with open(path, "wb") as f:
            f.write(bytes(slots * 8))

    def add(self, n: int = 1) -> None:
        self._counts[self.slot] += n

    def total(self) -> int:
        return sum(self._counts)

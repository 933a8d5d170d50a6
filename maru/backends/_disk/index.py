"""The disk backend's per-process index: object sizes, least recently used first."""

from __future__ import annotations

from collections import OrderedDict


class Index:
    """This process's view of the object files: their sizes, least recently used first."""

    def __init__(self, sizes: OrderedDict[str, int] | None = None) -> None:
        self.sizes = sizes or OrderedDict()
        self.bytes = sum(self.sizes.values())

    def __len__(self) -> int:
        return len(self.sizes)

    def add(self, name: str, size: int) -> None:
        self.discard(name)
        self.sizes[name] = size
        self.bytes += size

    def discard(self, name: str) -> None:
        self.bytes -= self.sizes.pop(name, 0)

    def oldest(self) -> tuple[str, int]:
        """Remove the least recently used object: its name and size."""
        name, size = self.sizes.popitem(last=False)
        self.bytes -= size
        return name, size

    def touch(self, name: str) -> None:
        if name in self.sizes:
            self.sizes.move_to_end(name)

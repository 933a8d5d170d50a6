"""The data path: KV pages between a KV cache and store memory, on the cache's device.

The connector decides what moves (keys, block ids); this module decides how the
bytes move, and imports torch, numpy and maru only, never vLLM, so tests and
benchmarks drive it directly, on any device.

A chunk's object payload holds, layer after layer and segment after segment,
one row of `run_bytes` per block (see `maru.layouts`). Per chunk and layer:

- on the CPU, each run of consecutive blocks (usually all of a chunk's) moves as
  one copy each way, straight between the cache and store memory, in the calling
  thread, with streaming stores (`maru._streamcopy`: a copy larger than the caches
  then moves two lines of memory per line, not three; torch's copy would split it
  across intra-op threads that stall whenever another thread or process holds a
  core);
- on a device with streams (CUDA), the blocks are gathered or scattered on the
  device with index tensors that live there, and the layer crosses to or from
  host memory in one transfer on a side stream. Host memory must be pinned:
  the store's own memory registered with the driver, or a pinned staging
  buffer. Loads complete layer by layer (`wait_layer`); saves are marked done
  when their copies are, and only then committed by the caller.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from maru._streamcopy import copy_rows
from maru.backends.base import Hashing
from maru.errors import MaruError
from maru.hugepages import put_on_huge_pages
from maru.layouts import LayoutAdapter
from maru.log import get_logger

log = get_logger(__name__)

SUPPORTED_DEVICES = ("cpu", "cuda")
WIDTHS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


class UnsupportedDeviceError(MaruError):
    """The KV cache lives on a device the data path cannot copy from."""


# --- where copies run ----------------------------------------------------------


class Marker:
    """A point in a copy queue: everything queued before it is done once it is."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        """Block the host until done."""

    def hold_compute(self) -> None:
        """Make the compute stream wait for it (work queued there later runs after)."""


DONE = Marker()


class CopyQueue:
    """Copies run at once, in the caller's thread: the CPU, which has no streams."""

    synchronous = True
    """Every copy is done when `run` returns."""

    def after_compute(self) -> None:
        """Copies queued from now on start after the compute work issued so far."""

    def run(self, copy: Callable[[], None]) -> None:
        """Queue `copy` (a function issuing copies) after everything queued before."""
        copy()

    def mark(self) -> Marker:
        """A marker after everything queued so far."""
        return DONE


class CudaEventMarker(Marker):
    def __init__(self, stream: Any) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def hold_compute(self) -> None:
        torch.cuda.current_stream(self.event.device).wait_event(self.event)


class CudaQueue(CopyQueue):
    """Copies on a side stream of the cache's CUDA device, beside the forward."""

    synchronous = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def run(self, copy: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            copy()

    def mark(self) -> Marker:
        return CudaEventMarker(self.stream)


def queue_for(device: torch.device) -> CopyQueue:
    """The copy queue for a cache on `device`, or UnsupportedDeviceError naming it."""
    if device.type == "cpu":
        return CopyQueue()
    if device.type == "cuda":
        return CudaQueue(device)
    raise UnsupportedDeviceError(
        f"the KV cache is on device {device}; maru's data path supports "
        f"{', '.join(SUPPORTED_DEVICES)}"
    )


# --- host memory ----------------------------------------------------------------


def host_tensor(buffer: memoryview) -> torch.Tensor:
    """A flat int8 tensor over `buffer` without a copy (read-only buffers included:
    the data path never writes into what it loads from)."""
    if not len(buffer):
        return torch.empty(0, dtype=torch.int8)
    return torch.frombuffer(buffer, dtype=torch.int8)


def _spend_torch_read_only_warning() -> None:
    """torch warns once per process that a tensor over a read-only buffer is read-only;
    have it warn here, silenced, so `host_tensor` needs no warning filter of its own
    on every load (setting one up costs more than the tensor)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        torch.frombuffer(memoryview(bytes(1)), dtype=torch.int8)


_spend_torch_read_only_warning()


def pin(memory: memoryview) -> bool:
    """Page-lock `memory` with the CUDA driver, so transfers use it directly; False
    if the driver refuses (then transfers go through pinned staging buffers)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    result = torch.cuda.cudart().cudaHostRegister(address, len(memory), 0)
    return int(getattr(result, "value", result)) == 0


# --- block ids --------------------------------------------------------------------


@dataclass
class Blocks:
    """One chunk's block ids, with what each device needs to address them."""

    ids: list[int]
    runs: list[tuple[int, int, int]] = field(init=False)
    """(first block, position in the chunk, length) of every run of consecutive ids."""
    _on: dict[torch.device, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.runs = []
        for position, block in enumerate(self.ids):
            if self.runs and self.runs[-1][0] + self.runs[-1][2] == block:
                start, at, length = self.runs[-1]
                self.runs[-1] = (start, at, length + 1)
            else:
                self.runs.append((block, position, 1))

    @cached_property
    def cpu(self) -> torch.Tensor:
        """The ids as an index tensor (made only where a device copy needs one: the
        CPU's copies use `runs`)."""
        return torch.tensor(self.ids, dtype=torch.long)

    def on(self, device: torch.device) -> torch.Tensor:
        """The ids as an index tensor on `device` (made once)."""
        if device.type == "cpu":
            return self.cpu
        if device not in self._on:
            self._on[device] = self.cpu.to(device, non_blocking=True)
        return self._on[device]


def widest(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """2-D int8 tensors viewed as the widest integer type all of them allow (fewer,
    wider elements for indexed copies); the same bytes either way."""
    for dtype, size in WIDTHS:
        if all(
            t.shape[-1] % size == 0
            and t.data_ptr() % size == 0
            and all(s % size == 0 for s in t.stride()[:-1])
            for t in tensors
        ):
            return [t.view(dtype) for t in tensors]
    return list(tensors)


# --- the data path -----------------------------------------------------------------


@dataclass
class ChunkCopy:
    """One chunk to move: its blocks and the host memory of its object's payload."""

    blocks: Blocks
    payload: torch.Tensor
    """Flat int8 host tensor: the object's pages (pinned when the cache is on a device)."""
    stored_blocks: int
    """How many blocks the object holds (the payload's row count per segment)."""
    first: int = 0
    """Row of the object that goes into blocks.ids[0] (a load may skip blocks)."""
    hasher: Hashing | None = None
    """Fed the whole payload, in order, as the CPU loads it (every segment's rows, also
    those a load skips), so the object's checksum needs no second pass over memory."""

    @property
    def loads_every_row(self) -> bool:
        """Does a load copy every row the object stores, in order (from its first)?"""
        return self.first == 0 and len(self.blocks.ids) == self.stored_blocks

    @cached_property
    def host(self) -> np.ndarray:
        """The payload as a numpy array (what a load's hasher is fed)."""
        return self.payload.numpy()

    def rows_at(self, position: int, run: int, row: int, count: int) -> int:
        """The address of `count` rows of `run` bytes from `row` on, in the payload's
        segment at byte `position` (IndexError past the object's blocks or memory)."""
        end = position + self.stored_blocks * run
        if row < 0 or row + count > self.stored_blocks or end > self.payload.numel():
            raise IndexError(
                f"rows {row}..{row + count - 1} of {self.stored_blocks} stored blocks "
                f"outside the payload's {self.payload.numel()} bytes"
            )
        return self.payload.data_ptr() + position + row * run


@dataclass(frozen=True)
class HostSegment:
    """A segment of a CPU cache as the copies address it: `rows` rows of `run` bytes,
    `stride` bytes apart from `address` on."""

    address: int
    stride: int
    run: int
    rows: int

    @classmethod
    def of(cls, view: torch.Tensor) -> HostSegment:
        if view.dtype != torch.int8 or view.dim() != 2 or view.stride(1) != 1:
            raise ValueError(f"a segment is an int8 view of dense rows, not {view.shape}")
        return cls(view.data_ptr(), view.stride(0), view.shape[1], view.shape[0])

    def rows_at(self, block: int, count: int) -> int:
        """The address of `count` blocks' rows from `block` on (IndexError outside)."""
        if block < 0 or block + count > self.rows:
            raise IndexError(f"blocks {block}..{block + count - 1} outside the cache's {self.rows}")
        return self.address + block * self.stride


class DataPath:
    """Moves chunks' pages between the caches an adapter recognised and host memory."""

    def __init__(self, adapter: LayoutAdapter, queue: CopyQueue | None = None) -> None:
        self.adapter = adapter
        first_segment = next(iter(adapter.layers.values()))[0]
        self.device: torch.device = first_segment.view.device
        self.queue = queue or queue_for(self.device)
        self.on_device = self.device.type != "cpu"
        self._layer_loaded: dict[str, Marker] = {}
        self._bytes_before = adapter.layer_offsets(1)
        """Per layer: bytes of the layers before it, per stored block."""
        self._host_layers = (
            {}
            if self.on_device
            else {
                name: [HostSegment.of(s.view) for s in segs]
                for name, segs in adapter.layers.items()
            }
        )
        """On the CPU: each layer's segments, addressed."""

    def payload_bytes(self, blocks: int) -> int:
        """Bytes of pages in an object of `blocks` blocks."""
        return blocks * self.adapter.block_bytes

    def staging(self, nbytes: int) -> torch.Tensor:
        """Host memory for one object's pages that transfers can use: pinned for a device
        (from torch's caching host allocator, reused once its copies are done)."""
        return torch.empty(nbytes, dtype=torch.int8, pin_memory=self.on_device)

    def _layer_rows(self, name: str, chunk: ChunkCopy) -> torch.Tensor:
        """The payload's part for one layer."""
        start = chunk.stored_blocks * self._bytes_before[name]
        return chunk.payload[
            start : start + chunk.stored_blocks * self.adapter.layer_block_bytes[name]
        ]

    # loads

    def load(self, chunks: Sequence[ChunkCopy]) -> set[int]:
        """Queue every chunk's pages into its blocks, layer after layer; the indexes of
        the chunks whose copies could not be issued (their blocks hold nothing usable)."""
        self.queue.after_compute()
        failed: set[int] = set()
        for name in self.adapter.layers:
            for index, chunk in enumerate(chunks):
                if index not in failed:
                    try:
                        self.queue.run(lambda n=name, c=chunk: self._load_layer(n, c))
                    except Exception as exc:
                        _log_copy_failure(exc)
                        failed.add(index)
            self._layer_loaded[name] = self.queue.mark()
        return failed

    def wait_layer(self, name: str) -> None:
        """Make the forward wait for this layer's loads (the other layers go on)."""
        marker = self._layer_loaded.pop(name, None)
        if marker is not None:
            marker.hold_compute()

    def loads_done(self) -> Marker:
        """A marker after every load queued so far."""
        self._layer_loaded.clear()
        return self.queue.mark()

    def _load_layer(self, name: str, chunk: ChunkCopy) -> None:
        if not self.on_device:
            self._copy_on_cpu(name, chunk, load=True)
            return
        rows = self._layer_rows(name, chunk).to(self.device, non_blocking=True)
        count, first, position = len(chunk.blocks.ids), chunk.first, 0
        for segment in self.adapter.layers[name]:
            run = segment.run_bytes
            stored = rows[position : position + chunk.stored_blocks * run].view(-1, run)
            position += chunk.stored_blocks * run
            target, source = widest(segment.view, stored[first : first + count])
            target.index_copy_(0, chunk.blocks.on(self.device), source)

    def _copy_on_cpu(self, name: str, chunk: ChunkCopy, load: bool) -> None:
        """One layer of a chunk between the cache and its payload, each run of consecutive
        blocks one streaming copy per segment, in the running thread (bounds checked
        here: the copies take addresses). A load feeds each segment's rows to the
        chunk's hasher: as it copies them where it loads all of them, else just after."""
        position = chunk.stored_blocks * self._bytes_before[name]
        hasher = chunk.hasher if load else None
        hash_as_copied = hasher is not None and chunk.loads_every_row
        for segment in self._host_layers[name]:
            run = segment.run
            for block, at, length in chunk.blocks.runs:
                cache = segment.rows_at(block, length)
                stored = chunk.rows_at(position, run, chunk.first + at, length)
                if hash_as_copied:
                    hasher.copy_rows(cache, segment.stride, stored, run, length)
                elif load:
                    copy_rows(cache, segment.stride, stored, run, run, length)
                else:
                    copy_rows(stored, run, cache, segment.stride, run, length)
            if hasher is not None and not hash_as_copied:
                hasher.update(chunk.host[position : position + chunk.stored_blocks * run])
            position += chunk.stored_blocks * run

    # saves

    def save_layer(self, name: str, chunks: Sequence[ChunkCopy]) -> None:
        """Queue one layer's pages of every chunk into its payload, after the layer's
        compute."""
        self.queue.after_compute()
        for chunk in chunks:
            self.queue.run(lambda c=chunk: self._save_layer(name, c))

    def saves_done(self) -> Marker:
        """A marker after every save queued so far."""
        return self.queue.mark()

    def _save_layer(self, name: str, chunk: ChunkCopy) -> None:
        if not self.on_device:
            self._copy_on_cpu(name, chunk, load=False)
            return
        rows = self._layer_rows(name, chunk)
        gathered = torch.empty_like(rows, device=self.device)
        count, position = len(chunk.blocks.ids), 0
        for segment in self.adapter.layers[name]:
            out = gathered[position : position + count * segment.run_bytes].view(count, -1)
            position += out.numel()
            source, target = widest(segment.view, out)
            torch.index_select(source, 0, chunk.blocks.on(self.device), out=target)
        rows.copy_(gathered, non_blocking=True)


def _log_copy_failure(exc: Exception) -> None:
    log.error("maru: copying a chunk into the KV cache failed: %s: %s", type(exc).__name__, exc)


def put_caches_on_huge_pages(paths: Iterable[DataPath]) -> int:
    """Move the memory behind the CPU caches of data paths onto huge pages (see
    `maru.hugepages`: torch gives them 4 KiB pages, and each cost the copies into the
    cache a TLB miss); the bytes moved. Device caches are left alone."""
    storages = [
        segment.view.untyped_storage()
        for path in paths
        if not path.on_device
        for segments in path.adapter.layers.values()
        for segment in segments
    ]
    return put_on_huge_pages((storage.data_ptr(), storage.nbytes()) for storage in storages)

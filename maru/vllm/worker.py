"""The worker half: copies chunks between the store and the KV cache, in each worker.

One object per chunk per tensor-parallel rank holds every layer's pages behind a header
(`maru.vllm.keys.object_header`): a save writes it into a reservation layer by layer and
commits it only when whole, a load checks its header and copies it into the chunk's
blocks. How bytes move is `maru.transfer`'s business; the worker takes a factory for
its data path, so a test can hand it one with a slowed-down or failing queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from contextlib import ExitStack
from typing import Any

import torch

from maru.backends.base import ReadView
from maru.config import MaruConfig
from maru.layouts import LayoutAdapter, LayoutError, guess_num_blocks, recognise
from maru.log import get_logger
from maru.plugins import get_plugin_manager
from maru.transfer import (
    Blocks,
    ChunkCopy,
    DataPath,
    UnsupportedDeviceError,
    host_tensor,
    pin,
    put_caches_on_huge_pages,
)
from maru.vllm.amx import permit_amx_tiles
from maru.vllm.asyncloads import async_loads
from maru.vllm.background import BackgroundLoads
from maru.vllm.compat import pipeline_parallel_rank, tensor_parallel_rank
from maru.vllm.groups import FULL, KVGroup, UnservedGroups, kv_groups, loads_async
from maru.vllm.guard import StoreGuard
from maru.vllm.keys import HEADER_BYTES, object_header, rank_key
from maru.vllm.metadata import NO_DATA_PATH, ChunkTransfer, MaruHandshake
from maru.vllm.pending import PendingLoad, PendingSave
from maru.vllm.stats import (
    BACKGROUND_LOADS,
    LOAD_ERRORS,
    LOAD_LATENCIES,
    LOAD_OPEN_SECONDS,
    LOAD_SECONDS,
    LOADED_BYTES,
    LOADS,
    SAVE_ERRORS,
    SAVE_LATENCIES,
    SAVE_SECONDS,
    SAVED_BYTES,
    SAVES,
    DroppedCopies,
    MaruConnectorStats,
)

log = get_logger(__name__)

DataPathFactory = Callable[[LayoutAdapter], DataPath]
"""Makes the data path for the layout a worker recognised."""


class MaruWorker:
    """Copies chunks between the store and the KV cache; runs in each vLLM worker."""

    def __init__(
        self,
        vllm_config: Any,
        config: MaruConfig,
        kv_cache_config: Any,
        transfers: DataPathFactory = DataPath,
    ) -> None:
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        try:
            self.groups = kv_groups(kv_cache_config, vllm_config.cache_config.block_size)
        except UnservedGroups:  # the scheduler half says why, and plans nothing
            self.groups = []
        self.loads_async = loads_async(self.groups)
        self.chunk_tokens = config.chunk_tokens
        self.huge_pages = config.kv_cache_huge_pages
        self.stats = MaruConnectorStats()
        self.store = StoreGuard(config, "worker", self.stats)
        self.rank = self._share(vllm_config.parallel_config)
        """This worker's share of every chunk: its pipeline stage and tensor-parallel rank
        (`pp_rank * tensor_parallel_size + tp_rank`)."""
        self._make_transfers = transfers
        self.paths: dict[int, DataPath] = {}
        """Per KV cache group, its data path, once `register_kv_caches` recognised the
        layout of its layers."""
        self.layer_groups: dict[str, int] = {}
        self.fingerprint = NO_DATA_PATH
        self.pinned = False
        """The store's memory is page-locked, so device transfers use it directly."""
        self.failed_blocks: set[int] = set()
        self.loading: list[PendingLoad] = []
        self.loaded_requests: set[str] = set()
        self.failed_requests: set[str] = set()
        """Requests whose loads are done, and those of them that failed (asynchronous
        loads: `loads_async`, or `background`)."""
        self.background = BackgroundLoads(async_loads(config))
        self.pending: dict[bytes, PendingSave] = {}
        self.in_flight: list[PendingSave] = []
        self.saving_requests: set[str] = set()
        """Requests with a planned save: their blocks are freed once they are reported."""
        self.dropped = DroppedCopies(self.stats)

    def _share(self, parallel: Any) -> int:
        """This worker's share index; with an unknown rank the store is off (guessing 0
        would load rank 0's share everywhere)."""
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        ranks = {
            "tensor-parallel": (tensor_parallel_rank(), tp_size),
            "pipeline-parallel": (pipeline_parallel_rank(), pp_size),
        }
        for kind, (rank, size) in ranks.items():
            if rank is None and size > 1:
                self.store.disable(
                    f"this worker's {kind} rank is unknown with a {kind} size of {size}"
                )
        return (ranks["pipeline-parallel"][0] or 0) * tp_size + (ranks["tensor-parallel"][0] or 0)

    @property
    def served(self) -> bool:
        """The KV cache is one maru serves (else the scheduler half said why, and plans
        nothing)."""
        return bool(self.groups)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Find each group's layout adapter and the data path for the cache's device; a
        layout or device the data path cannot handle disables the connector, loudly."""
        if not self.served:
            log.info("maru: not a KV cache maru serves (see the scheduler's error); no data path")
            return
        adapters = [p.cls for p in get_plugin_manager().layout_adapters.values()]
        num_blocks = self.num_blocks or guess_num_blocks(kv_caches)
        try:
            for group in self.groups:
                adapter = recognise(self._layers(group, kv_caches), num_blocks, adapters)
                self.paths[group.index] = self._make_transfers(adapter)
        except LayoutError as exc:
            self.paths = {}
            log.error("maru: %s", exc)
            return
        except UnsupportedDeviceError as exc:
            self.paths = {}
            self.store.disable(str(exc))
            return
        self.layer_groups = {
            name: index for index, path in self.paths.items() for name in path.adapter.layers
        }
        self.fingerprint = "+".join(path.adapter.fingerprint for path in self.paths.values())
        if self.huge_pages:
            put_caches_on_huge_pages(self.paths.values())
        if not self._on_device:
            permit_amx_tiles()  # a hit may be this engine's first forward (maru.vllm.amx)
        store = self.store.available()  # at start-up: a new pool is set up here, not in a request
        if self._on_device and store is not None and store.zero_copy:
            self.pinned = pin(store.host_memory())
        for index, path in self.paths.items():
            log.info(
                "maru: KV cache group %d: layout %s (fingerprint %s), %d layers, %d bytes per "
                "block, on %s%s",
                index,
                path.adapter.name,
                path.adapter.fingerprint,
                len(path.adapter.layers),
                path.adapter.block_bytes,
                path.device,
                ", store memory page-locked" if self.pinned else "",
            )

    def _layers(self, group: KVGroup, kv_caches: dict[str, Any]) -> dict[str, Any]:
        """The group's layers (one group: every layer vLLM registered)."""
        if len(self.groups) == 1:
            return kv_caches
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise LayoutError(
                f"KV cache {group.described}: register_kv_caches gave no tensor for "
                f"{', '.join(missing)}"
            )
        return {name: kv_caches[name] for name in group.layer_names}

    @property
    def _on_device(self) -> bool:
        """The KV cache is on a device (every group's: they share one buffer)."""
        return any(path.on_device for path in self.paths.values())

    def handshake(self) -> MaruHandshake:
        blocks = frozenset((self.rank, g, p.payload_bytes(1)) for g, p in self.paths.items())
        return MaruHandshake(self.fingerprint, blocks)

    def object_bytes(self, group: int, blocks: int) -> int:
        """Bytes of an object of `group` with `blocks` blocks."""
        return HEADER_BYTES + self.paths[group].payload_bytes(blocks)

    @property
    def _host_direct(self) -> bool:
        """Can copies use the store's memory itself (else a staging buffer)?"""
        return not self._on_device or self.pinned

    # loads

    def load(self, transfers: list[ChunkTransfer]) -> None:
        """Start copying every planned chunk into its blocks (on the CPU: copy them), and
        reading those of `background` loads (`maru.vllm.background`)."""
        with self.stats.timing(LOAD_SECONDS):
            store = self.store.available() if self.paths else None
            background = [t for t in transfers if t.background]
            refused = self.background.start(store, background, self._share_key, self._bytes)
            for transfer in refused:
                self._load_failed(transfer)
                self.loaded_requests.add(transfer.req_id)
            self._start_loads([t for t in transfers if not t.background])

    def _share_key(self, transfer: ChunkTransfer) -> bytes:
        """This worker's object of the transfer's chunk."""
        return rank_key(transfer.key, self.rank, transfer.group)

    def _bytes(self, transfer: ChunkTransfer) -> int:
        """Bytes of a whole object of the transfer's chunk (a tail's are fewer)."""
        group = transfer.group
        return self.object_bytes(group, self.groups[group].stored_blocks(self.chunk_tokens))

    def _start_loads(self, transfers: list[ChunkTransfer]) -> None:
        with self.stats.timing(LOAD_OPEN_SECONDS):
            opened = self._open_all((t, self._view(t)) for t in transfers)
        self._copy_opened(opened)
        if self.loads_async:
            self.loaded_requests.update(t.req_id for t in transfers)
        if self.paths and not self._on_device:
            self._finish_loads()

    def _copy_arrived(self) -> None:
        """Check and copy what background reads brought into their requests' blocks,
        waiting for the copies; the requests are then done (a failed read failed)."""
        arrived = self.background.take()
        for request in arrived:
            self.loaded_requests.add(request.req_id)
            if request.store_failed:
                self.store.failed(request.error)
        if arrived:
            with self.stats.timing(LOAD_SECONDS):
                chunks = (c for r in arrived for c in zip(r.transfers, r.views, strict=True))
                self._copy_opened(self._open_all(chunks))
                self._finish_loads()

    def _copy_opened(self, opened: dict[int, list[PendingLoad]]) -> None:
        """Queue the copies of every opened chunk; one that cannot be issued failed."""
        for group, pendings in opened.items():
            failed = self.paths[group].load([p.copy for p in pendings])
            for index, pending in enumerate(pendings):
                if index in failed:
                    self._load_failed(pending.transfer)
                else:
                    self.loading.append(pending)

    def _open_all(
        self, chunks: Iterable[tuple[ChunkTransfer, ReadView | None]]
    ) -> dict[int, list[PendingLoad]]:
        """Every chunk whose object was read and checks, by KV cache group; others failed."""
        opened: dict[int, list[PendingLoad]] = {}
        for transfer, view in chunks:
            pending = self._open(transfer, view) if view is not None else None
            if pending is None:
                self._load_failed(transfer)
            else:
                opened.setdefault(transfer.group, []).append(pending)
        return opened

    def _view(self, transfer: ChunkTransfer) -> ReadView | None:
        """The chunk's object; None if absent or unavailable (no data path, no store)."""
        store = self.store.available() if self.paths else None
        if store is None:
            return None
        try:
            return store.view(self._share_key(transfer))
        except Exception as exc:
            self.store.failed(exc)
            return None

    def _open(self, transfer: ChunkTransfer, view: ReadView) -> PendingLoad | None:
        """The chunk's object, checked, as host memory the copies can read; None if not to
        be trusted, or without the blocks the transfer asks for."""
        if not self._trusted(self._share_key(transfer), view.data):
            return None
        stored = self._stored_blocks(transfer.group, len(view.data))
        if stored is None or not 0 <= transfer.first_block <= stored - len(transfer.block_ids):
            return None
        payload = host_tensor(view.data[HEADER_BYTES:])
        blocks, first = Blocks(transfer.block_ids), transfer.first_block
        if not self._host_direct:  # staged, and checked once there
            payload = self.paths[transfer.group].staging(payload.numel()).copy_(payload)
            staged = ChunkCopy(blocks, payload, stored, first)
            return PendingLoad(transfer, staged, lambda: True) if view.valid() else None
        hasher = None if self._on_device else view.hasher()
        if hasher is not None:  # the CPU's copies feed it the payload
            hasher.update(view.data[:HEADER_BYTES])
        copy = ChunkCopy(blocks, payload, stored, first, hasher)
        return PendingLoad(transfer, copy, lambda: view.valid(hasher))

    def _stored_blocks(self, group: int, object_bytes: int) -> int | None:
        """How many blocks an object of `object_bytes` holds: a chunk's, or fewer for a
        full-attention tail (`maru.vllm.tails`); None for any other size."""
        whole = self.groups[group].stored_blocks(self.chunk_tokens)
        blocks, rest = divmod(object_bytes - HEADER_BYTES, self.paths[group].payload_bytes(1))
        tail = self.groups[group].kind == FULL and 0 < blocks < whole
        return blocks if not rest and (blocks == whole or tail) else None

    def _trusted(self, key: bytes, data: memoryview) -> bool:
        """The object is this key's, in this layout, and whole."""
        expected = object_header(key, self.fingerprint, len(data) - HEADER_BYTES)
        return data[:HEADER_BYTES] == expected

    def wait_for_layer(self, name: str) -> None:
        group = self.layer_groups.get(name)
        if group is not None:
            self.paths[group].wait_layer(name)

    def finish_loads(self) -> None:
        """Wait for the loads' copies; a chunk whose object changed meanwhile failed."""
        if self.loading:
            with self.stats.timing(LOAD_SECONDS):
                self._finish_loads()

    def _finish_loads(self) -> None:
        for path in self.paths.values():
            path.loads_done().wait()
        for pending in self.loading:
            if pending.still_valid():
                self.stats.add(LOADS)
                self.stats.add(BACKGROUND_LOADS, int(pending.transfer.background))
                self.stats.add(LOADED_BYTES, HEADER_BYTES + pending.copy.payload.numel())
                self.stats.observe(LOAD_LATENCIES, time.perf_counter() - pending.started)
            else:
                self._load_failed(pending.transfer)
        self.loading = []

    def _load_failed(self, transfer: ChunkTransfer) -> None:
        self.stats.add(LOAD_ERRORS)
        if self.loads_async:
            self.failed_requests.add(transfer.req_id)
        else:
            self.failed_blocks.update(transfer.block_ids)

    def take_failed_blocks(self) -> set[int]:
        self.finish_loads()
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads are done since the last call: those that
        loaded, and those that failed (vLLM recomputes them)."""
        self.finish_loads()
        self._copy_arrived()
        failed = self.failed_requests
        loaded = self.loaded_requests - failed
        self.loaded_requests, self.failed_requests = set(), set()
        return loaded, failed

    # saves

    def save_layer(self, layer_name: str, transfers: list[ChunkTransfer]) -> None:
        """Queue one layer's pages of every chunk to save, after the layer's compute."""
        with self.stats.timing(SAVE_SECONDS):
            self._queue_layer(layer_name, transfers)

    def _queue_layer(self, layer_name: str, transfers: list[ChunkTransfer]) -> None:
        group = self.layer_groups.get(layer_name)
        if group is None:
            return
        chunks = []
        for transfer in transfers:
            if transfer.group != group:
                continue
            pending = self._pending(transfer)
            if pending is not None and layer_name not in pending.layers_done:
                pending.layers_done.add(layer_name)
                chunks.append(pending.copy)
        if chunks:
            self.paths[group].save_layer(layer_name, chunks)

    def _pending(self, transfer: ChunkTransfer) -> PendingSave | None:
        key = rank_key(transfer.key, self.rank, transfer.group)
        if key in self.pending:
            return self.pending[key]
        store = self.store.available()
        if store is None:
            return None
        stack = ExitStack()
        size = self.object_bytes(transfer.group, len(transfer.block_ids))
        try:
            buffer = stack.enter_context(store.reserve(key, size))
        except Exception as exc:
            stack.close()
            self.stats.add(SAVE_ERRORS)
            self.store.failed(exc)
            return None
        if buffer is None:
            stack.close()
            return None
        reservation = torch.frombuffer(buffer, dtype=torch.int8)
        header = object_header(key, self.fingerprint, size - HEADER_BYTES)
        reservation[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.int8)
        staged = not self._host_direct
        pages = reservation[HEADER_BYTES:]
        if staged:
            pages = self.paths[transfer.group].staging(pages.numel())
        copy = ChunkCopy(Blocks(transfer.block_ids), pages, len(transfer.block_ids))
        pending = PendingSave(
            key, transfer.req_id, transfer.group, copy, reservation, staged, stack
        )
        self.pending[key] = pending
        return pending

    def finish_saves(self, transfers: list[ChunkTransfer]) -> None:
        """Queue the layers no save_kv_layer call delivered; every chunk of this step is
        then committed once its copies are done (on the CPU: now)."""
        with self.stats.timing(SAVE_SECONDS):
            for name in self.layer_groups:
                self._queue_layer(name, transfers)
            if self.pending:
                done = {group: path.saves_done() for group, path in self.paths.items()}
                for group in {pending.group for pending in self.pending.values()}:
                    if self.groups[group].kind != FULL:  # vLLM may reuse these blocks next step
                        done[group].hold_compute()
                for pending in self.pending.values():
                    pending.copied = done[pending.group]
                    self.in_flight.append(pending)
                self.pending.clear()
        self.commit_copied()

    def commit_copied(self, wait: bool = False, waiting_for: Collection[str] = ()) -> None:
        """Commit every save whose copies are done, after waiting for the copies of all
        saves (`wait`) or of the requests `waiting_for`."""
        still = []
        for pending in self.in_flight:
            if wait or pending.req_id in waiting_for:
                with self.stats.timing(SAVE_SECONDS):
                    pending.copied.wait()
            if pending.copied.done():
                self._commit(pending)
            else:
                still.append(pending)
        self.in_flight = still

    def _commit(self, pending: PendingSave) -> None:
        try:
            with self.stats.timing(SAVE_SECONDS):
                if pending.staged:
                    pending.reservation[HEADER_BYTES:].copy_(pending.copy.payload)
                pending.stack.close()
        except Exception as exc:
            self.stats.add(SAVE_ERRORS)
            self.store.failed(exc)
            return
        self.stats.add(SAVES)
        self.stats.add(SAVED_BYTES, int(pending.reservation.numel()))
        self.stats.observe(SAVE_LATENCIES, time.perf_counter() - pending.started)

    def abort_saves(self, exc: BaseException) -> None:
        """Drop every open reservation (their space returns to the store), and back off."""
        for path in self.paths.values():
            path.saves_done().wait()  # queued copies may still write into them
        for pending in [*self.pending.values(), *self.in_flight]:
            pending.stack.__exit__(type(exc), exc, exc.__traceback__)
        self.pending.clear()
        self.in_flight = []
        self.store.failed(exc)

    def expect_saves(self, transfers: list[ChunkTransfer]) -> None:
        """Note the requests these saves belong to, where copies run beside the forward
        (the scheduler holds their blocks until they are done); on the CPU they are done
        within the step, and the blocks free at once."""
        if not all(path.queue.synchronous for path in self.paths.values()):
            self.saving_requests.update(t.req_id for t in transfers)

    def finished_saving(self, finished_req_ids: set[str]) -> set[str]:
        """The requests that finished last step and saved: their copies (queued a step
        ago, so done or nearly) are waited for and committed, and vLLM frees their blocks
        now. Every finished request is thus reported in the step after it finished, the
        one every vLLM release runs, so an idle engine holds no blocks."""
        done = finished_req_ids & self.saving_requests
        self.commit_copied(waiting_for=done)
        self.saving_requests -= done
        return done

    def report(self) -> MaruConnectorStats | None:
        """The stats since the last report, with the copies the store dropped meanwhile."""
        self.dropped.refresh(self.store.available)
        return self.stats.take()

    def close(self) -> None:
        """Stop the background reads, commit what is being saved, then close the store."""
        self.background.close()
        self.commit_copied(wait=True)
        log.info("maru: worker half (rank %d) since start-up: %s", self.rank, self.stats.lifetime)
        self.store.close()

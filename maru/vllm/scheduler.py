"""The scheduler half: lookups, and the plan of what each step loads and saves.

For a new request it looks up, in one batch, which whole chunks the store holds, tells
vLLM how many tokens it can load, and plans the saves of the chunks the store lacks
(also those vLLM holds in its own prefix cache: the store may have lost them). It keeps
the namespace's record in the store, and follows the store for KV events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from maru.config import MaruConfig
from maru.errors import MaruError
from maru.log import get_logger
from maru.vllm import compat, keys
from maru.vllm.asyncloads import async_loads, first_slow, in_background, reads_slowly
from maru.vllm.events import chunks_held, store_events
from maru.vllm.groups import (
    UnservedGroups,
    check_chunk_tokens,
    hit_chunks,
    hit_tokens,
    kv_groups,
    loads_async,
)
from maru.vllm.guard import StoreGuard
from maru.vllm.identity import warn_if_hash_seed_is_per_process
from maru.vllm.loadpolicy import LoadPolicy, Verdict, loads_always
from maru.vllm.metadata import NO_DATA_PATH, NULL_BLOCK, ChunkTransfer, MaruConnectorMetadata
from maru.vllm.namespace import Namespace
from maru.vllm.requests import RequestState
from maru.vllm.roles import Handoff, Role, handoff, named
from maru.vllm.saveplan import SavePlanner
from maru.vllm.staging import Staging, can_stage, hit_shares
from maru.vllm.stats import (
    HIT_TOKENS,
    LOOKUP_ERRORS,
    LOOKUPS,
    MISS_TOKENS,
    PREFILL_RATE,
    SLOW_HITS_RECOMPUTED,
    SLOW_LOAD_RATE,
    STAGED_TOKENS,
    MaruConnectorStats,
    Stat,
    store_gauges,
)
from maru.vllm.tails import Tail, candidates, own_tail, serves_tails

log = get_logger(__name__)

LOOKUP_REUSE_S = 1.0
"""How long a request's lookup answers vLLM asking again with the same local hit (a
request it could not schedule yet): lookups have no side effects, and cost a round trip
on a remote store."""
GAUGES_REFRESH_S = 1.0
"""How often the store's own figures are read for the gauges (a remote store's cost a
round trip)."""


class MaruScheduler:
    """Lookups and load/save plans; runs in vLLM's scheduler."""

    def __init__(self, vllm_config: Any, config: MaruConfig, kv_cache_config: Any = None) -> None:
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_tokens = config.chunk_tokens
        parallel = vllm_config.parallel_config
        self.shares_per_chunk = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        """One object per chunk, group and worker (pipeline stage x tensor-parallel rank)."""
        self.stats = MaruConnectorStats()
        self.store = StoreGuard(config, "scheduler", self.stats)
        self.requests: dict[str, RequestState] = {}
        self.held: set[str] = set()
        """Finished requests whose blocks wait for their saves' copies (a device's)."""
        self._waiting_since: dict[str, float] = {}
        """Consumer requests waiting for the chunks their producer named, since when."""
        self.failed_loads: set[str] = set()
        """Requests whose load failed: recomputed, never loaded again."""
        self._config = config
        self._gauges: dict[Stat, int] = {}
        self._gauges_read_at = -GAUGES_REFRESH_S
        self.events = store_events(vllm_config, config, self.shares)
        self._reset_events: list[Any] = []
        warn_if_hash_seed_is_per_process(vllm_config)
        compat.say_what_this_release_lacks()
        try:
            self.groups = kv_groups(kv_cache_config, self.block_size)
        except UnservedGroups as exc:
            self.groups = []
            self.store.disable(str(exc))
        check_chunk_tokens(self.groups, self.chunk_tokens)
        self.namespace = Namespace(vllm_config, config, [g.signature for g in self.groups])
        self.hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        """Tokens per entry of `request.block_hashes`."""
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.saves = SavePlanner(self.groups, self.chunk_tokens, self.block_size, self.events)
        self.tails = serves_tails(self.groups, self.block_size, self.hash_block_size)
        """Hits and saves reach a prompt's last whole block (`maru.vllm.tails`)."""
        self.loads_async = loads_async(self.groups)
        self.async_loads = async_loads(config)
        self.role = Role.of(vllm_config, config)
        self.policy = LoadPolicy(loads_always(config.slow_hits, self.role), self.chunk_tokens)
        """Whether a hit on a slow tier loads or is recomputed (`maru.vllm.loadpolicy`)."""
        self.staging = Staging(self.async_loads, self.policy)  # slow hits read before scheduled
        self.saves_hold_blocks = vllm_config.device_config.device_type != "cpu"
        """A finished request's blocks wait for its saves' copies (on a device they run
        beside the forward; on the CPU they are done within the step)."""
        store = self.store.available()  # at start-up: a new pool is set up here, not in a request
        self.medium = store.medium if store is not None else "remote"
        """Where the store's bytes live (`Backend.medium`), for vLLM's hit sources."""

    def reset(self) -> bool:
        """Remove this instance's namespace from the store (never another model's or
        tenant's); False if the store could not."""
        store = self.store.available()
        if store is None:
            log.warning("maru: reset_cache: the store is unavailable; nothing removed")
            return False
        prefix = self.key_prefix()
        try:
            removed = store.delete_prefix(prefix)
        except MaruError as exc:
            log.warning("maru: reset_cache removed nothing: %s: %s", type(exc).__name__, exc)
            return False
        log.info("maru: reset_cache removed %d objects under %s", removed, prefix.decode())
        if self.events is not None:
            self._reset_events.extend(self.events.cleared())
        return True

    def take_events(self) -> list[Any]:
        """KV events since the last step (`maru.vllm.events`); none unless vLLM publishes
        KV events."""
        if self.events is None:
            return []
        taken, self._reset_events = self._reset_events, []
        store = self.store.available()
        if store is not None:
            try:
                taken.extend(self.events.poll(store))
            except Exception as exc:  # events are best effort: never fail a step for them
                self.store.failed(exc)
        return taken

    def report(self) -> MaruConnectorStats | None:
        """The stats since the last report, with the store's latest gauges."""
        taken = self.stats.take()
        if taken is None:
            return None
        if time.monotonic() - self._gauges_read_at >= GAUGES_REFRESH_S:
            self._gauges_read_at = time.monotonic()
            self._read_gauges()
        rates = dict(zip((PREFILL_RATE, SLOW_LOAD_RATE), self.policy.gauges(), strict=True))
        taken.set_gauges(self._gauges | {s: round(v) for s, v in rates.items() if v is not None})
        return taken

    def _read_gauges(self) -> None:
        store = self.store.available()
        gauges = store_gauges(store) if store is not None else None
        if gauges is not None:
            self._gauges = gauges

    def set_layout(self, fingerprints: set[str]) -> None:
        """Take the workers' layout fingerprint into the namespace; stop looking up
        chunks no worker could load (a worker without a data path said why)."""
        if NO_DATA_PATH in fingerprints and not self.store.disabled:
            self.store.disabled = True
            log.info("maru: a worker has no data path for its KV cache; no lookups either")
        self.namespace.set_layout(",".join(sorted(fingerprints)))

    def key_prefix(self) -> bytes:
        """This instance's namespace: the key prefix of every object it loads and saves."""
        return self.namespace.prefix()

    def chunk_keys(self, request: Any) -> list[bytes]:
        """One key per whole prompt chunk: the hash of its last block (hashes are chained)."""
        hashes, per_chunk = request.block_hashes, self.chunk_tokens // self.hash_block_size
        count = min(len(hashes) // per_chunk, request.num_prompt_tokens // self.chunk_tokens)
        prefix = self.key_prefix()
        return [keys.chunk_key(prefix, hashes[(c + 1) * per_chunk - 1]) for c in range(count)]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens beyond `num_computed_tokens` that can be loaded from the store.

        Every chunk is looked up, also those vLLM holds itself: the store may have
        lost them (restarted, evicted, down earlier), and then they are saved again.
        """
        if self.store.disabled:  # nothing to load, and no worker could save
            return 0
        if not self.namespace.known:
            return 0
        state = self.requests.get(request.request_id)
        if state is None or not self._answers(state, num_computed_tokens):
            state = self._look_up(request, num_computed_tokens)
            self.requests[request.request_id] = state
        if self._awaits_producer(request, state) or not self._judged(state) or self._staging(state):
            return None  # vLLM asks again next step
        return max(0, self._hit_tokens(state) - num_computed_tokens)

    def load_async(self, req_id: str) -> bool:
        """Does vLLM wait for this request's load (`get_finished`) instead of the step
        doing it: with several groups, or where its hit loads in the background?"""
        state = self.requests.get(req_id)
        return self.loads_async or (state is not None and state.background)

    def _hit_objects(self, state: RequestState) -> list[bytes]:
        """The objects the request's hit loads (beyond vLLM's own hit)."""
        shares = hit_shares(state, self.groups, self.shares_per_chunk, self.chunk_tokens)
        return [share.key for share in shares]

    def _judged(self, state: RequestState) -> bool:
        """Has a hit on a slow tier its verdict (`maru.vllm.loadpolicy`): loaded, or left
        to vLLM to compute? False while a probe of the tier reads."""
        if not state.background or state.judged:
            return True
        tokens = self._hit_tokens(state) - state.local_tokens
        verdict = self.policy.verdict(tokens, len(self.groups), self._probe(state))
        if verdict is Verdict.WAIT:
            return False
        if verdict is Verdict.RECOMPUTE:
            self.stats.add(SLOW_HITS_RECOMPUTED, tokens)
            state.hit_chunks = state.local_tokens // self.chunk_tokens
            state.tail, state.background = None, False
        state.judged = True
        return True

    def _staging(self, state: RequestState) -> bool:
        """Is the request's slow hit being read into the node's memory (`maru.vllm.staging`)?
        Once there it loads as a memory hit; where it cannot be staged, in the background."""
        if not state.background or state.staged:
            return False
        req_id, store = state.request.request_id, self.store.available()
        tokens = self._hit_tokens(state) - state.local_tokens
        if not state.staging:
            shares = hit_shares(state, self.groups, self.shares_per_chunk, self.chunk_tokens)
            state.staging = can_stage(store) and self.staging.start(req_id, store, shares, tokens)
            return state.staging
        arrived = self.staging.ended(req_id)
        if arrived is None:
            return True
        state.staging, state.staged = False, True
        if arrived and store is not None:
            state.background = reads_slowly(store, self._hit_objects(state))
        if not state.background:
            self.stats.add(STAGED_TOKENS, tokens)
        return False

    def _probe(self, state: RequestState) -> Callable[[], bytes | None]:
        """A read of one of the hit's objects on a slow tier (run off the engine's thread)."""
        store, objects = self.store.available(), self._hit_objects(state)
        return lambda: None if store is None else store.get(first_slow(store, objects))

    def _hit_tokens(self, state: RequestState) -> int:
        tail = state.tail.blocks * self.block_size if state.tail else 0
        prompt = state.request.num_prompt_tokens
        return hit_tokens(state.hit_chunks, prompt, self.chunk_tokens, tail)

    def _awaits_producer(self, request: Any, state: RequestState) -> bool:
        """Is this a consumer's request whose producer named objects the store does not
        hold yet (its saves still committing), within `consumer_wait`?"""
        if not self.role.waits:
            return False
        stored = named(request, self.key_prefix().decode())
        tail = (state.tail.blocks if state.tail else 0) if self.tails else None
        if stored is None or stored.found(state.hit_chunks, len(state.keys), tail):
            return False
        since = self._waiting_since.setdefault(request.request_id, time.monotonic())
        return time.monotonic() - since < self._config.consumer_wait

    def _answers(self, state: RequestState, num_computed_tokens: int) -> bool:
        """Does a request's earlier lookup answer vLLM asking again (never while it waits
        for its producer: each attempt may find the chunks)?"""
        return (
            state.request.request_id not in self._waiting_since
            and not state.allocated
            and state.local_tokens == num_computed_tokens
            and time.monotonic() - state.looked_up_at < LOOKUP_REUSE_S
        )

    def _look_up(self, request: Any, num_computed_tokens: int) -> RequestState:
        """Which of the request's chunks (and its own tail) the store holds, in one
        batched lookup; where the chunks stop short of the prompt, the longest tail after
        them, in a second."""
        chunk_keys = self.chunk_keys(request)
        own = self._own_tail(request)
        local = num_computed_tokens // self.chunk_tokens
        stored = self._stored(chunk_keys + ([own.key] if own else []))
        own_stored = own is not None and stored is not None and all([s.pop() for s in stored])
        if stored is None:  # no answer: take vLLM's own chunks as stored, save the rest
            stored = [[chunk < local for chunk in range(len(chunk_keys))] for _ in self.groups]
        state = RequestState(
            request,
            chunk_keys,
            stored,
            local_tokens=num_computed_tokens,
            own_tail=None if own_stored else own,
        )
        if not (self.role.loads and request.request_id not in self.failed_loads):
            state.hit_chunks = local
            return state
        state.hit_chunks = hit_chunks(
            self.groups, stored, num_computed_tokens, request.num_prompt_tokens, self.chunk_tokens
        )
        if own_stored and own.chunk == state.hit_chunks:
            state.tail = own
        elif self.tails:
            state.tail = self._longest_tail(request, state.hit_chunks, num_computed_tokens, own)
        if self._hit_tokens(state) > num_computed_tokens:
            objects = self._hit_objects(state)
            state.background = in_background(self.async_loads, self.store.available(), objects)
        return state

    def _own_tail(self, request: Any) -> Tail | None:
        if not self.tails:
            return None
        return own_tail(request, self.key_prefix(), self.blocks_per_chunk, self.block_size)

    def _longest_tail(
        self, request: Any, chunk: int, local_tokens: int, probed: Tail | None
    ) -> Tail | None:
        """The longest tail after `chunk` whole chunks that the store holds and that adds
        to vLLM's own hit (`probed` was looked up already)."""
        tails = candidates(
            request, self.key_prefix(), chunk, self.blocks_per_chunk, self.block_size, local_tokens
        )
        tails = [tail for tail in tails if tail != probed]
        held = self._stored([tail.key for tail in tails], counted=False)
        if held is None:
            return None
        return next(
            (tail for tail, *in_groups in zip(tails, *held, strict=True) if all(in_groups)), None
        )

    def _stored(self, chunk_keys: list[bytes], counted: bool = True) -> list[list[bool]] | None:
        """Per group and chunk, whether the store holds every rank's share; None if it
        cannot say. A `counted` lookup is a request's (a tail's probe is part of one)."""
        if not chunk_keys:
            return [[] for _ in self.groups]
        store = self.store.available()
        if store is None:
            return None
        try:
            held = iter(
                chunks_held(
                    store,
                    [(key, g.index) for g in self.groups for key in chunk_keys],
                    lambda chunk: self.shares(*chunk),
                )
            )
        except Exception as exc:
            self.stats.add(LOOKUPS, int(counted))
            self.stats.add(LOOKUP_ERRORS)
            self.store.failed(exc)
            return None
        self.stats.add(LOOKUPS, int(counted))
        self.namespace.keep_record(store)
        return [[next(held) for _ in chunk_keys] for _ in self.groups]

    def shares(self, key: bytes, group: int = 0) -> list[bytes]:
        """A chunk key's objects of one group in the store: one per worker (pipeline stage
        and tensor-parallel rank)."""
        return [keys.rank_key(key, rank, group) for rank in range(self.shares_per_chunk)]

    def update_state_after_alloc(
        self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        """Plan the loads of the external tokens into the allocated blocks: per group,
        every block vLLM gave it anew there (never its null block)."""
        state = self.requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = [list(ids) for ids in block_ids]
        state.loads = []
        if not state.allocated:  # the lookup's outcome, counted once
            state.allocated = True
            missed = len(state.keys) - max(
                state.hit_chunks, state.local_tokens // self.chunk_tokens
            )
            self.stats.add(MISS_TOKENS, missed * self.chunk_tokens)
        if num_external_tokens <= 0:
            return
        self.stats.add(HIT_TOKENS, num_external_tokens)
        if state.background:
            self.policy.load_planned(request.request_id, num_external_tokens, len(self.groups))
        hit = state.local_tokens + num_external_tokens
        for group in self.groups:
            table = state.block_ids[group.index]
            per_chunk = self.chunk_tokens // group.block_size
            for position in group.fresh_range(state.local_tokens, hit):
                if position < len(table) and table[position] != NULL_BLOCK:
                    chunk = position // per_chunk
                    first = position - group.stored_range(chunk, self.chunk_tokens).start
                    tail = state.tail is not None and chunk == state.tail.chunk
                    key = state.tail.key if tail else state.keys[chunk]
                    self._add_load(state, key, group.index, table[position], first)

    def _add_load(
        self, state: RequestState, key: bytes, group: int, block: int, first: int
    ) -> None:
        """Add one block to its object's load (runs of consecutive positions are one)."""
        last = state.loads[-1] if state.loads else None
        if (
            last is not None
            and last.key == key
            and last.group == group
            and last.first_block + len(last.block_ids) == first
        ):
            last.block_ids.append(block)
            return
        request = state.request.request_id
        state.loads.append(ChunkTransfer(key, [block], first, request, group, state.background))

    def build_connector_meta(self, scheduler_output: Any) -> MaruConnectorMetadata:
        """This step's loads (also of requests waiting for them) and the saves of every
        chunk that completes in it."""
        meta = MaruConnectorMetadata(
            preempted=bool(getattr(scheduler_output, "preempted_req_ids", None))
        )
        for state in self.requests.values():
            meta.loads.extend(state.loads)
            state.loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        self.policy.stepped(sum(scheduled.values()), scheduled.keys(), self.requests.keys())
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_saves(state, new.num_computed_tokens + scheduled[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                continue
            new_block_ids = cached.new_block_ids[index]
            if req_id in getattr(cached, "resumed_req_ids", ()):
                state.block_ids = [list(ids) for ids in new_block_ids or [[] for _ in self.groups]]
            elif new_block_ids:
                for table, ids in zip(state.block_ids, new_block_ids, strict=True):
                    table.extend(ids)
            self._plan_saves(state, cached.num_computed_tokens[index] + scheduled[req_id], meta)
        return meta

    def _plan_saves(self, state: RequestState, computed: int, meta: MaruConnectorMetadata) -> None:
        if self.role.saves:
            self.saves.plan(state, computed, meta)

    def loads_failed(self, req_ids: set[str], block_ids: frozenset[int] = frozenset()) -> None:
        """The workers could not load these requests' KV, or these blocks: vLLM recomputes
        them; their requests are not looked up again (no loop of failing loads)."""
        self.failed_loads |= req_ids & self.requests.keys()
        for req_id, state in self.requests.items() if block_ids else ():
            if any(block_ids.intersection(table) for table in state.block_ids):
                self.failed_loads.add(req_id)

    def loads_finished(self, req_ids: set[str]) -> None:
        """The workers reported these requests' background loads ended (after
        `loads_failed` named those that failed)."""
        for req_id in req_ids:
            self.policy.load_ended(req_id, loaded=req_id not in self.failed_loads)

    def saves_settled(self, req_ids: set[str]) -> None:
        """The workers reported these requests' saves done: vLLM frees their blocks (and
        the KV events learn which planned chunks were not saved)."""
        self.held -= req_ids
        if self.events is not None:
            self.events.settled(req_ids)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request: whether vLLM must keep its blocks until the worker reports
        its saves done (`get_finished`), and a producer's `kv_transfer_params` naming the
        objects it stored (a consumer given them waits for them)."""
        state = self.requests.pop(request.request_id, None)
        self.policy.finished(request.request_id)
        self.staging.forget(request.request_id)
        self.failed_loads.discard(request.request_id)
        self._waiting_since.pop(request.request_id, None)
        saving = state is not None and state.saving
        if saving and not self.saves_hold_blocks:
            self.saves_settled({request.request_id})
        params = None
        if self.role.names_objects and state is not None and state.planned_chunks:
            params = handoff(self.key_prefix().decode(), self._stored_of(state))
        if saving and self.saves_hold_blocks:
            self.held.add(request.request_id)
        return saving and self.saves_hold_blocks, params

    def _stored_of(self, state: RequestState) -> Handoff:
        """What a finished request has in the store: its planned chunks, and its own tail
        where that was stored or saved (its blocks were computed)."""
        own = self._own_tail(state.request)
        saved = own is not None and state.own_tail is None and state.planned_chunks >= own.chunk
        return Handoff(state.planned_chunks, own.blocks if saved else 0)

    def close(self) -> None:
        log.info("maru: scheduler half since start-up: %s", self.stats.lifetime)
        self.policy.close()
        self.staging.close()
        self.store.close()

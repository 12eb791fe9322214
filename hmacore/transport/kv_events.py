"""KV event adapter: vLLM engines' ZMQ KV event streams -> a RoutingIndex.

One :class:`KVEventSubscriber` follows N engine streams (one per engine and data-parallel
rank, each vLLM's ``--kv-events-config`` ``{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": ..., "replay_endpoint": ...}``) on one background thread and applies each
``KVEventBatch`` from its payload bytes: ``RoutingIndex.apply_payloads`` reads vLLM's
msgpack in compiled code straight into the index (no Python object per event or hash, the
token ids stepped over in place). A batch it declines (anything it does not read exactly as
msgspec would, or that the index refuses) takes the decoded path alone: msgspec's
``index_decoder`` (hmacore/transport/kv_event_wire.py: the fields the index reads; no vLLM
import), then ``RoutingIndex.apply_events``, which applies it or refuses it by name.

Exactness needs every batch of a stream once and in order. Per stream the subscriber expects
sequence number ``expected`` (the publisher counts from 0):

- ``seq == expected``: applied.
- ``seq > expected`` (a gap: the publisher or our socket dropped batches at its high-water
  mark, or we joined late): the missing batches are asked from the replay endpoint (bounded by
  ``replay_timeout``) and applied in order; if the replay cannot cover the gap (no replay
  endpoint, timeout, the publisher's buffer no longer holds them) the engine is reset in the
  index (it then under-predicts until the engine re-stores blocks; it never over-predicts).
- ``seq < expected``: a batch seen already (the same seq and payload length and hash among
  the last ``recent`` batches, as the live copy of a replayed batch is) is dropped as a
  duplicate;
  anything else is a new stream (the engine restarted and counts from 0 again): the engine is
  reset and the new stream followed from there.
- a frame that is not ``(topic, 8-byte seq, payload)`` is dropped (``bad_frames``); a payload
  that does not decode (the fields the index reads; the others, token ids included, are
  skipped unbuilt and unchecked), names another data-parallel rank than the stream's, or that the index
  refuses (group out of range, malformed hash), or whose ``kv_cache_spec_kind`` contradicts
  the index's layout (the router was given the wrong groups: also logged) loses that batch's
  events, so the engine is reset (``bad_batches``). The index is never half-updated
  (``apply`` is all or nothing).

Falling behind: each loop turn receives what a socket holds (up to ``max_drain`` messages)
before handling it, and a run of batches that each carry the next expected sequence number
(and a replay's answer) is applied in one ``apply_payloads`` call (the per-call cost
dominates an engine step's batch of 20-50 rows) up to the first batch it declines, which
takes the decoded path alone, then the rest of the run goes on; counters, ``next_seq`` and
the remembered digests are per batch. So a bad batch alone is dropped and the engine reset
exactly where one-by-one handling resets it (tests/test_kv_events_drain.py checks drained ==
one by one == the decoded path alone). With a ``tier_index`` every batch takes the decoded
path alone (its other-medium rows go to the tier index).

Bounded: each SUB socket holds at most ``rcv_hwm`` messages (ZMQ drops beyond it, which shows
as a gap, repaired as above); at most ``max_drain`` messages are handled per socket per loop
turn so one busy engine cannot starve the others. Events whose ``medium`` is not the GPU
(e.g. ``CPU`` offloading, a connector's store) go to ``tier_index`` when given, else are
dropped and counted (``other_medium``).

Endpoints: vLLM's publisher binds a wildcard / ipc / inproc endpoint and *connects* to any
other (``tcp://127.0.0.1:PORT``), so by default (``bind=True``) the subscriber binds the
stream's endpoint; with ``bind=False`` it connects to an engine that binds. The replay
endpoint is always bound by the engine.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Hashable, Sequence

import zmq

from ..errors import ArgumentValueError, HmacoreError
from ..route_index import OP_REMOVE, OP_STORE, ApplyStats, RoutingIndex
from ..spec import GroupKind
from . import kv_event_wire as W

__all__ = ["EngineStream", "StreamStats", "KVEventSubscriber", "SPEC_KINDS"]

#: vLLM's ``BlockStored.kv_cache_spec_kind`` values -> the layout's group kind they must match
#: (other values, e.g. "unknown", are not checked)
SPEC_KINDS = {"full_attention": GroupKind.FULL, "mla_attention": GroupKind.FULL,
              "sink_full_attention": GroupKind.FULL, "sliding_window": GroupKind.SLIDING_WINDOW,
              "sliding_window_mla": GroupKind.SLIDING_WINDOW,
              "chunked_local_attention": GroupKind.CHUNKED_LOCAL, "mamba": GroupKind.MAMBA}

logger = logging.getLogger("hmacore.kv_events")
#: the wire classes RoutingIndex.apply_events reads a decoded batch's events as
_EVENT_TYPES = W.INDEX_EVENT_TYPES


@dataclasses.dataclass(frozen=True)
class EngineStream:
    """One engine's (one data-parallel rank's) KV event stream.

    ``endpoint``: the engine's ``kv_events_config.endpoint`` (vLLM offsets its port by the
    DP rank for ranks > 0: give the offset one). ``replay_endpoint``: the engine's replay
    endpoint (offset the same way), None: gaps reset the engine. ``topic``: the engine's
    ``kv_events_config.topic``. ``bind``: see the module docstring."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None = None
    dp_rank: int = 0
    topic: str = ""
    bind: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ArgumentValueError(f"engine_id must be a non-empty str, got {self.engine_id!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://",
                                                                   "inproc://")):
                raise ArgumentValueError(f"{name} must be a tcp://, ipc:// or inproc:// ZMQ "
                                         f"endpoint, got {value!r}")
        if isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int) \
                or self.dp_rank < 0:
            raise ArgumentValueError(f"dp_rank must be an int >= 0, got {self.dp_rank!r}")
        if not isinstance(self.topic, str):
            raise ArgumentValueError(f"topic must be a str, got {self.topic!r}")

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.dp_rank)


@dataclasses.dataclass
class StreamStats:
    """Counters of one stream. ``next_seq``: the sequence number expected next (batches
    ``0 .. next_seq - 1`` of the current stream are accounted for)."""

    batches: int = 0            # batches applied (live or replayed)
    stored: int = 0             # index rows: stores
    removed: int = 0            # removes that lowered a count
    ignored: int = 0            # removes of keys not resident (no-ops)
    cleared: int = 0            # AllBlocksCleared
    tier_rows: int = 0          # rows applied to tier_index
    other_medium: int = 0       # rows of non-GPU events dropped (no tier_index)
    lookahead: int = 0          # stored rows hashed with lookahead tokens (vLLM 0.33)
    duplicates: int = 0         # batches seen twice, dropped
    gaps: int = 0               # times batches were missing
    replays: int = 0            # replay requests sent
    replayed: int = 0           # batches applied from replays
    replay_failures: int = 0    # replays that timed out
    restarts: int = 0           # new streams detected (seq went back)
    resets: int = 0             # engine resets in the index (restart, uncovered gap, bad batch)
    bad_frames: int = 0         # messages that were not (topic, seq, payload)
    bad_batches: int = 0        # payloads that did not decode / were refused / wrong DP rank
    next_seq: int = 0


class _Stream:
    __slots__ = ("spec", "sub", "replay", "stats", "recent", "started")

    def __init__(self, spec: EngineStream, sub: zmq.Socket) -> None:
        self.spec = spec
        self.sub = sub
        self.replay: zmq.Socket | None = None
        self.stats = StreamStats()
        self.recent: collections.OrderedDict[int, tuple[int, int]] = \
            collections.OrderedDict()
        self.started = False     # a first batch was seen


def _digest(payload: bytes) -> tuple[int, int]:
    """A payload's length and 64-bit keyed hash (CPython's SipHash of the bytes, keyed per
    process; cached on the bytes object): what a batch seen again is recognised by. It
    replaced a 128-bit BLAKE2b digest that cost as much as decoding the batch (2.4 / 13 /
    51 us for 1.5 / 8.5 / 35 KB payloads against 0.6 / 3.0 / 12 us; docs/routing.md,
    session 16); a stray match needs two different batches of one sequence number with
    equal lengths and hashes (2**-64 for a keyed hash)."""
    return len(payload), hash(payload)


class KVEventSubscriber:
    """Follows engines' KV event streams into ``index`` (see the module docstring).

    Args:
        index: the engines' RoutingIndex; every stream's ``(engine_id, dp_rank)`` is added.
        streams: one :class:`EngineStream` per engine and DP rank (keys must differ).
        tier_index: where non-GPU events go (second tier), None: dropped and counted.
        rcv_hwm: messages each SUB socket buffers before ZMQ drops (a gap, repaired).
        replay_timeout: seconds one replay may take before the engine is reset instead.
        recent: batches per stream remembered (seq, payload digest) to spot duplicates.
        max_drain: messages handled per socket per loop turn.

    Use as a context manager, or :meth:`start` then :meth:`close`. Sockets are bound or
    connected in :meth:`start` (an endpoint in use raises there).
    """

    def __init__(self, index: RoutingIndex, streams: Sequence[EngineStream], *,
                 tier_index: RoutingIndex | None = None, rcv_hwm: int = 10_000,
                 replay_timeout: float = 5.0, recent: int = 256, max_drain: int = 256,
                 poll_interval: float = 0.05) -> None:
        if not isinstance(index, RoutingIndex):
            raise ArgumentValueError(f"index must be a RoutingIndex, got {type(index).__name__}")
        if tier_index is not None and not isinstance(tier_index, RoutingIndex):
            raise ArgumentValueError("tier_index must be a RoutingIndex or None")
        streams = list(streams)
        if not streams or not all(isinstance(s, EngineStream) for s in streams):
            raise ArgumentValueError("streams must be a non-empty sequence of EngineStream")
        keys = [s.key for s in streams]
        dup = {k for k in keys if keys.count(k) > 1}
        if dup:
            raise ArgumentValueError(f"streams must have distinct (engine_id, dp_rank): "
                                     f"{sorted(dup)} repeated")
        for name, value, lo in (("rcv_hwm", rcv_hwm, 1), ("recent", recent, 1),
                                ("max_drain", max_drain, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ArgumentValueError(f"{name} must be an int >= {lo}, got {value!r}")
        for name, fvalue in (("replay_timeout", replay_timeout),
                             ("poll_interval", poll_interval)):
            if not isinstance(fvalue, (int, float)) or not 0 < fvalue <= 600:
                raise ArgumentValueError(f"{name} must be seconds in (0, 600], got {fvalue!r}")
        self.index = index
        self.tier_index = tier_index
        self._specs = streams
        self._rcv_hwm = rcv_hwm
        self._replay_timeout = float(replay_timeout)
        self._recent = recent
        self._max_drain = max_drain
        self._poll_ms = max(1, int(poll_interval * 1000))
        self._ctx: zmq.Context | None = None
        self._streams: dict[zmq.Socket, _Stream] = {}
        self._by_key: dict[tuple[str, int], _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._decoder = W.index_decoder()     # token ids skipped, not built
        self.error: BaseException | None = None   # what stopped the thread, if anything

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> KVEventSubscriber:
        if self._thread is not None:
            raise RuntimeError("KVEventSubscriber already started")
        self._ctx = zmq.Context()
        try:
            for spec in self._specs:
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, self._rcv_hwm)
                sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
                st = _Stream(spec, sub)
                self._streams[sub] = st        # registered first: closed on failure too
                self._by_key[spec.key] = st
                (sub.bind if spec.bind else sub.connect)(spec.endpoint)
                if spec.replay_endpoint is not None:
                    st.replay = self._replay_socket(spec)
                self.index.add_engine(*spec.key)
                if self.tier_index is not None:
                    self.tier_index.add_engine(*spec.key)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="hmacore-kv-events",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread (joined within ``timeout`` s: a loop turn is bounded by the poll
        interval plus one replay timeout), close every socket and the ZMQ context."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"KV event thread did not stop within {timeout} s")
        self._close_sockets()

    def __enter__(self) -> KVEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        for st in self._streams.values():
            st.sub.close(linger=0)
            if st.replay is not None:
                st.replay.close(linger=0)
        self._streams.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _replay_socket(self, spec: EngineStream) -> zmq.Socket:
        assert self._ctx is not None and spec.replay_endpoint is not None
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(spec.replay_endpoint)
        return s

    # -- observation ------------------------------------------------------------------------
    def stats(self) -> dict[tuple[str, int], StreamStats]:
        """A copy of every stream's counters, by engine key."""
        with self._cond:
            return {k: dataclasses.replace(st.stats) for k, st in self._by_key.items()}

    def wait_for(self, key: tuple[str, int], next_seq: int, timeout: float) -> bool:
        """Wait until stream ``key`` has accounted for batches ``0 .. next_seq - 1``; False
        on timeout (or when the thread stopped)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._by_key[key]
            while st.stats.next_seq < next_seq:
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None or self._stop.is_set():
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._streams:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(self._poll_ms):
                    drained: list[list[bytes]] = []
                    for _ in range(self._max_drain):
                        try:
                            drained.append(sock.recv_multipart(zmq.NOBLOCK))
                        except zmq.Again:
                            break
                    self._on_drained(self._streams[sock], drained)
        except BaseException as e:      # a bug: keep it for the owner, do not die silently
            logger.exception("KV event thread stopped")
            self.error = e
        finally:
            with self._cond:
                self._cond.notify_all()

    def _on_drained(self, st: _Stream, drained: list[list[bytes]]) -> None:
        """One loop turn's messages of one stream, in order: exactly as :meth:`_on_live` one
        by one, but a run of batches that each carry the sequence number expected next (what
        queues up while the subscriber is behind) is applied from their bytes in one call
        (:meth:`_apply_in_order`). With a ``tier_index`` every batch is its own call."""
        if self.tier_index is not None:
            for frames in drained:
                self._on_live(st, frames)
            return
        i, n = 0, len(drained)
        while i < n:
            seq0 = st.stats.next_seq
            run: list[bytes] = []
            while i + len(run) < n:
                frames = drained[i + len(run)]
                if len(frames) != 3 or len(frames[1]) != 8 \
                        or int.from_bytes(frames[1], "big") != seq0 + len(run):
                    break
                run.append(frames[2])
            if not run:
                self._on_live(st, drained[i])
                i += 1
                continue
            st.started = True
            self._apply_in_order(st, run)
            i += len(run)

    def _apply_in_order(self, st: _Stream, payloads: list[bytes]) -> None:
        """Batches whose sequence numbers run from the stream's ``next_seq`` on, applied in
        order: read from their bytes by the index in one compiled call
        (``RoutingIndex.apply_payloads``: no decoded objects) up to the first it declines,
        which takes the decoded path alone (applied, or dropped with the engine reset,
        exactly as alone), and so on after it. Counters, ``next_seq`` and the remembered
        digests are per batch."""
        while payloads:
            seq0 = st.stats.next_seq
            done = 0
            if self.tier_index is None:
                result, done = self.index.apply_payloads(
                    st.spec.key, payloads, dp_rank=st.spec.dp_rank, medium=W.MEDIUM_GPU,
                    spec_kinds=SPEC_KINDS)
                if done:
                    self._count(st, done, result, 0, seq0 + done)
                    for k in range(done):
                        self._remember(st, seq0 + k, payloads[k])
            if done < len(payloads):
                self._apply_decoded(st, seq0 + done, payloads[done])
                done += 1
            payloads = payloads[done:]

    def _on_live(self, st: _Stream, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            st.stats.bad_frames += 1
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        expected = st.stats.next_seq
        if st.started and seq < expected:
            if st.recent.get(seq) == _digest(payload):
                st.stats.duplicates += 1
                return
            logger.info("engine %s: new KV event stream (seq %d after %d): reset",
                        st.spec.key, seq, expected - 1)
            st.stats.restarts += 1
            self._reset(st, 0)
            st.recent.clear()
            expected = 0
        st.started = True
        if seq > expected:
            st.stats.gaps += 1
            self._replay(st, expected)
            if st.stats.next_seq < seq:       # the replay did not reach this batch
                self._reset(st, seq)
            if st.stats.next_seq > seq:       # the replay delivered it already
                st.stats.duplicates += 1
                return
        self._apply(st, seq, payload)

    def _reset(self, st: _Stream, next_seq: int) -> None:
        self.index.reset_engine(st.spec.key)
        if self.tier_index is not None:
            self.tier_index.reset_engine(st.spec.key)
        with self._cond:
            st.stats.resets += 1
            st.stats.next_seq = next_seq
            self._cond.notify_all()

    def _replay(self, st: _Stream, start: int) -> None:
        """Ask the replay endpoint for batches from ``start`` on and apply them in order;
        a hole at the front of what it holds resets the engine there."""
        if st.replay is None:
            return
        st.stats.replays += 1
        st.replay.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + self._replay_timeout
        pending: list[bytes] = []        # replayed in order from next_seq, not applied yet
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not st.replay.poll(left_ms):
                logger.warning("engine %s: replay from %d timed out", st.spec.key, start)
                st.stats.replay_failures += 1
                st.replay.close(linger=0)       # late answers must not meet the next request
                st.replay = self._replay_socket(st.spec)
                break
            frames = st.replay.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                st.stats.bad_frames += 1
                continue
            if frames[2] == W.REPLAY_END_SEQ:
                break
            seq = int.from_bytes(frames[2], "big")
            if seq < st.stats.next_seq + len(pending):
                continue
            if seq > st.stats.next_seq + len(pending):    # no longer buffered by the engine
                self._apply_in_order(st, pending)
                pending = []
                self._reset(st, seq)
            pending.append(frames[3])
            st.stats.replayed += 1
        self._apply_in_order(st, pending)

    def _apply(self, st: _Stream, seq: int, payload: bytes) -> None:
        """Batch ``seq`` (the stream's ``next_seq``)."""
        self._apply_in_order(st, [payload])

    def _apply_decoded(self, st: _Stream, seq: int, payload: bytes) -> None:
        """The decoded path: msgspec's structs to ``apply_events``; a batch that does not
        decode, names another DP rank or is refused is dropped (the engine reset)."""
        try:
            batch = self._decode(st, payload)
        except (*W.DECODE_ERRORS, HmacoreError) as e:
            self._drop(st, seq, payload, e)
            return
        self._apply_batch(st, seq, payload, batch)

    def _decode(self, st: _Stream, payload: bytes) -> W.IndexEventBatch:
        """The payload's batch; raises if it does not decode or names another DP rank."""
        batch = self._decoder.decode(payload)
        rank = st.spec.dp_rank if batch.data_parallel_rank is None \
            else batch.data_parallel_rank
        if rank != st.spec.dp_rank:
            raise ArgumentValueError(f"batch of data-parallel rank {rank} on the stream of "
                                     f"rank {st.spec.dp_rank}")
        return batch

    def _apply_batch(self, st: _Stream, seq: int, payload: bytes,
                     batch: W.IndexEventBatch) -> None:
        try:
            result = self.index.apply_events(st.spec.key, batch.events, _EVENT_TYPES,
                                             medium=W.MEDIUM_GPU, spec_kinds=SPEC_KINDS)
            tier_rows = 0
            if result.other_medium and self.tier_index is not None:
                tier = self._tier_rows(batch)
                self.tier_index.apply(st.spec.key, *tier)
                tier_rows = len(tier[0])
        except HmacoreError as e:
            self._drop(st, seq, payload, e)
            return
        self._count(st, 1, result, tier_rows, seq + 1)
        self._remember(st, seq, payload)

    def _drop(self, st: _Stream, seq: int, payload: bytes, error: Exception) -> None:
        """A batch that did not decode, named another DP rank or was refused: its events
        are lost, so the engine is reset (``bad_batches``)."""
        logger.warning("engine %s: KV event batch %d dropped (%s): reset", st.spec.key, seq,
                       error)
        st.stats.bad_batches += 1
        self._reset(st, seq + 1)
        self._remember(st, seq, payload)

    def _count(self, st: _Stream, batches: int, result: ApplyStats, tier_rows: int,
               next_seq: int) -> None:
        with self._cond:
            s = st.stats
            s.batches += batches
            s.stored += result.stored
            s.removed += result.removed
            s.ignored += result.ignored
            s.cleared += result.cleared
            s.tier_rows += tier_rows
            s.other_medium += 0 if self.tier_index is not None else result.other_medium
            s.lookahead += result.lookahead
            s.next_seq = next_seq
            self._cond.notify_all()

    def _remember(self, st: _Stream, seq: int, payload: bytes) -> None:
        st.recent[seq] = _digest(payload)
        while len(st.recent) > self._recent:
            st.recent.popitem(last=False)

    def _tier_rows(self, batch: W.IndexEventBatch) -> tuple[list, list, list]:
        """(ops, groups, hashes) of the events on another medium than the GPU, flattened to
        one row per hash, in order (the GPU events were applied by ``apply_events``, which
        validated the whole batch)."""
        ops: list[int] = []
        groups: list[int] = []
        hashes: list[Hashable] = []
        for ev in batch.events:
            if isinstance(ev, W.IndexAllBlocksCleared) or ev.medium is None \
                    or ev.medium == W.MEDIUM_GPU:
                continue
            n = len(ev.block_hashes)
            ops.extend([OP_STORE if isinstance(ev, W.IndexBlockStored) else OP_REMOVE] * n)
            groups.extend([0 if ev.group_idx is None else ev.group_idx] * n)
            hashes.extend(ev.block_hashes)
        return ops, groups, hashes

"""vLLM's KV event wire format, pinned per vLLM version (no vLLM import).

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) sends one multipart message
per ``KVEventBatch``: ``(topic, seq, payload)`` with ``seq`` an 8-byte big-endian counter that
starts at 0 per publisher and ``payload`` the batch in msgpack (msgspec). The batch is an
array ``[ts, events, data_parallel_rank]``; each event a map tagged by ``"type"``
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), fields with default values left
out. The replay socket (ROUTER) takes ``(b"", start_seq)`` from a DEALER and answers every
buffered ``(b"", topic, seq, payload)`` with ``seq >= start_seq``, then ``(b"", b"", -1, b"")``.

The structs below decode that format for vLLM 0.32 and 0.33 (0.33 adds
``BlockStored.lookahead_token_ids``);
tests/vllm/test_kv_events.py checks them against the installed vLLM's own classes, so a
schema change fails there first. Unknown fields are ignored (vLLM adds optional fields).

The subscriber decodes with :func:`index_decoder`: the ``Index*`` structs carry only the
fields the routing index reads (hashes, medium, group, spec kind, lookahead), so msgspec skips
the token ids (``block_size`` ints per stored hash, most of a batch's bytes) without building
an int object for each: the subscriber's time per vLLM-like stream (decode + apply) fell
2.8-10x against the full schema (docs/routing.md, "From the payload"). A field the index
does not read is then not validated either.
"""
from __future__ import annotations

import msgspec

__all__ = ["WIRE_VERSIONS", "BlockStored", "BlockRemoved", "AllBlocksCleared", "EventBatch",
           "REPLAY_END_SEQ", "decoder", "MEDIUM_GPU", "IndexBlockStored", "IndexBlockRemoved",
           "IndexAllBlocksCleared", "IndexEventBatch", "INDEX_EVENT_TYPES", "index_decoder",
           "DECODE_ERRORS"]

#: vLLM versions whose wire format these structs decode
WIRE_VERSIONS = ("0.32", "0.33")
#: the replay socket's end-of-replay sequence number (8 bytes, big-endian, signed -1)
REPLAY_END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    #: vLLM 0.33: tokens beyond each block that its hash covers (lookahead hashing); a
    #: router hashing token ids cannot reproduce such hashes (see docs/routing.md)
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


#: what a decoder raises for a payload that is not a batch: msgspec's DecodeError /
#: ValidationError, and also UnicodeDecodeError (a str that is not UTF-8) and RecursionError
#: (nesting past msgspec's depth limit), which are not msgspec's own classes; found by
#: fuzz/fuzz_kv_payload.py (either used to end the subscriber's thread)
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError,
                 RecursionError)


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder of one payload into an :class:`EventBatch` (raises one of
    :data:`DECODE_ERRORS` on anything else)."""
    return msgspec.msgpack.Decoder(EventBatch)


# -- what the routing index reads: the subscriber's decoding ----------------------------------
class IndexBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """``BlockStored`` without the fields the index does not read (token ids, parent hash,
    block size, LoRA): msgspec skips them in C."""
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class IndexBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class IndexAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True,
                            gc=False):
    pass


class IndexEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[IndexBlockStored | IndexBlockRemoved | IndexAllBlocksCleared]
    data_parallel_rank: int | None = None


#: the classes ``index_decoder`` decodes events into (``RoutingIndex.apply_events``' types)
INDEX_EVENT_TYPES = (IndexBlockStored, IndexBlockRemoved, IndexAllBlocksCleared)


def index_decoder() -> msgspec.msgpack.Decoder:
    """A decoder of one payload into an :class:`IndexEventBatch` (the subscriber's): the
    fields the routing index reads, the rest skipped unbuilt."""
    return msgspec.msgpack.Decoder(IndexEventBatch)

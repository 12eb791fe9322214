"""Versioned peer handshake over a loopback TCP socket (no NIXL import here).

Each side sends one length-prefixed JSON frame: protocol version, agent name and NIXL agent
metadata, layout fingerprint, HMA on/off, block sizes, pool size, memory type and the region
table of its transfer plan. A compatibility hash covers everything both peers must agree on
(version, fingerprint, HMA flag, block sizes and each region's shape: block bytes, descriptors
per block, owning group, state flag) but not addresses or pool sizes, which legitimately
differ. Any mismatch, malformed frame, refused connection or timeout raises HandshakeError.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from ..errors import HandshakeError, HmacoreError
from ..plan import TransferPlan
from ..spec import KVLayout

__all__ = ["PROTOCOL_VERSION", "HandshakePayload", "HandshakeServer", "exchange_handshake"]

PROTOCOL_VERSION = 1
_MAX_FRAME = 64 << 20  # bytes; a region table of 100k regions fits easily


@dataclasses.dataclass(frozen=True)
class HandshakePayload:
    """What one peer tells the other. ``regions`` is ``TransferPlan.region_table()``."""

    version: int
    agent_name: str
    agent_metadata: bytes
    layout_fingerprint: str
    hma: bool
    block_sizes: tuple[int, ...]
    num_blocks: int
    mem_type: str
    regions: tuple[dict[str, Any], ...]

    @classmethod
    def for_plan(cls, plan: TransferPlan, agent_name: str, agent_metadata: bytes, *,
                 hma: bool = True) -> HandshakePayload:
        return cls(PROTOCOL_VERSION, agent_name, bytes(agent_metadata), plan.layout.fingerprint(),
                   bool(hma), plan.layout.block_sizes, plan.regions[0].logical_blocks,
                   plan.mem_type, tuple(plan.region_table()))

    @property
    def compatibility_hash(self) -> str:
        """Hex digest of everything two peers must agree on (not addresses, not pool sizes)."""
        shape = [(int(r["block_len"]) // int(r["ratio"]), int(r["ratio"]), int(r["group"]),
                  bool(r["state"])) for r in self.regions]
        doc = [self.version, self.layout_fingerprint, self.hma, list(self.block_sizes), shape]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]

    def check_compatible(self, other: HandshakePayload) -> None:
        """Raise HandshakeError naming the first field on which the peers disagree."""
        for field, a, b in (("version", self.version, other.version),
                            ("layout fingerprint", self.layout_fingerprint, other.layout_fingerprint),
                            ("HMA on/off", self.hma, other.hma),
                            ("block sizes", self.block_sizes, other.block_sizes),
                            ("region count", len(self.regions), len(other.regions))):
            if a != b:
                raise HandshakeError(f"peer {other.agent_name!r} disagrees on {field}: "
                                     f"local {a!r}, remote {b!r}")
        if self.compatibility_hash != other.compatibility_hash:
            raise HandshakeError(f"peer {other.agent_name!r} disagrees on region shapes "
                                 f"(compatibility hash {self.compatibility_hash} vs "
                                 f"{other.compatibility_hash})")

    def remote_plan(self, layout: KVLayout) -> TransferPlan:
        """The peer's transfer plan (its addresses) for a layout both sides agreed on."""
        return TransferPlan.from_region_table(layout, self.regions, mem_type=self.mem_type)

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        d["block_sizes"] = list(self.block_sizes)
        d["regions"] = list(self.regions)
        d["compatibility_hash"] = self.compatibility_hash
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> HandshakePayload:
        try:
            d = json.loads(data)
            p = cls(int(d["version"]), str(d["agent_name"]), base64.b64decode(d["agent_metadata"]),
                    str(d["layout_fingerprint"]), bool(d["hma"]),
                    tuple(int(b) for b in d["block_sizes"]), int(d["num_blocks"]),
                    str(d["mem_type"]), tuple(dict(r) for r in d["regions"]))
            claimed = d["compatibility_hash"]
        except (ValueError, KeyError, TypeError) as e:
            raise HandshakeError(f"malformed handshake payload: {e}") from None
        if p.version != PROTOCOL_VERSION:
            raise HandshakeError(f"peer speaks handshake version {p.version}, this side "
                                 f"{PROTOCOL_VERSION}")
        if claimed != p.compatibility_hash:
            raise HandshakeError("handshake payload's compatibility hash does not match its content")
        return p


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise HandshakeError("peer closed the handshake connection early")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise HandshakeError(f"handshake frame of {n} bytes exceeds {_MAX_FRAME}")
    return _recv_exact(sock, n)


class HandshakeServer:
    """Answers handshakes on ``host:port`` (port 0 = pick one) from a background thread.

    For each client: receive its payload, check compatibility, reply with ours (or an error
    frame), then call ``on_peer(payload)`` for accepted clients. Every socket op is bounded by
    ``timeout`` seconds. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, payload: HandshakePayload, *, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 5.0, on_peer: Callable[[HandshakePayload], None] | None = None):
        self.payload = payload
        self.timeout = timeout
        self.on_peer = on_peer
        self.errors: list[str] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hmacore-handshake", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(self.timeout)
                try:
                    peer = HandshakePayload.from_bytes(_recv_frame(conn))
                    self.payload.check_compatible(peer)
                    _send_frame(conn, b"OK" + self.payload.to_bytes())
                except (HmacoreError, OSError) as e:
                    self.errors.append(str(e))
                    try:
                        _send_frame(conn, b"NO" + str(e).encode())
                    except OSError:
                        pass
                    continue
            if self.on_peer is not None:
                try:
                    self.on_peer(peer)
                except Exception as e:  # noqa: BLE001 - recorded, the server keeps serving
                    self.errors.append(f"on_peer: {e}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def __enter__(self) -> HandshakeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def exchange_handshake(host: str, port: int, local: HandshakePayload, *,
                       timeout: float = 5.0) -> HandshakePayload:
    """Send ``local`` to the server at ``host:port``, return its payload once both sides agree.

    Raises HandshakeError on refusal, timeout, a malformed reply or any incompatibility.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            _send_frame(sock, local.to_bytes())
            reply = _recv_frame(sock)
    except HandshakeError:
        raise
    except OSError as e:
        raise HandshakeError(f"handshake with {host}:{port} failed: {e}") from None
    if reply[:2] == b"NO":
        raise HandshakeError(f"peer at {host}:{port} rejected the handshake: "
                             f"{reply[2:].decode(errors='replace')}")
    if reply[:2] != b"OK":
        raise HandshakeError(f"peer at {host}:{port} sent a malformed handshake reply")
    remote = HandshakePayload.from_bytes(reply[2:])
    local.check_compatible(remote)
    return remote

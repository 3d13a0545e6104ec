"""What HTTP/3 needs bounded that aioquic leaves open, and the accounting to bound it.

aioquic is a correct QUIC stack, not a hardened server. Checked in aioquic 1.7 (and relied on):

- **Anti-amplification**: before a client's address is validated a connection sends at most three
  times what it received (RFC 9000 section 8.1), so spoofed Initials cannot turn the gateway into
  a reflector. Address validation comes with the Handshake packet or a Retry token.
- **Paths**: at most ``MAX_NETWORK_PATHS`` (8) per connection, path challenges capped
  (``MAX_LOCAL_CHALLENGES``, ``MAX_REMOTE_CHALLENGES``), connection ids retired in bounded batches.
- **CRYPTO data** waiting ahead of the handshake is refused past ``MAX_PENDING_CRYPTO`` per epoch
  (CRYPTO_BUFFER_EXCEEDED). aioquic's bound is 512 KiB, and the buffer is a ``bytearray`` grown to
  the highest offset seen, so one 1200-byte Initial whose CRYPTO frame claims offset 500 000 makes
  the server allocate half a megabyte. ``bound_crypto_buffers`` lowers it (a ClientHello with a
  post-quantum key share is ~2 KB; nothing a client sends later in CRYPTO frames is larger).
- **Idle connections** close ``idle_timeout`` after the last packet received, armed on the very
  first datagram, so a half-open connection is reclaimed even if it never decrypts.

What it does not do, and this module does:

- **Concurrent request streams.** aioquic announces 128 bidirectional streams and gives the peer one
  more each time a stream is finished at the QUIC level, which is when the request's FIN (or
  RESET_STREAM) and our reset or last byte are acknowledged, not when the app's task for it has
  returned. A client that opens a request and cancels it at once (HTTP/2's "rapid reset") gets its
  credit back while the task still runs. ``H3Protocol`` counts its own streams (app running, or the
  upload of an early-answered request being drained) and refuses those over
  ``max_concurrent_streams`` with H3_REQUEST_REJECTED (RFC 9114 section 4.1.1: not processed, safe
  to retry). The QUIC-level limit is set to the same number, so a well-behaved client never meets
  the refusal.
- **The connection table.** aioquic creates a connection for every Initial of 1200 bytes or more.
  ``GuardedQuicServer`` drops Initials for new connections once ``max_connections`` are open
  (silently: an answer costs key derivation and AEAD per packet, and Chromium, which races TCP,
  falls back either way), and answers with a Retry (stateless; the client must prove its address
  in one more round trip before any state is kept) when ``retry`` is ``always``, or in ``auto``
  once ``retry_above_handshakes`` handshakes are unfinished: a flood of spoofed Initials then
  creates nothing.
- **Handshakes that never finish** are closed after ``handshake_timeout_s``, well before the idle
  timeout a connection that did finish gets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import aioquic.quic.connection as quic_connection
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from aioquic.quic.retry import QuicRetryTokenHandler

SMALLEST_INITIAL = 1200  # RFC 9000 section 14.1: smaller Initials never create a connection

RetryMode = Literal["auto", "always", "never"]


@dataclass(frozen=True, slots=True)
class H3Limits:
    """Per-listener bounds for HTTP/3 (see the module doc and docs/configuration.md)."""

    max_connections: int = 2048
    max_concurrent_streams: int = 128  # request streams per connection
    max_uni_streams: int = 16  # control + 2 QPACK streams are all HTTP/3 needs; the rest is slack
    handshake_timeout_s: float = 10.0
    retry: RetryMode = "auto"
    retry_above_handshakes: int = 64
    max_crypto_buffer_bytes: int = 16 * 1024
    drain_body_bytes: int = 16 * 1024 * 1024  # after an early answer, upload still accepted ...
    drain_body_s: float = 10.0  # ... for this long, before STOP_SENDING H3_NO_ERROR


@dataclass(slots=True)
class H3Stats:
    """Counts for tests and metrics (monotonic, except the two gauges)."""

    connections: int = 0  # open (gauge)
    handshaking: int = 0  # of those, handshake not done (gauge)
    initials_dropped: int = 0  # new connections refused: table full
    retries_sent: int = 0
    handshakes_timed_out: int = 0
    streams_rejected: int = 0  # over max_concurrent_streams
    drains_completed: int = 0  # early answer, and the client then finished its upload
    drains_stopped: int = 0  # early answer, upload stopped with STOP_SENDING H3_NO_ERROR
    stalls: int = 0  # streams reset because the client did not read


def bound_crypto_buffers(limit: int) -> None:
    """Lower aioquic's per-epoch bound on buffered CRYPTO data (a module global, read per frame;
    process-wide, which is what a gateway process wants)."""
    quic_connection.MAX_PENDING_CRYPTO = limit


def apply_stream_limits(quic: quic_connection.QuicConnection, limits: H3Limits) -> None:
    """Announce our own stream caps as the QUIC limits (before the first datagram is handled: the
    transport parameters are built then). aioquic has no setting for them."""
    for limit, value in (
        (quic._local_max_streams_bidi, limits.max_concurrent_streams),
        (quic._local_max_streams_uni, limits.max_uni_streams),
    ):
        limit.value = limit.sent = value  # "sent": the transport parameter announces it


class GuardedQuicServer(QuicServer):
    """aioquic's server with a capped connection table and Retry under a handshake flood."""

    def __init__(self, *, limits: H3Limits, stats: H3Stats, **kwargs: Any) -> None:
        super().__init__(retry=False, **kwargs)
        self.limits = limits
        self.stats = stats
        self._tokens = QuicRetryTokenHandler()  # kept even while Retry is off, to check tokens
        self._cid_length = kwargs["configuration"].connection_id_length

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if data and data[0] & 0x80 and len(data) >= SMALLEST_INITIAL:  # type: ignore[operator]
            # a long header big enough to be a new connection's Initial: decide before aioquic does
            # (short-header packets, the bulk of the traffic, go straight through)
            try:
                header = pull_quic_header(Buffer(data=data), host_cid_length=self._cid_length)  # type: ignore[arg-type]
            except ValueError:
                return
            if (
                header.packet_type == QuicPacketType.INITIAL
                and header.destination_cid not in self._protocols
                and not self._admit(header.token)
            ):
                return
        super().datagram_received(data, addr)

    def _admit(self, token: bytes) -> bool:
        """Whether this new connection's Initial may proceed; sets aioquic's Retry on or off for it."""
        stats, limits = self.stats, self.limits
        if stats.connections >= limits.max_connections:
            stats.initials_dropped += 1
            return False
        if token:
            self._retry = self._tokens  # a client answering our Retry: its token must be checked
        elif limits.retry == "always" or (
            limits.retry == "auto" and stats.handshaking >= limits.retry_above_handshakes
        ):
            self._retry = self._tokens
            stats.retries_sent += 1
        else:
            self._retry = None
        return True


# Set by a process that shares its HTTP/3 port with sibling processes (``serve --workers N``): the
# UDP socket is bound with SO_REUSEPORT, and the kernel keeps each client's 4-tuple on one socket.
REUSE_PORT = False


async def serve_guarded(
    host: str, port: int, *, limits: H3Limits, stats: H3Stats, configuration: Any, create_protocol: Any
) -> GuardedQuicServer:
    """``aioquic.asyncio.serve`` with ``GuardedQuicServer``."""
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_datagram_endpoint(
        lambda: GuardedQuicServer(
            limits=limits, stats=stats, configuration=configuration, create_protocol=create_protocol
        ),
        local_addr=(host, port),
        reuse_port=REUSE_PORT or None,
    )
    return protocol

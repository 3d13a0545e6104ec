"""Kernel timestamps of TCP FIN and RST segments on loopback, for the disconnect benchmark.

A proxy's disconnect latency is the time from the client's FIN reaching it to its own FIN (or RST)
leaving for the pod. Timestamps taken by the client and the pod simulator in Python include their
own event loops' delays, which under a burst of a thousand departures are tens of milliseconds
(nginx measured that way looked 40 ms slow at p99). A packet socket stamps each segment in the
kernel as it crosses ``lo``; only FIN/RST segments pass its BPF filter, so a busy stream does not
flood it. Needs CAP_NET_RAW (root); ``FinCapture.start`` returns False where that is missing.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading

ETH_P_ALL = 0x0003
SO_ATTACH_FILTER = 26
SO_TIMESTAMPNS = 35
PACKET_OUTGOING = 4
TCP_FIN, TCP_RST = 0x01, 0x04

# Classic BPF: IPv4, TCP, first fragment, (FIN | RST) set in the TCP flags. Offsets are for the
# 14-byte Ethernet header that Linux gives loopback packets.
_FILTER = [
    (0x28, 0, 0, 12),  # ldh [12]               ethertype
    (0x15, 0, 8, 0x0800),  # jeq IPv4, else drop
    (0x30, 0, 0, 23),  # ldb [23]               IP protocol
    (0x15, 0, 6, 6),  # jeq TCP, else drop
    (0x28, 0, 0, 20),  # ldh [20]               fragment offset
    (0x45, 4, 0, 0x1FFF),  # jset -> drop (a later fragment has no TCP header)
    (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf)      IP header length
    (0x50, 0, 0, 27),  # ldb [x+27]             TCP flags (14 + 13)
    (0x45, 0, 1, TCP_FIN | TCP_RST),  # jset -> accept, else drop
    (0x06, 0, 0, 0x40000),  # accept
    (0x06, 0, 0, 0),  # drop
]


class FinCapture:
    """The first FIN or RST per (source port, destination port) seen on ``lo``, by kernel time (s)."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, int], float] = {}
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._filter_buf: ctypes.Array[ctypes.c_char] | None = None

    def start(self) -> bool:
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        except (PermissionError, OSError):
            return False
        program = b"".join(struct.pack("HBBI", *insn) for insn in _FILTER)
        self._filter_buf = ctypes.create_string_buffer(program, len(program))
        fprog = struct.pack("HL", len(_FILTER), ctypes.addressof(self._filter_buf))
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind(("lo", 0))
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="fincap", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        cmsg_space = socket.CMSG_SPACE(16)
        while self._sock is not None:
            try:
                data, ancdata, _flags, addr = sock.recvmsg(128, cmsg_space)
            except TimeoutError:
                continue
            except OSError:
                return
            if addr[2] != PACKET_OUTGOING:
                continue  # loopback shows each segment twice: as sent and as received
            stamp = None
            for level, kind, value in ancdata:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", value[:16])
                    stamp = sec + nsec / 1e9
            ports = parse_ports(data)
            if stamp is not None and ports is not None:
                self.first.setdefault(ports, stamp)

    def stop(self) -> None:
        sock, self._sock = self._sock, None
        if self._thread is not None:
            self._thread.join(timeout=2)
        if sock is not None:
            sock.close()


def parse_ports(frame: bytes) -> tuple[int, int] | None:
    """(source port, destination port) of a TCP segment in an Ethernet frame, else None."""
    if len(frame) < 34:
        return None
    ihl = (frame[14] & 0x0F) * 4
    if len(frame) < 14 + ihl + 4:
        return None
    src, dst = struct.unpack_from("!HH", frame, 14 + ihl)
    return src, dst

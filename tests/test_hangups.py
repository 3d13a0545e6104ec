"""The hang-up watcher's thread, over real loopback TCP, with no event loop running at all.

Each test builds two connections: the gateway's side of a client connection (paired) and the
gateway's side of a pod connection (the upstream). "The pod" is the far end of the second one; it
sees EOF when the thread shuts the gateway's side down.
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterator

import pytest

from tests.conftest import wait_for
from transports.hangups import HangupWatcher, Pairing


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """(near, far): two ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        far = socket.create_connection(listener.getsockname())
        near, _ = listener.accept()
    return near, far


Sock = socket.socket


def attached(watcher: HangupWatcher) -> tuple[Pairing, Sock, Sock, Sock, Sock]:
    """A client connection paired with the pod connection serving it:
    (pairing, gateway's client side, the client, gateway's pod side, the pod)."""
    gw_client, client = tcp_pair()
    gw_pod, pod = tcp_pair()
    pairing = watcher.pair(gw_client)
    assert pairing is not None
    watcher.set_upstream(pairing, gw_pod)
    return pairing, gw_client, client, gw_pod, pod


@pytest.fixture
def watcher() -> Iterator[HangupWatcher]:
    w = HangupWatcher()
    yield w
    w.close()


def pod_sees_eof(pod: socket.socket, timeout_s: float = 5.0) -> bool:
    pod.settimeout(timeout_s)
    try:
        return pod.recv(1) == b""
    except TimeoutError:
        return False


def pod_still_open(pod: socket.socket) -> bool:
    pod.setblocking(False)
    try:
        return pod.recv(1) != b""
    except BlockingIOError:
        return True


def test_client_hanging_up_shuts_the_pod_socket_down(watcher: HangupWatcher) -> None:
    pairing, gw_client, client, gw_pod, pod = attached(watcher)
    client.close()  # FIN; nothing else in this process reads gw_client
    assert pod_sees_eof(pod)
    assert wait_for(lambda: watcher.shut_down == 1)  # counted just after the shutdown
    watcher.unpair(pairing)
    for s in (gw_client, gw_pod, pod):
        s.close()


def test_a_reset_counts_as_a_hang_up(watcher: HangupWatcher) -> None:
    pairing, gw_client, client, gw_pod, pod = attached(watcher)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    client.close()  # RST
    assert pod_sees_eof(pod)
    watcher.unpair(pairing)
    for s in (gw_client, gw_pod, pod):
        s.close()


def test_an_unpaired_or_detached_pod_socket_is_left_alone(watcher: HangupWatcher) -> None:
    """A pod connection handed back to the keep-alive pool must survive its old client leaving."""
    sockets = []
    left_alone = []
    for detach in ("unpair", "set_upstream(None)"):
        pairing, gw_client, client, gw_pod, pod = attached(watcher)
        if detach == "unpair":
            watcher.unpair(pairing)
        else:
            watcher.set_upstream(pairing, None)
        client.close()
        left_alone.append(pod)
        sockets += [gw_client, gw_pod, pod]
    # A paired client that leaves after them: once its pod sees EOF, the thread has been through
    # every earlier hang-up too.
    pairing, gw_client, client, gw_pod, pod = attached(watcher)
    client.close()
    assert pod_sees_eof(pod)
    assert wait_for(lambda: watcher.shut_down == 1)  # counted just after the shutdown
    assert all(pod_still_open(p) for p in left_alone)
    for s in [*sockets, gw_client, gw_pod, pod]:
        s.close()


def test_a_pod_socket_attached_after_the_client_left_is_shut_down_at_once(watcher: HangupWatcher) -> None:
    gw_client, client = tcp_pair()
    pairing = watcher.pair(gw_client)
    assert pairing is not None
    client.close()
    # The client left while the gateway was still connecting to the pod. Wait until the thread
    # has seen the hang-up, with a second pairing as the marker.
    mark, marker_client, marker, marker_gw_pod, marker_pod = attached(watcher)
    marker.close()
    assert pod_sees_eof(marker_pod)
    gw_pod, pod = tcp_pair()
    watcher.set_upstream(pairing, gw_pod)
    assert pod_sees_eof(pod)  # the thread will not fire again for it: set_upstream did this
    for p in (pairing, mark):
        watcher.unpair(p)
    for s in (gw_client, gw_pod, pod, marker_client, marker_gw_pod, marker_pod):
        s.close()


def test_pairings_hold_no_descriptors_after_unpair_and_close() -> None:
    before = len(os.listdir("/proc/self/fd"))
    watcher = HangupWatcher()
    conns = [(tcp_pair(), tcp_pair()) for _ in range(20)]
    pairings = []
    for (gw_client, _), (gw_pod, _) in conns:
        pairing = watcher.pair(gw_client)
        assert pairing is not None
        watcher.set_upstream(pairing, gw_pod)
        pairings.append(pairing)
    for pairing in pairings[:10]:
        watcher.unpair(pairing)
    assert watcher.pairs == 10
    watcher.close()  # the other ten are released with it
    for pair in conns:
        for near_far in pair:
            for s in near_far:
                s.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_hang_up_is_not_taken_for_the_next_client_given_the_same_descriptor(watcher: HangupWatcher) -> None:
    """A keep-alive client leaves just as another request comes in: the thread's wait returned the
    leaver's event, and before the thread took the lock the event loop unpaired the leaver and
    paired the newcomer, whose ``dup`` got the same descriptor number. The newcomer's pod
    connection must survive that event, and the newcomer's own hang-up must still reach it."""
    leaver_gw, leaver = tcp_pair()
    old = watcher.pair(leaver_gw)
    assert old is not None
    stale_event = (old.client, select.EPOLLRDHUP)
    watcher.unpair(old)
    new, gw_client, client, gw_pod, pod = attached(watcher)
    assert new.client == stale_event[0]  # the lowest free number: the one just closed
    watcher._handle([stale_event])  # the thread acting on the wait that returned the leaver's event
    assert pod_still_open(pod)
    assert watcher.shut_down == 0
    client.close()
    assert pod_sees_eof(pod)
    assert wait_for(lambda: watcher.shut_down == 1)  # counted just after the shutdown
    watcher.unpair(new)
    for s in (leaver_gw, leaver, gw_client, gw_pod, pod):
        s.close()


class _Connection:
    """A client connection as ``pair_connection`` sees it: its transport and its protocol."""

    def __init__(self, sock: socket.socket, protocol: object) -> None:
        self._sock = sock
        self._protocol = protocol

    def get_protocol(self) -> object:
        return self._protocol

    def get_extra_info(self, name: str) -> object:
        return self._sock if name == "socket" else None


class _KeepingProtocol:
    hangup_pairing: Pairing | None = None


def test_a_keep_alive_connection_keeps_one_pairing_for_all_its_requests(watcher: HangupWatcher) -> None:
    """Each request on the connection gets the connection's pairing (no new descriptor); the pod
    socket of its second request is still shut down when the client leaves then; the connection's
    end releases its descriptors."""
    before = len(os.listdir("/proc/self/fd"))
    gw_client, client = tcp_pair()
    protocol = _KeepingProtocol()
    conn = _Connection(gw_client, protocol)
    first, kept = watcher.pair_connection(conn)
    assert first is not None and kept
    first_pod_gw, first_pod = tcp_pair()
    watcher.set_upstream(first, first_pod_gw)
    watcher.set_upstream(first, None)  # the first request ends; its pod connection goes back
    fds_between_requests = len(os.listdir("/proc/self/fd"))
    second, kept = watcher.pair_connection(conn)
    assert second is first and kept and watcher.pairs == 1
    assert len(os.listdir("/proc/self/fd")) == fds_between_requests
    gw_pod, pod = tcp_pair()
    watcher.set_upstream(second, gw_pod)
    client.close()
    assert pod_sees_eof(pod)
    assert pod_still_open(first_pod)  # back in the pool before the client left: left alone
    second.release()  # the protocol's connection_lost
    assert watcher.pairs == 0
    for s in (gw_client, first_pod_gw, first_pod, gw_pod, pod):
        s.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_protocol_that_keeps_no_pairing_gets_one_per_request(watcher: HangupWatcher) -> None:
    gw_client, client = tcp_pair()
    conn = _Connection(gw_client, object())
    one, kept_one = watcher.pair_connection(conn)
    two, kept_two = watcher.pair_connection(conn)
    assert one is not None and two is not None and one is not two
    assert not kept_one and not kept_two
    watcher.unpair(one)
    watcher.unpair(two)
    assert watcher.pairs == 0
    for s in (gw_client, client):
        s.close()


def test_a_pairing_released_after_the_watcher_closed_closes_nothing_of_anyone_else() -> None:
    """A connection outliving the watcher (the app's shutdown closes the watcher first) releases
    its pairing later: the watcher closed those descriptors, and their numbers may be another
    socket's by then."""
    watcher = HangupWatcher()
    gw_client, client = tcp_pair()
    pairing = watcher.pair(gw_client)
    assert pairing is not None
    number = pairing.client
    watcher.close()
    others = [s for _ in range(3) for s in tcp_pair()]
    (reused,) = [s for s in others if s.fileno() == number]  # the lowest free numbers are given out
    pairing.release()
    watcher.set_upstream(pairing, None)
    reused.getsockname()  # still open: raises OSError on a closed descriptor
    for s in (gw_client, client, *others):
        s.close()


def test_a_pod_connection_lends_one_descriptor_to_every_request_it_serves(watcher: HangupWatcher) -> None:
    """A pooled pod connection keeps its copy of the socket between requests: each request's pairing
    is lent it (no new descriptor) and gives it back at its end (``take_upstream``), after which a
    client leaving cannot touch it; the next request's client leaving still shuts the pod down."""
    before = len(os.listdir("/proc/self/fd"))
    gw_pod, pod = tcp_pair()
    kept = os.dup(gw_pod.fileno())  # the connection's copy (made by the first request's watch)
    first_gw, first_client = tcp_pair()
    first = watcher.pair(first_gw)
    assert first is not None
    assert watcher.set_upstream(first, None, kept) == kept
    assert watcher.take_upstream(first, kept) == kept  # the request ends: the copy goes back
    first_client.close()  # this client leaves after its request: the pod connection is not its own
    watcher.unpair(first)
    assert pod_still_open(pod)
    second_gw, second_client = tcp_pair()
    second = watcher.pair(second_gw)
    assert second is not None
    lent = len(os.listdir("/proc/self/fd"))
    watcher.set_upstream(second, None, kept)
    assert len(os.listdir("/proc/self/fd")) == lent  # lent again: no descriptor made for it
    second_client.close()
    assert pod_sees_eof(pod)
    assert watcher.take_upstream(second, kept) == kept
    os.close(kept)
    watcher.unpair(second)
    assert watcher.take_upstream(second, kept) == -1  # forgotten: nothing to hand back
    for s in (gw_pod, pod, first_gw, second_gw):
        s.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_copy_another_request_replaced_is_not_handed_back(watcher: HangupWatcher) -> None:
    """Two requests' watches on one kept pairing (the second set its pod before the first took its
    back): the first asks back by the descriptor it was given, gets nothing (the second's
    ``set_upstream`` closed it), and the second's copy stays watched, not given to the wrong pod
    connection."""
    gw_client, client = tcp_pair()
    pairing = watcher.pair(gw_client)
    assert pairing is not None
    first_gw, first_pod = tcp_pair()
    second_gw, second_pod = tcp_pair()
    first = watcher.set_upstream(pairing, first_gw)
    second = watcher.set_upstream(pairing, second_gw)  # closes the first's copy
    assert watcher.take_upstream(pairing, first) == -1
    client.close()
    assert pod_sees_eof(second_pod)  # still the pairing's, still shut down when the client leaves
    assert pod_still_open(first_pod)
    assert watcher.take_upstream(pairing, second) == second
    os.close(second)
    watcher.unpair(pairing)
    for s in (gw_client, first_gw, first_pod, second_gw, second_pod):
        s.close()

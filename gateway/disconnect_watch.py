"""Learning at once that the client of a request left, and stopping the pod's work for it.

uvicorn reports a disconnect only through ``receive()``, and a ``send()`` to a closed connection
silently does nothing; without a watch a stream whose client left would keep the pod generating
until its natural end.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from transports.h1_disconnect import client_transport_of, trip_on_disconnect
from transports.hangups import HangupWatcher, Pairing
from transports.pod_client import PodResponse

if TYPE_CHECKING:
    from gateway.exchange import Receive


class DisconnectWatch:
    """Closes the pod answer and cancels the request's task the moment the client goes away.

    uvicorn reports a disconnect only through ``receive()``, and a ``send()`` to a closed
    connection silently does nothing; without this watch a stream whose client left would keep
    the pod generating until its natural end. Under uvicorn's HTTP/1.1 a tripwire calls back from
    the protocol's own I/O callback, and the hang-up watcher's thread shuts the pod socket down even
    before that; under any other server a task awaits ``receive()``.
    """

    __slots__ = (
        "_lent", "_own_pairing", "_pairing", "_task", "_tripwire", "_upstream", "_watcher", "finished",
        "gone",
    )

    def __init__(self, receive: Receive, hangups: HangupWatcher | None, task: asyncio.Task[Any]) -> None:
        self.gone = False
        self.finished = False
        self._upstream: PodResponse | None = None
        self._task = task  # the request's: cancelled when the client leaves
        self._watcher: asyncio.Future[None] | None = None
        self._pairing: Pairing | None = None
        self._own_pairing = False  # ours to unpair at the end, not the client connection's
        self._lent = -1  # the pod socket's copy the pairing holds for this request (set_upstream's)
        self._tripwire = trip_on_disconnect(receive, self._client_gone)
        if self._tripwire is None:
            self._watcher = asyncio.ensure_future(self._watch(receive))
        elif hangups is not None and not self.gone:
            client = client_transport_of(receive)
            if client is not None:
                self._pairing, kept = hangups.pair_connection(client)
                self._own_pairing = not kept

    @property
    def upstream(self) -> PodResponse | None:
        """The pod answer in progress, closed the moment the client leaves. Set it to None before
        the answer's connection goes back to the pool."""
        return self._upstream

    @upstream.setter
    def upstream(self, resp: PodResponse | None) -> None:
        previous, self._upstream = self._upstream, resp
        pairing = self._pairing
        if pairing is None:
            return
        watcher = pairing.watcher
        if previous is not None:  # its socket's copy goes back to its connection, for the next request
            previous.keep_watch_fd(watcher.take_upstream(pairing, self._lent))
            self._lent = -1
        if resp is not None:
            fd = resp.lend_watch_fd()
            self._lent = watcher.set_upstream(pairing, None if fd >= 0 else resp.socket, fd)

    def _client_gone(self) -> None:
        if not self.finished:
            self.gone = True
            if self._upstream is not None:
                self._upstream.close()
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._client_gone()
                return

    def close(self) -> None:
        if self._tripwire is not None:
            self._tripwire.disarm()
        if self._watcher is not None:
            self._watcher.cancel()
        pairing = self._pairing
        if pairing is not None:
            if self._upstream is not None:
                self.upstream = None
            self._pairing = None
            if self._own_pairing:
                pairing.release()
            elif pairing.upstream >= 0:  # the connection keeps its pairing for its next request
                pairing.watcher.set_upstream(pairing, None)

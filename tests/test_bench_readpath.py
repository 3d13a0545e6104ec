"""The read-path harness drives the real splice: every read reaches the client, framed, once."""

from __future__ import annotations

from loadtest.bench_readpath import EVENT, drive


async def test_every_read_reaches_the_client_as_one_chunk() -> None:
    chunk = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
    assert await drive(300) == 300 * len(chunk)

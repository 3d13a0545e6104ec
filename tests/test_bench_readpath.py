"""The read-path harness drives the real splice: every read reaches the client, framed, once."""

from __future__ import annotations

from loadtest.bench_readpath import CHUNK, drive


async def test_every_read_reaches_the_client_as_one_chunk() -> None:
    assert await drive(300) == 300 * len(CHUNK)

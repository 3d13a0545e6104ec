"""The bench's floor relay (``loadtest/floor.py``) relays whole streams, so its figures are of real work.

``make bench --target floor`` compares the gateway with the least a uvloop relay costs; the load
generator counts a stream as an error unless it carries every token and ``[DONE]``, and these tests
check the relay meets that on keep-alive client and pod connections, many at once.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from loadtest.floor import FloorProcess, FloorStartError
from loadtest.podsim.launch import PodsimProcess

MODEL = "floor-model"


@pytest.fixture(scope="module")
def floor() -> Iterator[FloorProcess]:
    with PodsimProcess(["--model", MODEL, "--ttft-ms", "0", "--itl-ms", "2"]) as pod, \
            FloorProcess([pod.url]) as relay:  # fmt: skip
        yield relay


@pytest.mark.parametrize("streams", [1, 20])
def test_every_stream_arrives_whole_over_kept_alive_connections(floor: FloorProcess, streams: int) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.loadgen", floor.url + "/v1/chat/completions", "--model", MODEL,
         "--streams", str(streams), "--requests", "3", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=60,
    )
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["ok"] == streams * 3 and summary["tokens"] == streams * 3 * 16
    assert summary["completed_streams"] == streams


def test_a_relay_that_cannot_listen_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        relay = FloorProcess(["http://127.0.0.1:9", "--port", str(taken.getsockname()[1])])
        with pytest.raises(FloorStartError, match="floor exited with code"):
            relay.start()

"""The limit phase's settlement: what a request is charged once it has ended, whatever ended it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.exchange import Exchange
from gateway.phases.limit import Limit


class Reservation:
    def __init__(self) -> None:
        self.settled: list[int] = []

    def settle(self, used: int) -> None:
        self.settled.append(used)


async def _exchange(**state: Any) -> tuple[Exchange, Reservation]:
    async def send(_message: dict[str, Any]) -> None:
        return None

    ex = Exchange("chat", "rid", send)
    ex.admission = reservation = Reservation()
    ex.prompt_estimate = 40
    for name, value in state.items():
        setattr(ex, name, value)
    return ex, reservation


@pytest.mark.parametrize(
    ("state", "charged"),
    [
        ({"status": 200, "tried": ["pod"], "usage": (21, 30)}, 51),  # the pod's own count
        ({"status": 499, "tried": ["pod"], "usage": (21, 30)}, 51),  # left after the usage event
        ({"status": 499, "tried": ["pod"], "tokens_relayed": 7}, 47),  # left mid-stream: prompt + sent
        ({"status": 200, "tried": ["pod"], "tokens_relayed": 3}, 43),  # a pod that sends no usage
        ({"status": 499, "tried": []}, 0),  # left before any pod took it
        ({"status": 503, "tried": []}, 0),  # shed: no pod worked on it
        ({"status": 502, "tried": ["pod"]}, 0),  # the pod failed before answering
    ],
)
def test_a_request_is_charged_what_the_pods_did_for_it(state: dict[str, Any], charged: int) -> None:
    ex, reservation = asyncio.run(_exchange(**state))
    Limit.settle(ex)
    Limit.settle(ex)  # the finish phase runs once; a second settle must change nothing
    assert reservation.settled == [charged]

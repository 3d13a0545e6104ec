"""gRPC-Web and mid-stream resume: a stream whose pod breaks continues on another pod, through the
relay's splice (``gateway.grpc_web_call.Splice`` behind the resume recorder), and the client reads
one uninterrupted answer with OK trailers, in binary and in text mode."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import counter_totals
from tests.test_grpc_web import grpc_web, sse_text
from tests.test_resume import Setup, resume_setup
from transports.proto.sluicegate.v1 import inference_pb2 as pb

ASK = {"model": "llama-8b", "messages": [{"role": "user", "content": "Tell me about sluice gates."}],
       "max_tokens": 12, "seed": 42}  # fmt: skip


@pytest.fixture
def setup() -> Iterator[Setup]:
    """A fresh gateway per case: a pod that broke in one case may be out of rotation in the next."""
    with resume_setup() as fresh:
        yield fresh


@pytest.mark.parametrize("fault", [{"drop_after": 5}, {"error_after": 5}])
@pytest.mark.parametrize("text", [False, True])
def test_a_broken_grpc_web_stream_reads_as_one_uninterrupted_answer(
    setup: Setup, fault: dict[str, int], text: bool
) -> None:
    expected = sse_text(setup.good.url, ASK)
    httpx.post(setup.bad.url + "/admin/faults", json=fault).raise_for_status()
    for _ in range(4):  # ties rotate between the pods, so some of these start on the bad one
        resp, payloads, status = grpc_web(setup.url, "StreamChatCompletion", ASK, text=text)
        assert resp.status_code == 200 and status == {"grpc-status": "0"}
        chunks = [pb.ChatCompletionChunk.FromString(p) for p in payloads]
        assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == expected
        assert len({c.id for c in chunks}) == 1
        assert sum(1 for c in chunks for choice in c.choices if choice.delta.role) == 1
    assert counter_totals(setup.admin_url, "sluicegate_stream_resumes", "outcome").get("ok", 0.0) >= 1

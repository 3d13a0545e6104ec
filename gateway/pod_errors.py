"""What the client hears when a pod answers with an error or fails: the pod's words where it has any.

An OpenAI-shaped error body from a pod passes through as is (the client's SDK reads it as it would
from the pod itself); vLLM's older flat error object is given the nested shape; anything else
becomes the gateway's own ``upstream_error``, with 5xx statuses a client cannot act on as 502.
"""

from __future__ import annotations

import json

from gateway.errors import GatewayError
from transports.pod_client import PodBrokenError, PodResponse


async def pod_error(pod_name: str, resp: PodResponse, max_body_bytes: int) -> GatewayError:
    """Turn a pod's non-200 answer into the client's: OpenAI error bodies pass through as is.

    At most ``max_body_bytes`` of the body are read: a pod's error cannot grow the gateway's memory.
    A pod's 401 or 403 refused the *gateway's* credentials (vLLM's ``--api-key``), not the
    client's: it becomes a 502 that says so, never an auth failure the client would blame itself for.
    """
    try:
        raw = await resp.read_all(max_body_bytes)
    except PodBrokenError:
        raw = b""
    if resp.status in (401, 403):
        return GatewayError(
            502,
            f"Upstream pod '{pod_name}' refused the gateway's credentials (HTTP {resp.status}); "
            "its API key is missing or wrong in the gateway's config.",
            "upstream_error",
            "upstream_auth_failed",
        )
    retry_after = resp.headers.get("retry-after")
    extra = (("retry-after", retry_after),) if retry_after else ()
    try:
        payload = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested past the decoder's depth
        payload = None
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return GatewayError(resp.status, err["message"], headers=extra, raw_body=raw)
        if payload.get("object") == "error" and isinstance(payload.get("message"), str):
            # vLLM before 0.10.1 answered with a flat error object; give clients the nested one.
            return GatewayError(
                resp.status,
                payload["message"],
                str(payload.get("type") or "upstream_error"),
                payload.get("code"),
                payload.get("param"),
                extra,
            )
    status = resp.status if resp.status < 500 or resp.status in (502, 503, 504) else 502
    return GatewayError(
        status,
        f"Upstream pod '{pod_name}' answered HTTP {resp.status} without an error body.",
        "upstream_error",
        "bad_gateway" if status == 502 else f"upstream_{resp.status}",
        None,
        extra,
    )


def reason(exc: BaseException) -> str:
    """An exception as a short phrase for an error message (at most 200 characters)."""
    text = str(exc) or type(exc).__name__
    return text if len(text) < 200 else text[:200] + "..."

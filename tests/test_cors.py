"""Browsers and the OpenAI endpoints: what a page on another origin can and cannot do.

A real gateway process (auth on, a quota so the ``x-ratelimit-*`` headers are sent) before a
simulated pod (and a second one with auth off, as for local experiments: there only the
content type stops a "simple" request), and two web pages served on other origins: ``app`` (allowed by
``server.cors.allow_origins``) and ``other`` (not). The first tests speak the CORS protocol with
httpx, header by header, as a browser does; the browser tests drive headless Chromium (Debian's
``chromium`` through Playwright) and skip, saying why, when either is missing. Whether a request
reached the pod is read from the pod itself (``GET /podsim/arrivals``), never inferred.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from loadtest.podsim.launch import PodsimProcess
from loadtest.procs import GatewayProcess
from tests.conftest import FAST, pod_arrivals, wait_for
from tests.keys import auth_on, key_store

CHAT = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
MAX_AGE_S = 321
RATELIMIT = [f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset")
             for unit in ("requests", "tokens")]


class _Page(BaseHTTPRequestHandler):
    """Any path: an empty HTML page (the origin a test's script runs on)."""

    def do_GET(self) -> None:
        body = b"<!doctype html><title>app</title>"
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@dataclass
class Site:
    gateway: GatewayProcess
    open_gateway: GatewayProcess  # auth off
    pod: PodsimProcess
    key: str
    app: str  # an allowed origin
    other: str  # an origin the policy does not name

    def arrivals(self) -> int:
        """How many generation requests the pod has received."""
        return pod_arrivals(self.pod.url)

    def logged(self, fragment: str, gateway: GatewayProcess | None = None) -> int:
        """How many access-log lines of ``gateway`` (default: the one with auth on) say ``fragment``."""
        log = (gateway or self.gateway).log().splitlines()
        return sum(fragment in line for line in log if "rid=" in line)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    app, other = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
    store = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys = key_store(store, {"id": "web-app"})
    try:
        with PodsimProcess(["--model", "llama-8b", *FAST]) as pod:
            config = {
                "server": {
                    "host": "127.0.0.1", "access_log": True, "max_tokens": 64,
                    "cors": {"allow_origins": [app], "max_age_s": MAX_AGE_S},
                },
                "auth": auth_on(store),
                "quotas": {"default": {"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000}},
                "pods": [{"name": "pod", "url": pod.url, "models": ["llama-8b"]}],
            }
            open_config = {**config, "auth": {"enabled": False}}
            with GatewayProcess(config) as gateway, GatewayProcess(open_config) as open_:
                yield Site(gateway, open_, pod, keys["web-app"], app, other)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _preflight(site: Site, origin: str) -> httpx.Response:
    return httpx.options(
        site.gateway.url + "/v1/chat/completions",
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type",
        },
    )


def _names(value: str) -> set[str]:
    return {name.strip().lower() for name in value.split(",")}


# -- the protocol, as a browser speaks it (httpx) -------------------------------------------------


def test_a_preflight_from_an_allowed_origin_is_answered_by_the_gateway_alone(site: Site) -> None:
    before = site.arrivals()
    resp = _preflight(site, site.app)
    assert resp.status_code == 204
    assert resp.headers["access-control-allow-origin"] == site.app
    assert {"authorization", "content-type"} <= _names(resp.headers["access-control-allow-headers"])
    assert "POST" in {m.strip() for m in resp.headers["access-control-allow-methods"].split(",")}
    assert resp.headers["access-control-max-age"] == str(MAX_AGE_S)
    assert "origin" in _names(resp.headers["vary"])
    assert "access-control-allow-credentials" not in resp.headers  # a page sends its key, never cookies
    assert site.arrivals() == before


def test_a_preflight_from_another_origin_gets_no_cors_headers(site: Site) -> None:
    before = site.arrivals()
    resp = _preflight(site, site.other)
    assert resp.status_code == 403
    assert not any(name.startswith("access-control-allow-") for name in resp.headers)
    assert site.arrivals() == before


def test_an_allowed_origin_s_stream_is_readable_with_its_rate_limits_and_timing(site: Site) -> None:
    headers = {"origin": site.app, "authorization": f"Bearer {site.key}"}
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", site.gateway.url + "/v1/chat/completions", json=body, headers=headers) as resp:
        text = resp.read().decode()
    assert resp.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    assert resp.headers["access-control-allow-origin"] == site.app
    assert resp.headers["timing-allow-origin"] == site.app
    exposed = _names(resp.headers["access-control-expose-headers"])
    assert set(RATELIMIT) | {"x-request-id", "retry-after"} <= exposed
    for name in RATELIMIT:
        assert name in resp.headers  # exposed, and really sent


def test_another_origin_s_answer_carries_no_cors_headers(site: Site) -> None:
    headers = {"origin": site.other, "authorization": f"Bearer {site.key}"}
    resp = httpx.post(site.gateway.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert "access-control-allow-origin" not in resp.headers
    assert "timing-allow-origin" not in resp.headers


@pytest.mark.parametrize(("auth", "status", "code"), [
    (True, 401, "invalid_api_key"),  # a simple request cannot carry a key (Authorization is not simple)
    (False, 415, "unsupported_media_type"),  # without keys, the content type is what stops it
])
def test_a_cross_origin_text_plain_post_never_reaches_a_pod(
    site: Site, auth: bool, status: int, code: str
) -> None:
    # What a page may send anywhere without asking first: a "simple" request (text/plain body).
    before = site.arrivals()
    gateway = site.gateway if auth else site.open_gateway
    resp = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=json.dumps(CHAT),
        headers={"origin": site.other, "content-type": "text/plain;charset=UTF-8"},
    )
    assert resp.status_code == status
    assert resp.json()["error"]["code"] == code
    assert site.arrivals() == before


# -- a real browser -------------------------------------------------------------------------------


@pytest.fixture
def page_on(browser: Any) -> Iterator[Any]:
    """``page_on(origin)``: a fresh page (no cached preflights) whose scripts run on ``origin``."""
    contexts: list[Any] = []

    def open_page(origin: str) -> Any:
        context = browser.new_context()
        contexts.append(context)
        page = context.new_page()
        page.goto(origin + "/")
        return page

    yield open_page
    for context in contexts:
        context.close()


STREAM = """async ({url, key, body}) => {
  const resp = await fetch(url, {method: "POST", body: JSON.stringify(body),
    headers: {"authorization": "Bearer " + key, "content-type": "application/json"}});
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let text = "", reads = 0;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    reads += 1;
    text += decoder.decode(value, {stream: true});
  }
  const headers = {};
  resp.headers.forEach((value, name) => { headers[name] = value; });
  // The timing entry is queued after the body ends, perhaps in a later task: wait for it.
  const timing = performance.getEntriesByName(url).at(-1) ?? await new Promise(resolve => {
    new PerformanceObserver((list, observer) => {
      const entry = list.getEntriesByName(url).at(-1);
      if (entry) { observer.disconnect(); resolve(entry); }
    }).observe({type: "resource"});
  });
  return {status: resp.status, text, reads, headers,
          requestStart: timing.requestStart, encodedBodySize: timing.encodedBodySize};
}"""


def test_a_page_on_an_allowed_origin_streams_with_its_api_key(site: Site, page_on: Any) -> None:
    before = site.arrivals()
    page = page_on(site.app)
    url = site.gateway.url + "/v1/chat/completions"
    got = page.evaluate(STREAM, {"url": url, "key": site.key, "body": {**CHAT, "stream": True}})
    assert got["status"] == 200
    assert got["text"].rstrip().endswith("data: [DONE]") and got["text"].count("data: ") >= 3
    for name in [*RATELIMIT, "x-request-id"]:
        assert name in got["headers"]  # readable by the page: exposed
    assert int(got["headers"]["x-ratelimit-limit-requests"]) == 10_000
    # Timing-Allow-Origin: without it a cross-origin entry's request timing and sizes read as 0
    # (measured with Chromium 156 against a page server that sends none: [0, 0]).
    assert got["requestStart"] > 0 and got["encodedBodySize"] > 0
    assert site.arrivals() == before + 1
    # Chromium asked first (Authorization is not a simple header), and the gateway answered it.
    assert wait_for(lambda: site.logged("status=204 outcome=preflight"))


def test_a_page_on_another_origin_is_refused_by_the_browser(site: Site, page_on: Any) -> None:
    before = site.arrivals()
    page = page_on(site.other)
    script = """async ({url, key}) => {
      try {
        await fetch(url, {method: "POST", body: "{}",
          headers: {"authorization": "Bearer " + key, "content-type": "application/json"}});
        return "fetched";
      } catch (err) { return err.name; }
    }"""
    outcome = page.evaluate(script, {"url": site.gateway.url + "/v1/chat/completions", "key": site.key})
    assert outcome == "TypeError"  # the preflight carried no Access-Control-Allow-Origin
    assert wait_for(lambda: site.logged("status=403 outcome=preflight"))
    assert site.arrivals() == before


def test_a_simple_text_plain_post_from_a_page_starts_no_generation(site: Site, page_on: Any) -> None:
    # Auth off (auth on refuses it for want of a key: see the httpx test above).
    before = site.arrivals()
    url = site.open_gateway.url + "/v1/chat/completions"
    # From an allowed origin the page may read the refusal: the OpenAI error, in JSON.
    script = """async ({url, body}) => {
      const resp = await fetch(url, {method: "POST", body: JSON.stringify(body),
        headers: {"content-type": "text/plain"}});
      return {status: resp.status, error: (await resp.json()).error};
    }"""
    got = page_on(site.app).evaluate(script, {"url": url, "body": CHAT})
    assert got["status"] == 415 and got["error"]["code"] == "unsupported_media_type"
    # From anywhere else, no-cors: the page learns nothing, and the pod sees nothing.
    script = """async ({url, body}) => {
      const resp = await fetch(url, {method: "POST", mode: "no-cors", body: JSON.stringify(body)});
      return resp.type;
    }"""
    assert page_on(site.other).evaluate(script, {"url": url, "body": CHAT}) == "opaque"
    assert wait_for(lambda: site.logged("status=415", site.open_gateway) >= 2)
    assert site.arrivals() == before


@pytest.mark.parametrize(("auth", "code"), [(True, "invalid_api_key"), (False, "unsupported_media_type")])
def test_a_cross_site_form_post_starts_no_generation(site: Site, page_on: Any, auth: bool, code: str) -> None:
    # The classic CSRF: a text/plain form whose one field spells a JSON body.
    before = site.arrivals()
    gateway = site.gateway if auth else site.open_gateway
    page = page_on(site.other)
    name = json.dumps(CHAT)[:-1] + ', "pad": "'
    page.set_content(
        f"""<form method="post" enctype="text/plain" action="{gateway.url}/v1/chat/completions">
        <input name='{name}' value='"}}'></form>"""
    )
    with page.expect_navigation():
        page.evaluate("document.forms[0].submit()")
    assert f'"code":"{code}"' in page.content()
    assert site.arrivals() == before


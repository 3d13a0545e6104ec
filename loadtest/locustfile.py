"""Locust scenario: streaming chat completions against Sluicegate or any OpenAI-compatible server.

    locust -f loadtest/locustfile.py --headless -u 50 -r 10 -t 2m --host http://127.0.0.1:8080 \\
        --api-key "$KEY" --model llama-8b --csv out/locust --html out/locust.html --metrics-json out/us.json

Why ``HttpUser`` with ``stream=True`` and not ``FastHttpUser``: the fast client's body read blocks
until the byte count it asked for (1 KiB) has arrived, so the first token of a stream is seen only
once a kilobyte has piled up behind it. ``requests`` with ``iter_lines(chunk_size=None)`` hands over
each HTTP chunk as it arrives, so every SSE event is timed when it lands.

Besides the HTTP request itself (its row, ``POST <path> (headers)``, is the time to the response
headers and carries the failures), each request fires its own Locust events, named by model:
``TTFT`` (first non-empty content or reasoning delta), ``ITL`` (one per gap between content
events), ``TPOT`` ((e2e - TTFT) / (tokens - 1)), ``E2E`` (to ``data: [DONE]``) and ``TOKENS``
(whose "response time" is the output token count from the server's ``usage``). Locust rounds
those to milliseconds in its stats, so the same samples also go to microsecond histograms
(loadtest/locust_metrics.py), merged from workers on the master and written as JSON at the end.

Locust's users are a closed loop: a user sends its next request only after the last one ended
(plus ``wait_time``). With ``--rate-per-user`` each user follows its own schedule of intended
send times and the lateness of every send is recorded as ``DISPATCH`` (dispatch delay): when the
server is slower than the schedule, requests go out late and the latencies above, timed from the
real send, hide that wait (coordinated omission). Read them together.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from locust import HttpUser, events, task
from locust.env import Environment
from locust.runners import MasterRunner, WorkerRunner
from requests.exceptions import RequestException

try:
    from loadtest.locust_metrics import Recorder, StreamTiming, Targets
except ImportError:  # the two files copied next to each other, without the sluicegate package
    from locust_metrics import Recorder, StreamTiming, Targets  # type: ignore[no-redef]

PROMPTS_DIR = Path(__file__).parent / "prompts"
DEFAULT_MAX_TOKENS = 64
EMBEDDED_PROMPTS = [
    "Explain how a sluice gate controls the flow of water in a canal.",
    "Summarise the history of tide mills in three sentences.",
    "List five things that can go wrong with a spillway and how engineers prevent them.",
    "Why do reservoirs silt up, and what can be done about it?",
    "Describe a lock on a river to someone who has never seen one.",
    "Compare a weir with a dam.",
]


class Prompt:
    """A prompt and the output length it asks for (None: use --max-tokens or the default)."""

    __slots__ = ("max_tokens", "text")

    def __init__(self, text: str, max_tokens: int | None) -> None:
        self.text = text
        self.max_tokens = max_tokens


class ScenarioError(Exception):
    """A bad option or prompt file, worded for the operator."""


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    parser.add_argument("--model", default="llama-8b", env_var="LOCUST_MODEL", help="model to ask for")
    parser.add_argument(
        "--api-key", default="", env_var="LOCUST_API_KEY", is_secret=True,
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=0, env_var="LOCUST_MAX_TOKENS",
        help=f"max_tokens of every request (default 0: each prompt's own, else {DEFAULT_MAX_TOKENS})",
    )  # fmt: skip
    parser.add_argument("--ignore-eos", action="store_true", default=False,
                        help="send vLLM's ignore_eos so every answer is max_tokens long")  # fmt: skip
    parser.add_argument(
        "--prompts", default="", env_var="LOCUST_PROMPTS",
        help="JSONL of {prompt, max_tokens?} (default: loadtest/prompts/*.jsonl, else a built-in few)",
    )  # fmt: skip
    parser.add_argument("--chat-path", default="/v1/chat/completions", help="path of the chat endpoint")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="read timeout of a stream, s")
    parser.add_argument(
        "--rate-per-user", type=float, default=0.0, env_var="LOCUST_RATE_PER_USER",
        help="requests per second per user on a fixed schedule, recording dispatch delay (0: back to back)",
    )  # fmt: skip
    for name in ("ttft", "tpot", "e2e"):
        parser.add_argument(f"--goodput-{name}-ms", type=float, default=0.0,
                            help=f"goodput target for {name.upper()} in ms (0: not judged)")  # fmt: skip
    parser.add_argument("--strict-tokens", action="store_true", default=False,
                        help="count usage.completion_tokens != content events as a failure")  # fmt: skip
    parser.add_argument(
        "--metrics-json", default="", env_var="LOCUST_METRICS_JSON",
        help="write the microsecond summary here at the end (it is printed either way)",
    )  # fmt: skip


def load_prompts(path: str) -> list[Prompt]:
    """The prompt set: the file named, else the repo's loadtest/prompts/*.jsonl, else built-in ones."""
    files = [Path(path)] if path else sorted(PROMPTS_DIR.glob("*.jsonl"))
    if not files:
        return [Prompt(text, None) for text in EMBEDDED_PROMPTS]
    prompts = []
    for file in files:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ScenarioError(f"cannot read the prompts file {file}: {exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ScenarioError(f"{file}:{number}: not a JSON line") from None
            text = record.get("prompt") if isinstance(record, dict) else None
            limit = record.get("max_tokens") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text:
                raise ScenarioError(f"{file}:{number}: needs a non-empty string 'prompt'")
            if limit is not None and (not isinstance(limit, int) or limit < 1):
                raise ScenarioError(f"{file}:{number}: 'max_tokens' must be a positive integer")
            prompts.append(Prompt(text, limit))
    if not prompts:
        raise ScenarioError(f"no prompts in {', '.join(map(str, files))}")
    return prompts


def check_options(opts: Any) -> None:
    for name in ("max_tokens", "request_timeout", "rate_per_user", "goodput_ttft_ms", "goodput_tpot_ms",
                 "goodput_e2e_ms"):  # fmt: skip
        if getattr(opts, name) < 0:
            raise ScenarioError(f"--{name.replace('_', '-')} must not be negative")
    if not opts.chat_path.startswith("/"):
        raise ScenarioError("--chat-path must start with /")
    load_prompts(opts.prompts)


def targets_of(opts: Any) -> Targets:
    return Targets(opts.goodput_ttft_ms or None, opts.goodput_tpot_ms or None, opts.goodput_e2e_ms or None)


class Run:
    """This process's measurements; on a master, its workers' merged in."""

    recorder = Recorder()
    started: float | None = None
    stopped: float | None = None
    environment: Environment | None = None
    prompts: dict[str, list[Prompt]] = {}

    @classmethod
    def prompts_for(cls, path: str) -> list[Prompt]:
        if path not in cls.prompts:
            cls.prompts[path] = load_prompts(path)
        return cls.prompts[path]


@events.init.add_listener
def on_init(environment: Environment, **_kw: Any) -> None:
    Run.environment = environment
    opts = environment.parsed_options
    if opts is None or isinstance(environment.runner, WorkerRunner):
        return  # a worker runs with the master's options, checked there
    try:
        check_options(opts)
    except ScenarioError as exc:
        print(f"locustfile: {exc}", file=sys.stderr)
        sys.exit(2)


@events.test_start.add_listener
def on_test_start(environment: Environment, **_kw: Any) -> None:
    Run.recorder = Recorder()
    Run.started, Run.stopped = time.perf_counter(), None


@events.test_stop.add_listener
def on_test_stop(environment: Environment, **_kw: Any) -> None:
    Run.stopped = time.perf_counter()


@events.report_to_master.add_listener
def on_report_to_master(client_id: str, data: dict[str, Any], **_kw: Any) -> None:
    data["sluicegate_us"] = Run.recorder.to_wire()
    Run.recorder = Recorder()  # each report carries only what is new since the last


@events.worker_report.add_listener
def on_worker_report(client_id: str, data: dict[str, Any], **_kw: Any) -> None:
    if "sluicegate_us" in data:
        Run.recorder.merge(Recorder.from_wire(data["sluicegate_us"]))


@events.quit.add_listener
def on_quit(exit_code: int, **_kw: Any) -> None:
    """Fired after the master has had its workers' last reports: write and print the summary."""
    env = Run.environment
    if env is None or env.parsed_options is None or Run.started is None:
        return
    if isinstance(env.runner, WorkerRunner):
        return
    opts = env.parsed_options
    duration = (Run.stopped or time.perf_counter()) - Run.started
    report = {
        "tool": "locust",
        "host": env.host,
        "model": opts.model,
        "users": opts.num_users,
        "distributed": isinstance(env.runner, MasterRunner),
        **Run.recorder.report(duration, targets_of(opts)),
    }
    if opts.metrics_json:
        path = Path(opts.metrics_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)


def print_summary(report: dict[str, Any]) -> None:
    print("\nSluicegate streaming metrics (microseconds)")
    print(f"{'metric':<16}{'count':>9}{'p50':>12}{'p90':>12}{'p99':>12}{'max':>12}")
    for name, row in report["latency_us"].items():
        if row["count"]:
            cells = "".join(f"{row[k]:>12}" for k in ("p50", "p90", "p99", "max"))
            print(f"{name:<16}{row['count']:>9}{cells}")
    tokens, goodput = report["output_tokens"], report["goodput"]
    print(f"requests ok {report['requests']['ok']}, failed {report['requests']['failed']}, "
          f"{report['requests']['per_s']}/s; output tokens {tokens['total']} ({tokens['per_s']}/s), "
          f"usage mismatches {tokens['usage_mismatches']}; goodput {goodput['per_s']}/s")  # fmt: skip


class StreamError(Exception):
    """A stream that did not end as a complete answer (for Locust's failure table)."""


class ChatStreamUser(HttpUser):
    """One conversation slot: streaming chat completions, one after another (see the module doc)."""

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.prompts = Run.prompts_for(opts.prompts)
        self.targets = targets_of(opts)
        key = opts.api_key or os.environ.get("OPENAI_API_KEY", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.intended: float | None = None  # the scheduled send time under --rate-per-user

    def wait_time(self) -> float:
        if self.opts.rate_per_user <= 0 or self.intended is None:
            return 0.0
        self.intended += 1.0 / self.opts.rate_per_user
        return max(0.0, self.intended - time.perf_counter())

    @task
    def chat(self) -> None:
        opts = self.opts
        prompt = random.choice(self.prompts)
        body: dict[str, Any] = {
            "model": opts.model,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": opts.max_tokens or prompt.max_tokens or DEFAULT_MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if opts.ignore_eos:
            body["ignore_eos"] = True
        sent = time.perf_counter()
        dispatch_delay = None
        if opts.rate_per_user > 0:
            self.intended = sent if self.intended is None else self.intended
            dispatch_delay = max(0.0, sent - self.intended)
        stream = StreamTiming(sent)
        with self.client.post(
            opts.chat_path, json=body, headers=self.headers, stream=True, catch_response=True,
            name=f"{opts.chat_path} (headers)", timeout=(30.0, opts.request_timeout or None),
        ) as response:  # fmt: skip
            if response.status_code != 200:
                stream.error = refusal(response)
            else:
                try:
                    for line in response.iter_lines(chunk_size=None):
                        stream.feed(line, time.perf_counter())
                        if stream.error:
                            break
                except (RequestException, OSError) as exc:
                    stream.error = f"the stream broke: {type(exc).__name__}: {exc}"[:300]
            problem = stream.failure()
            if problem:
                response.failure(problem)
            else:
                response.success()
        self.fire_events(stream, problem, dispatch_delay)
        Run.recorder.record(stream, self.targets, dispatch_delay)

    def fire_events(self, stream: StreamTiming, problem: str | None, dispatch_delay: float | None) -> None:
        fire, name = self.environment.events.request.fire, self.opts.model
        if dispatch_delay is not None:
            fire(request_type="DISPATCH", name=name, response_time=dispatch_delay * 1000, response_length=0)
        if stream.ttft_s is not None:
            fire(request_type="TTFT", name=name, response_time=stream.ttft_s * 1000, response_length=0)
        for gap in stream.gaps_s():
            fire(request_type="ITL", name=name, response_time=gap * 1000, response_length=0)
        if problem:
            fire(request_type="E2E", name=name, response_time=(stream.e2e_s or 0.0) * 1000, response_length=0,
                 exception=StreamError(problem))  # fmt: skip
            return
        fire(request_type="E2E", name=name, response_time=(stream.e2e_s or 0.0) * 1000, response_length=0)
        if stream.tpot_s is not None:
            fire(request_type="TPOT", name=name, response_time=stream.tpot_s * 1000, response_length=0)
        mismatch = None
        if stream.mismatch and self.opts.strict_tokens:
            mismatch = StreamError(f"usage says {stream.usage_tokens} tokens, the stream carried "
                                   f"{len(stream.token_times)} content events")  # fmt: skip
        fire(request_type="TOKENS", name=name, response_time=stream.tokens, response_length=stream.tokens,
             exception=mismatch)  # fmt: skip


def refusal(response: Any) -> str:
    """A non-200 answer (status 0: no answer at all) worded for the failure table."""
    if response.status_code == 0:
        return f"no response: {type(response.error).__name__}: {response.error}"[:300]
    try:
        detail = response.text[:200]
    except (RequestException, OSError) as exc:
        detail = f"(body unreadable: {exc})"
    return f"HTTP {response.status_code}: {detail}"

"""Gateway configuration's schema: immutable validated models.

Config is data: every setting is checked once at start-up and then shared read-only, so the request
path never re-validates anything. Reading a file and wording its problems for the operator
(``ConfigError``, one readable paragraph, never a traceback) is ``gateway/config_load.py``.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from gateway.config_base import Frozen
from gateway.config_routes import RouteConfig


class MigIdentity(Frozen):
    """Which GPU and MIG slice a pod runs on (as NVML and the device plugin name them)."""

    gpu_uuid: str | None = Field(default=None, pattern=r"^GPU-", description="the parent GPU")
    mig_uuid: str | None = Field(default=None, pattern=r"^MIG-")
    profile: str | None = Field(default=None, pattern=r"^\d+g\.\d+gb(\+\w+)?$")
    gpu_instance_id: int | None = Field(default=None, ge=0, description="DCGM's GPU_I_ID (NVML's GI id)")

    @model_validator(mode="after")
    def _names_a_device(self) -> MigIdentity:
        if self.gpu_uuid is None and self.mig_uuid is None:
            raise ValueError("a MIG identity needs gpu_uuid (the parent GPU) or mig_uuid")
        return self


class PodCredentials(Frozen):
    """The gateway's own API key for pods started with vLLM's ``--api-key``: read from an environment
    variable or a file (a mounted Kubernetes Secret), never written in the config itself."""

    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    api_key_file: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> PodCredentials:
        if (self.api_key_env is None) == (self.api_key_file is None):
            raise ValueError("set exactly one of api_key_env or api_key_file")
        return self


class PodConfig(Frozen):
    """One inference pod (an OpenAI-compatible server such as vLLM)."""

    name: str = Field(min_length=1)
    url: str
    models: tuple[str, ...] = ()
    mig: MigIdentity | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    credentials: PodCredentials | None = Field(
        default=None, description="the API key this pod wants (vLLM --api-key); default: upstream.credentials"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host, e.g. http://10.0.0.5:8000")
        try:
            _ = parts.port  # urlsplit checks the port only when asked; the pod registry asks at start-up
        except ValueError as exc:
            raise ValueError(f"has a bad port: {exc}") from None
        if parts.path not in ("", "/") or parts.query:
            raise ValueError("must be the pod's base URL without a path (the gateway adds /v1/...)")
        return value.rstrip("/")


class TlsConfig(Frozen):
    """A TLS listener (HTTP/1.1 and HTTP/2, chosen by ALPN) and, unless disabled, HTTP/3 over QUIC."""

    cert: str = Field(min_length=1, description="PEM certificate (chain) file")
    key: str = Field(min_length=1, description="PEM private key file")
    port: int = Field(default=8443, ge=0, le=65535)
    h3: bool = True
    h3_port: int | None = Field(
        default=None, ge=0, le=65535, description="UDP port for HTTP/3; default: the TLS port's number"
    )
    alt_svc_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="the UDP port clients reach HTTP/3 on, when a load balancer maps it; default: h3_port",
    )
    alt_svc_max_age_s: int = Field(default=86400, ge=1, description="how long clients may remember it")


class ClientLimitsConfig(Frozen):
    """What one client connection may make the gateway wait for or hold (docs/hardening.md)."""

    head_timeout_s: float = Field(default=10.0, gt=0, description="h1 head, h2 first HEADERS: slowloris")
    body_idle_timeout_s: float = Field(default=10.0, gt=0, description="HTTP/1.1 body silence: slow POST")
    body_timeout_s: float = Field(default=30.0, gt=0, description="whole HTTP/1.1 body after its head")
    keep_alive_timeout_s: float = Field(default=30.0, gt=0, description="idle connection between requests")
    max_request_line_bytes: int = Field(default=8192, ge=256, description="longer: 414")
    max_headers: int = Field(default=100, ge=8, description="more request headers: 431")
    max_header_bytes: int = Field(default=65536, ge=1024, description="names + values (h2: HPACK size): 431")
    h2_premature_reset_s: float = Field(default=1.0, ge=0, description="a stream reset younger is premature")
    h2_max_premature_resets: int = Field(default=100, ge=1, description="Rapid Reset: then GOAWAY")
    h2_control_frames_per_s: float = Field(default=100.0, gt=0, description="PING/SETTINGS/PRIORITY rate")
    h2_control_frame_burst: int = Field(default=1000, ge=1, description="... and burst")
    h2_max_outbound_control_frames: int = Field(default=1000, ge=1, description="queued for a non-reader")
    h2_max_empty_frames: int = Field(default=10, ge=0, description="empty DATA frames in a row")
    h2_max_window_updates_per_data_frame: int = Field(
        default=10, ge=1, description="WINDOW_UPDATE frames per DATA frame sent (Envoy's figure)"
    )
    h2_send_stall_s: float = Field(default=30.0, gt=0, description="a chunk waiting for the window/reads")


class H3LimitsConfig(Frozen):
    """What HTTP/3 clients may make the gateway hold (docs/configuration.md, docs/transports.md)."""

    max_connections: int = Field(default=2048, ge=1, description="QUIC connections; more: dropped")
    max_concurrent_streams: int = Field(default=128, ge=1, description="request streams per connection")
    handshake_timeout_s: float = Field(default=10.0, gt=0, description="unfinished by then: closed")
    idle_timeout_s: float = Field(default=30.0, gt=0, description="QUIC idle timeout (no packet received)")
    retry: Literal["auto", "always", "never"] = Field(
        default="auto", description="QUIC Retry (address validation); auto: while handshakes pile up"
    )
    retry_above_handshakes: int = Field(default=64, ge=0, description="auto: Retry from this many")
    max_crypto_buffer_bytes: int = Field(default=16 * 1024, ge=4096, description="CRYPTO data per epoch")
    drain_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=0, description="after an early answer, upload still accepted and dropped"
    )
    drain_body_s: float = Field(default=10.0, ge=0, description="... and for how long, before STOP_SENDING")
    send_stall_s: float = Field(default=30.0, gt=0, description="no room to send: reset")


class CorsConfig(Frozen):
    """Which web origins may call the OpenAI endpoints from a browser (preflights are answered by the
    gateway itself). Empty: none (same-origin pages and non-browser clients are unaffected)."""

    allow_origins: tuple[str, ...] = Field(
        default=(), description='origins such as https://app.example.com, or "*" for any'
    )
    max_age_s: int = Field(default=600, ge=0, description="how long a browser may cache a preflight")

    @field_validator("allow_origins")
    @classmethod
    def _origins(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            parts = urlsplit(value)
            if value != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
                raise ValueError(f"{value!r} is not an origin such as https://app.example.com (or \"*\")")
        return values


class ServerConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    max_messages: int = Field(default=2048, ge=1, description="chat messages in one request")
    max_choices: int = Field(default=16, ge=1, description="n (and best_of): generations per request")
    max_tokens: int | None = Field(
        default=None, ge=1, description="completion tokens a request may ask for; None: the pod decides"
    )
    access_log: bool = True
    access_log_format: Literal["text", "json"] = Field(
        default="text", description="text: key=value pairs; json: one JSON object per request"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, description="SIGTERM: how long streams may finish")
    workers: int = Field(
        default=1, ge=0, description="worker processes, one per core (docs/operations.md); 0: one per core"
    )
    h2c: bool = Field(default=True, description="HTTP/2 with prior knowledge on the cleartext port")
    max_concurrent_streams: int = Field(default=128, ge=1, description="per HTTP/2 connection")
    limits: ClientLimitsConfig = ClientLimitsConfig()
    h3_limits: H3LimitsConfig = H3LimitsConfig()
    tls: TlsConfig | None = None
    trusted_proxies: tuple[str, ...] = Field(
        default=(),
        description="addresses or CIDRs (e.g. 10.0.0.0/8) whose X-Forwarded-For is believed; default: none",
    )
    cors: CorsConfig = CorsConfig()

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            try:
                ipaddress.ip_network(value, strict=False)
            except ValueError:
                raise ValueError(f"{value!r} is not an IP address or CIDR such as 10.0.0.0/8") from None
        return values


class UpstreamTlsConfig(Frozen):
    """TLS to pods with https:// URLs: whom to trust, and the gateway's client certificate (mTLS)."""

    ca_bundle: str | None = Field(default=None, description="PEM CA file; default: the system's trust store")
    client_cert: str | None = Field(default=None, description="PEM certificate for mTLS")
    client_key: str | None = Field(default=None, description="its PEM private key")
    server_name: str | None = Field(default=None, description="the name to verify; default: the pod's host")

    @model_validator(mode="after")
    def _cert_with_key(self) -> UpstreamTlsConfig:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together (mTLS needs both)")
        return self


class UpstreamConfig(Frozen):
    """The one pooled HTTP client the gateway uses to reach pods."""

    max_idle_per_pod: int = Field(default=512, ge=0, description="idle keep-alive connections kept per pod")
    keepalive_timeout_s: float = Field(default=30.0, gt=0)
    max_error_body_bytes: int = Field(default=64 * 1024, gt=0)
    max_event_bytes: int = Field(
        default=1024 * 1024,
        ge=4096,
        description="an SSE line longer than this (or more bytes before the first token) is a broken stream",
    )
    credentials: PodCredentials | None = Field(
        default=None, description="the API key sent to every pod that sets none of its own"
    )
    tls: UpstreamTlsConfig = UpstreamTlsConfig()


class StageOverrides(Frozen):
    """Per-model or per-tier changes to the timeout stages; unset stages keep the level below."""

    connect_s: float | None = Field(default=None, gt=0)
    first_token_s: float | None = Field(default=None, gt=0)
    stall_s: float | None = Field(default=None, gt=0)
    total_s: float | None = Field(default=None, gt=0)


_STAGES = ("connect_s", "first_token_s", "stall_s")


def _stages_over_total(
    timeouts: TimeoutsConfig,
    model: str | None,
    model_overrides: StageOverrides | None,
    tier: str | None = None,
    tier_overrides: StageOverrides | None = None,
) -> list[tuple[str, str]]:
    """Each stage that outlasts the whole request once the overrides are merged (the model's, then
    the tier's, as ``gateway.deadlines`` does): (stage key and value, total key and value). Only
    problems the last layer takes part in are reported, so one bad key is named once."""
    layers: list[tuple[str, TimeoutsConfig | StageOverrides]] = [("timeouts", timeouts)]
    if model is not None and model_overrides is not None:
        layers.append((f"timeouts.models.{model}", model_overrides))
    if tier is not None and tier_overrides is not None:
        layers.append((f"tiers.{tier}.timeouts", tier_overrides))

    def effective(stage: str) -> tuple[float, str]:
        for prefix, layer in reversed(layers):
            value = getattr(layer, stage)
            if value is not None:
                return value, f"{prefix}.{stage}"
        raise AssertionError("the base timeouts set every stage")

    top = layers[-1][0] + "."
    total, total_key = effective("total_s")
    over = []
    for stage in _STAGES:
        value, key = effective(stage)
        if value > total and top in (key[: len(top)], total_key[: len(top)]):
            over.append((f"{key} ({value:g} s)", f"{total_key} ({total:g} s)"))
    return over


def _over_total(problems: list[tuple[str, str]]) -> str:
    """One sentence per total that some stages outlast, each stage named once."""
    by_total: dict[str, dict[str, None]] = {}
    for stage, total in problems:
        by_total.setdefault(total, {})[stage] = None
    return "; ".join(
        f"{', '.join(stages)} {'is' if len(stages) == 1 else 'are'} longer than {total}"
        for total, stages in by_total.items()
    ) + ": no stage may outlast the whole request"


class TimeoutsConfig(Frozen):
    """The four stages of a request's life, each with its own budget (seconds).

    connect: TCP to the pod. first_token: request sent to the first content token (queueing and
    prefill). stall: the longest silence between two chunks once streaming. total: the whole request.
    """

    connect_s: float = Field(default=2.0, gt=0)
    first_token_s: float = Field(default=60.0, gt=0)
    stall_s: float = Field(default=30.0, gt=0)
    total_s: float = Field(default=600.0, gt=0)
    models: dict[str, StageOverrides] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _stages_within_total(self) -> TimeoutsConfig:
        # A stage longer than the whole request never fires: the operator meant something else.
        problems = [
            problem
            for model, overrides in [(None, None), *self.models.items()]
            for problem in _stages_over_total(self, model, overrides)
        ]
        if problems:
            raise ValueError(_over_total(problems))
        return self


Criticality = Literal["critical", "standard", "sheddable"]


class DegradeConfig(Frozen):
    """Serve a tier's streaming requests without streaming while the chosen pod streams slowly.

    The client still gets an SSE stream (the whole answer in one content event) and a header saying
    so; the pod is spared the per-token work of streaming. Off unless a tier sets it.
    """

    inter_token_p95_ms: float = Field(gt=0, description="degrade when the pod's recent p95 gap is over this")


class QuotaConfig(Frozen):
    """How much one API key may take (a tier's quota applies to each of its keys on its own).

    Per clock minute (fixed windows, as Envoy's rate limit service counts): requests, and tokens
    (prompt + completion, reserved at admission and settled at the end); and streams at once.
    Unset: unlimited."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1, description="streams in flight at once")
    on_store_down: Literal["fail_open", "fail_closed"] = Field(
        default="fail_open",
        description="Redis unreachable: fail_open counts locally at limit / quotas.replicas; "
        "fail_closed answers 503",
    )


class TierConfig(Frozen):
    """A class of callers (chosen by their API key, or a trusted header when auth is off)."""

    api_keys: tuple[str, ...] = Field(default=(), description="removed: keys live in the key store")
    quota: QuotaConfig | None = None
    timeouts: StageOverrides = StageOverrides()
    criticality: Criticality = "standard"
    degrade: DegradeConfig | None = None
    max_tokens: int | None = Field(default=None, ge=1, description="default: server.max_tokens")
    max_messages: int | None = Field(default=None, ge=1, description="default: server.max_messages")
    max_choices: int | None = Field(default=None, ge=1, description="default: server.max_choices")


class AuthConfig(Frozen):
    """Who may call: API keys from a key store file (``sluicegate keys``), reloaded when it changes."""

    enabled: bool = True
    keys_file: str = Field(default="keys.yaml", min_length=1, description="the key store (hashes only)")
    reload_interval_s: float = Field(default=1.0, gt=0, description="how often the file is checked")


class QuotasConfig(Frozen):
    """Where quota counters live: in this process, or in Redis shared by every replica."""

    redis_url: str | None = Field(
        default=None, description="redis://HOST:PORT/DB; default: in-process counters"
    )
    timeout_ms: float = Field(
        default=20.0, gt=0, description="one admission round trip; slower: Redis counts as down"
    )
    replicas: int = Field(
        default=1, ge=1, description="gateway replicas sharing Redis (fail_open divides limits by it)"
    )
    lease_ttl_s: float = Field(
        default=30.0, gt=0, description="a concurrency lease not renewed in time expires"
    )
    breaker_open_s: float = Field(default=2.0, gt=0, description="after a Redis failure, skip it this long")
    key_prefix: str = Field(default="sluicegate:quota:", min_length=1)
    chars_per_token: float = Field(default=4.0, gt=0, description="prompt estimate at admission")
    default: QuotaConfig | None = Field(default=None, description="for keys whose tier sets no quota")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL, e.g. redis://127.0.0.1:6379/0")
        return value


class AdminConfig(Frozen):
    """The admin plane (``/admin/*``, ``/metrics``): its own listener, never the public port."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=9090, ge=0, le=65535)


class TracingConfig(Frozen):
    """OpenTelemetry tracing (``gateway.tracing``): off by default, and then nothing of it is imported."""

    enabled: bool = False
    endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces URL; None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces, else http://127.0.0.1:4318/v1/traces",
    )
    service_name: str = Field(default="sluicegate", min_length=1)
    sample_ratio: float = Field(default=1.0, ge=0, le=1, description="of traces the gateway starts")
    headers: dict[str, str] = Field(default_factory=dict, description="sent with every export (auth)")
    export_timeout_s: float = Field(default=10.0, gt=0, le=60)

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL, e.g. http://otel-collector:4318/v1/traces")
        return value


class AffinityConfig(Frozen):
    """Send requests that share a key to the same pod (its prefix cache stays warm), while it is fit.

    ``key``: ``user`` (the request's ``user`` field), ``header:NAME`` (a request header), or
    ``prefix`` (the start of the prompt). The pod for a key is chosen by rendezvous hashing among
    the pods that may take the request, so every gateway replica agrees and a pod's loss moves only
    its own keys; health, breakers and shedding decide first, and a pod far busier than its peers
    (in-flight over ``max_load_factor`` times the mean, plus one) gives the key up to load balancing.
    """

    key: str = Field(pattern=r"^(user|prefix|header:[a-z0-9-]+)$")
    prefix_chars: int = Field(default=1024, gt=0, description="key: prefix - how much of the prompt")
    models: tuple[str, ...] = Field(default=(), description="default: every model")
    max_load_factor: float = Field(default=1.5, ge=1.0)


class ProbeConfig(Frozen):
    """Active ``GET /health`` probes, with hysteresis."""

    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    unhealthy_after: int = Field(default=3, ge=1, description="consecutive failures")
    healthy_after: int = Field(default=2, ge=1, description="consecutive successes to come back")
    passive_window_s: float = Field(
        default=10.0, ge=0,
        description="a probe that times out is not held against a pod that returned a first token or a "
        "2xx answer to live traffic this recently (an overloaded pod is slow, not broken); 0: never excused",
    )


class ScrapeConfig(Frozen):
    """Scrapes of each pod's own ``/metrics`` (vLLM names: KV-cache usage, running, waiting)."""

    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=5.0, gt=0, description="older data counts as saturated")


class PressureConfig(Frozen):
    """The GPU-pressure breaker: open at the high marks, closed again under the low ones."""

    kv_high: float = Field(default=0.92, gt=0, le=1)
    kv_low: float = Field(default=0.85, gt=0, le=1)
    waiting_high: float = Field(default=32, gt=0)
    waiting_low: float = Field(default=16, ge=0)
    sheddable_kv: float = Field(default=0.80, gt=0, le=1, description="sheddable traffic stops here")
    sheddable_waiting: float = Field(default=8, gt=0)

    @model_validator(mode="after")
    def _low_under_high(self) -> PressureConfig:
        if self.kv_low > self.kv_high or self.waiting_low > self.waiting_high:
            raise ValueError("the low marks (kv_low, waiting_low) must not be above the high ones")
        return self


class OutlierConfig(Frozen):
    """Envoy-style outlier ejection on consecutive gateway-visible failures."""

    consecutive_failures: int = Field(default=5, ge=1)
    base_ejection_s: float = Field(default=30.0, gt=0)
    max_ejection_s: float = Field(default=300.0, gt=0)
    max_ejection_percent: float = Field(default=50.0, ge=0, le=100)


class DeviceHealthConfig(Frozen):
    """GPU and MIG-slice health sources besides the pods themselves."""

    dcgm_urls: tuple[str, ...] = Field(default=(), description="dcgm-exporter /metrics URLs")
    agent_urls: tuple[str, ...] = Field(default=(), description="sluicegate mig-agent base URLs")
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    max_temp_c: float = Field(default=90.0, gt=0)
    quarantine_s: float | None = Field(
        default=None, gt=0, description="after this, clean probes may clear a device fault; None: never"
    )


class HealthConfig(Frozen):
    panic_threshold_percent: float = Field(
        default=50.0, ge=0, le=100,
        description="Envoy's healthy panic threshold: when probes alone would leave fewer than this share "
        "of a model's live pods routable, route across all of them (device faults still exclude); 0: off",
    )
    probe: ProbeConfig = ProbeConfig()
    scrape: ScrapeConfig = ScrapeConfig()
    pressure: PressureConfig = PressureConfig()
    outlier: OutlierConfig = OutlierConfig()
    devices: DeviceHealthConfig = DeviceHealthConfig()


class SheddingConfig(Frozen):
    """Who is turned away first when pods are saturated."""

    criticality_header: str = Field(default="x-sluicegate-criticality", pattern=r"^[a-z0-9-]+$")
    default_criticality: Criticality = "standard"
    retry_after_max_s: int = Field(default=30, ge=1)


class RetryConfig(Frozen):
    """Retries on another pod, only before the first byte reached the client."""

    max_attempts: int = Field(default=3, ge=1, description="attempts per request, the first included")
    budget_ratio: float = Field(default=0.2, ge=0, le=1, description="retries / requests, over 10 s")
    min_retries_per_s: float = Field(default=3.0, ge=0, description="the budget's floor")
    backoff_base_s: float = Field(default=0.025, ge=0)
    backoff_max_s: float = Field(default=0.25, ge=0)


class ResumeConfig(Frozen):
    """Mid-stream resume on another pod (opt-in per model; "*" for every model)."""

    models: tuple[str, ...] = ()
    max_per_request: int = Field(default=2, ge=0)

    def enabled_for(self, model: str) -> bool:
        return self.max_per_request > 0 and ("*" in self.models or model in self.models)


class KubernetesDiscoveryConfig(Frozen):
    """Pods behind a Service, from its EndpointSlices and the Pods they point at (list+watch)."""

    namespace: str = Field(min_length=1)
    service: str = Field(min_length=1)
    port_name: str | None = Field(default=None, description="the EndpointSlice port; default: the first")
    model_label: str = "model"
    api_url: str | None = Field(default=None, description="default: in-cluster, else kubeconfig")
    kubeconfig: str | None = None
    credentials: PodCredentials | None = Field(default=None, description="for the pods it finds")


class DnsDiscoveryConfig(Frozen):
    """Pods behind a headless Service's A/AAAA records, re-resolved every ``interval_s``."""

    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    models: tuple[str, ...] = ()
    interval_s: float = Field(default=5.0, gt=0)
    credentials: PodCredentials | None = Field(default=None, description="for the pods it finds")


class DiscoveryConfig(Frozen):
    """Where pods come from besides ``pods``, and how often they are asked which models they
    serve (``GET /v1/models``)."""

    refresh_interval_s: float = Field(default=15.0, gt=0)
    retry_interval_s: float = Field(default=1.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    kubernetes: KubernetesDiscoveryConfig | None = None
    dns: DnsDiscoveryConfig | None = None

    @model_validator(mode="after")
    def _one_dynamic_source(self) -> DiscoveryConfig:
        # Each source's update replaces the discovered pods with its own: two would evict each other.
        if self.kubernetes is not None and self.dns is not None:
            raise ValueError("set discovery.kubernetes or discovery.dns, not both")
        return self

    @property
    def dynamic(self) -> bool:
        return self.kubernetes is not None or self.dns is not None


class ReloadConfig(Frozen):
    """Config reload (``gateway.reload``): SIGHUP always re-reads the file; ``watch`` also re-reads it
    when it changes (a Kubernetes ConfigMap's update included)."""

    watch: bool = Field(default=True, description="poll the config file and reload when it changes")
    interval_s: float = Field(default=1.0, gt=0, description="how often the file is checked")


class Config(Frozen):
    server: ServerConfig = ServerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    retries: RetryConfig = RetryConfig()
    resume: ResumeConfig = ResumeConfig()
    tiers: dict[str, TierConfig] = Field(default_factory=dict)
    health: HealthConfig = HealthConfig()
    shedding: SheddingConfig = SheddingConfig()
    affinity: AffinityConfig | None = None
    auth: AuthConfig = AuthConfig()
    quotas: QuotasConfig = QuotasConfig()
    admin: AdminConfig = AdminConfig()
    tracing: TracingConfig = TracingConfig()
    tier_header: str = Field(default="x-sluicegate-tier", pattern=r"^[a-z0-9-]+$")
    pods: tuple[PodConfig, ...] = ()
    routes: dict[str, RouteConfig] = Field(default_factory=dict, description="public model -> variants")
    reload: ReloadConfig = ReloadConfig()

    @field_validator("pods", mode="wrap")
    @classmethod
    def _unique_names(cls, pods: Any, handler: ValidatorFunctionWrapHandler) -> tuple[PodConfig, ...]:
        # Wrapped, not "after": an after-validator runs only once every pod is valid, so a duplicate
        # name would surface only on the second try. Here it is reported beside the pods' own errors.
        duplicates = _duplicate_names(pods)
        try:
            validated = handler(pods)
        except ValidationError as exc:
            if not duplicates:
                raise
            raise ValidationError.from_exception_data(exc.title, [*exc.errors(), *duplicates]) from None
        if duplicates:
            raise ValidationError.from_exception_data(cls.__name__, duplicates)
        return validated

    @field_validator("tiers")
    @classmethod
    def _tier_stages_within_total(
        cls, tiers: dict[str, TierConfig], info: ValidationInfo
    ) -> dict[str, TierConfig]:
        timeouts = info.data.get("timeouts")  # absent when timeouts itself is invalid
        if isinstance(timeouts, TimeoutsConfig):
            problems = [
                problem
                for name, tier in tiers.items()
                for model, overrides in [(None, None), *timeouts.models.items()]
                for problem in _stages_over_total(timeouts, model, overrides, name, tier.timeouts)
            ]
            if problems:
                raise ValueError(_over_total(problems))
        return tiers

    @model_validator(mode="after")
    def _token_quotas_have_a_cap(self) -> Config:
        # Admission reserves each request's max_tokens: without a cap a request could reserve (and
        # a pod generate) up to the model's whole context, so a token quota needs one.
        where = [("quotas.default", self.quotas.default, self.server.max_tokens)]
        for name, tier in self.tiers.items():
            cap = tier.max_tokens if tier.max_tokens is not None else self.server.max_tokens
            where.append((f"tiers.{name}.quota", tier.quota, cap))
        for key, quota, cap in where:
            if quota is not None and quota.tokens_per_minute is not None and cap is None:
                raise ValueError(
                    f"{key}.tokens_per_minute needs a max_tokens cap (the tier's max_tokens or "
                    "server.max_tokens): admission reserves each request's max_tokens"
                )
        return self

    @field_validator("tiers")
    @classmethod
    def _keys_in_the_store(cls, tiers: dict[str, TierConfig]) -> dict[str, TierConfig]:
        for name, tier in tiers.items():
            if tier.api_keys:
                raise ValueError(
                    f"tier {name!r} lists api_keys: keys now live in the key store (auth.keys_file), "
                    f"hashed; add each with: sluicegate keys create --tier {name}"
                )
        return tiers


class ConfigError(Exception):
    """A config problem worded for the operator: which file, which field, what is wrong."""


def _duplicate_names(pods: Any) -> list[InitErrorDetails]:
    """A "used twice" error at each repeated pod name, read from the raw list, so that a duplicate
    is found even while other pods are invalid."""
    if not isinstance(pods, list | tuple):
        return []
    seen: set[str] = set()
    errors: list[InitErrorDetails] = []
    for index, pod in enumerate(pods):
        name = pod.get("name") if isinstance(pod, dict) else getattr(pod, "name", None)
        if not isinstance(name, str) or not name:
            continue
        if name in seen:
            message = "pod name '{name}' is used twice; names must be unique"
            error = PydanticCustomError("duplicate_name", message, {"name": name})
            errors.append(InitErrorDetails(type=error, loc=(index, "name"), input=name))
        seen.add(name)
    return errors

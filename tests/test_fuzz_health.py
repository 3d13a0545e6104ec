"""Property tests of the health parsers: dcgm-exporter and vLLM ``/metrics`` pages, KEP-4680 device health
in a Pod object, and the mig-agent's ``/v1/devices`` document.

Each is fed by a remote party (an exporter, a pod, the API server, a node agent). Whatever arrives, a
parser returns its result or raises ValueError (documented: the monitor logs it and keeps the last
verdicts); never another exception, which would kill the scrape loop. What the parsers return is then
fed to its consumers (``*_since``), which must not raise either."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gateway.health import exposition
from gateway.health.dcgm import DcgmReport, iter_samples, parse_dcgm
from gateway.health.k8s_device import device_verdicts, mig_profile
from gateway.health.mig_agent import parse_agent_devices
from gateway.health.verdict import DeviceVerdict
from gateway.health.vllm_metrics import PodLoad, parse_vllm_metrics
from tests.fuzz_strategies import json_values, mutated, nested, peak_bytes, wire_sample

GPU = "GPU-5e0f8a2c-1b7d-4c1e-9a55-0c3f2d7e8b11"
DCGM = wire_sample(
    "dcgm-exporter-mig.txt",
    (
        f'DCGM_FI_DEV_FB_USED{{UUID="{GPU}",GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",pod="a"}} 8512\n'
        "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
        f'DCGM_FI_DEV_XID_ERRORS{{UUID="{GPU}",err_code="79",err_msg="GPU has fallen off the bus"}} 79\n'
        f'DCGM_FI_DEV_GPU_TEMP{{UUID="{GPU}"}} 61\n'
    ).encode(),
)
VLLM = wire_sample(
    "vllm-metrics.txt",
    b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.4\n'
    b'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0\n'
    b'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5\n'
    b'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 5.0\n'
    b'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 9.0\n',
)
POD = yaml.safe_load(
    wire_sample(
        "pod-device-health.yaml",
        b"spec: {containers: [{name: vllm, resources: {limits: {nvidia.com/mig-1g.10gb: '1'}}}]}\n"
        b"status: {containerStatuses: [{allocatedResourcesStatus: [{name: nvidia.com/mig-1g.10gb,"
        b" resources: [{resourceID: MIG-2ce7a541, health: Unhealthy}]}]}]}\n",
    )
)

VALUES = st.sampled_from(["0", "1", "79", "-1", "NaN", "+Inf", "-Inf", "1e309", "9" * 400, "0x10", "1_0", ""])
DCGM_NAMES = st.sampled_from([
    "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
])  # fmt: skip
VLLM_NAMES = st.sampled_from([
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
])  # fmt: skip
LABELS = st.sampled_from([
    "UUID", "uuid", "GPU_I_ID", "GPU_I_PROFILE", "namespace", "pod", "err_msg", "Hostname", "le",
    "model_name", "engine",
])  # fmt: skip
LABEL_VALUES = st.one_of(
    VALUES, st.sampled_from([GPU, "GPU-x", "٣", " 3 ", "m", "Unknown Error"]), st.text(max_size=6)
)


@st.composite
def series_lines(draw: st.DrawFn, names: st.SearchStrategy[str]) -> bytes:
    """Well-formed-looking lines of the series a parser reads, with hostile label and sample values."""
    lines = []
    for _ in range(draw(st.integers(1, 8))):
        labels = draw(st.dictionaries(LABELS, LABEL_VALUES, max_size=4))
        rendered = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{draw(names)}{{{rendered}}} {draw(VALUES)}")
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


def dcgm_pages() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=300), mutated(DCGM), series_lines(DCGM_NAMES))


def vllm_pages() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=300), mutated(VLLM), series_lines(VLLM_NAMES))


def _dcgm(page: bytes) -> DcgmReport | None:
    try:
        return parse_dcgm(page)
    except ValueError as exc:
        assert str(exc).startswith("malformed dcgm-exporter metrics text")
        return None


def _vllm(page: bytes, model: str | None = None) -> PodLoad | None:
    try:
        return parse_vllm_metrics(page, model)
    except ValueError as exc:
        assert str(exc).startswith("malformed vLLM metrics text")
        return None


# -- dcgm-exporter ---------------------------------------------------------------------------------


@given(dcgm_pages())
@example(f'DCGM_FI_DEV_XID_ERRORS{{UUID="{GPU}"}} +Inf\n'.encode())  # found by fuzzing: OverflowError
@example(f'DCGM_FI_DEV_XID_ERRORS{{UUID="{GPU}"}} -Inf\n'.encode())
@example(f'DCGM_FI_DEV_XID_ERRORS{{UUID="{GPU}"}} 1e300\n'.encode())
@example(f'DCGM_FI_DEV_GPU_TEMP{{UUID="{GPU}"}} {"9" * 400}\n'.encode())  # an int too large for a float
@example(f'DCGM_FI_DEV_FB_USED{{UUID="{GPU}",GPU_I_ID="{"9" * 5000}"}} 1\n'.encode())
def test_dcgm_page_gives_verdicts_or_value_error(page: bytes) -> None:
    report = _dcgm(page)
    if report is None:
        return
    assert all(isinstance(v, DeviceVerdict) and isinstance(v.reason, str) for v in report.verdicts)
    assert len(report.verdicts) + len(report.slices) <= 2 * page.count(b"\n") + 2  # bounded by the input
    if any(not v.healthy for v in report.verdicts):
        assert any(v.reason for v in report.verdicts if not v.healthy)


@given(st.text(max_size=300))
def test_iter_samples_yields_samples_or_raises_value_error(text: str) -> None:
    try:
        for family, name, labels, value in iter_samples(text, "test"):
            assert isinstance(family, str) and isinstance(name, str) and isinstance(value, float)
            assert isinstance(labels, dict)
    except ValueError as exc:
        assert str(exc).startswith("malformed test metrics text")


# -- vLLM ------------------------------------------------------------------------------------------


@given(vllm_pages(), st.none() | st.just("m"))
@example(b"vllm:num_requests_running +Inf\n", None)  # found by fuzzing: OverflowError from round()
@example(b"vllm:num_requests_waiting NaN\n", None)  # found by fuzzing: ValueError, not the parser's own
@example(b"vllm:time_to_first_token_seconds_count -Inf\n", "m")
@example(b'vllm:inter_token_latency_seconds_bucket{le="NaN"} 1\n', None)
@example(b"vllm:kv_cache_usage_perc " + b"9" * 400 + b"\n", None)  # found by fuzzing: the parser gave an int
def test_vllm_page_gives_a_pod_load_or_value_error(page: bytes, model: str | None) -> None:
    load = _vllm(page, model)
    if load is None:
        return
    for count in (load.num_requests_running, load.num_requests_waiting, load.ttft_count, load.itl_count):
        assert count is None or isinstance(count, int)


@given(vllm_pages(), vllm_pages(), st.floats(0, 1), st.integers(0, 10))
def test_what_two_scrapes_parse_to_never_breaks_the_pace_estimates(
    earlier_page: bytes, later_page: bytes, q: float, min_tokens: int
) -> None:
    earlier, later = _vllm(earlier_page), _vllm(later_page)
    if earlier is None or later is None:
        return
    for got in (
        later.ttft_mean_since(earlier),
        later.itl_mean_since(earlier),
        later.itl_quantile_since(earlier, q, min_tokens),
    ):
        assert got is None or isinstance(got, float)


def _reference(line: str) -> list[tuple[str, dict[str, str], float]] | None:
    """What prometheus_client's own parser reads from one sample line (None: it refuses it)."""
    try:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(line + "\n")
            for s in family.samples
        ]
    except Exception:  # the reference refuses with several exception types
        return None


def _same(a: list[tuple[str, dict[str, str], float]], b: list[tuple[str, dict[str, str], float]]) -> bool:
    return [(n, labels, repr(v)) for n, labels, v in a] == [(n, labels, repr(v)) for n, labels, v in b]


ESCAPED = st.text(alphabet='ab "\\}{,=\n', max_size=6).map(
    lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
)


@st.composite
def sample_lines(draw: st.DrawFn) -> str:
    """Valid sample lines of every shape the text format allows: escaped label values holding the
    format's own punctuation, a trailing comma, spaces, special values, timestamps."""
    labels = draw(st.dictionaries(LABELS, ESCAPED, max_size=4))
    pad = draw(st.sampled_from(["", " "]))
    rendered = ",".join(f"{pad}{k}{pad}={pad}\"{v}\"" for k, v in labels.items())
    rendered += draw(st.sampled_from(["", ","] if labels else [""]))
    head = draw(VLLM_NAMES) + (f"{{{rendered}}}" if labels or draw(st.booleans()) else "")
    value = draw(st.sampled_from(["0", "3", "1.5", "-2e-3", "+Inf", "-Inf", "NaN", "9" * 40]))
    stamp = draw(st.sampled_from(["", " 1732700000000", " -5"]))
    return f"{head}{draw(st.sampled_from([' ', '  ', chr(9)]))}{value}{stamp}"


@given(sample_lines())
def test_the_fast_sample_reader_reads_every_valid_line_as_prometheus_client_does(line: str) -> None:
    reference = _reference(line)
    assert reference is not None, line  # the generator makes valid lines only
    assert _same([exposition.sample(line)], reference), line


@given(VLLM_NAMES, st.text(alphabet=list('le="1 ,}{\\\tn+Inf._xa'), max_size=30))
def test_the_fast_sample_reader_accepts_only_what_prometheus_client_reads_alike(name: str, rest: str) -> None:
    line = name + rest
    try:
        ours = [exposition.sample(line)]
    except ValueError:
        return  # stricter than the reference is allowed: a scrape of such a page is refused
    reference = _reference(line)
    assert reference is not None and _same(ours, reference), (line, ours, reference)


def test_parsing_a_big_page_holds_about_the_page_in_memory() -> None:
    """A pod's page of 40k series the gateway does not read (~4 MB): filtered, not parsed whole."""
    page = "".join(
        f'vllm:request_latency_seconds_bucket{{engine="0",le="{i}",model_name="m"}} {i}.0\n'
        for i in range(40_000)
    ) + 'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
    load, peak = peak_bytes(lambda: parse_vllm_metrics(page))
    assert isinstance(load, PodLoad) and load.num_requests_running == 7
    assert peak < 4 * len(page)


# -- KEP-4680 device health in a Pod object --------------------------------------------------------

POD_KEYS = st.sampled_from([
    "status", "containerStatuses", "allocatedResourcesStatus", "resources", "resourceID", "health",
    "spec", "containers", "limits", "requests", "nvidia.com/mig-1g.10gb", "name",
])  # fmt: skip


@st.composite
def mutated_pods(draw: st.DrawFn) -> Any:
    """The real Pod excerpt with one subtree (or a leaf) replaced by arbitrary JSON."""
    pod = copy.deepcopy(POD)
    node, path = pod, []
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        key = draw(st.sampled_from(list(node.keys()) if isinstance(node, dict) else list(range(len(node)))))
        path.append((node, key))
        node = node[key]
    replacement = draw(json_values(POD_KEYS) | st.sampled_from(["MIG-x::3", "GPU-y", "Unhealthy", ""]))
    if path:
        parent, key = path[-1]
        parent[key] = replacement
        return pod
    return replacement if isinstance(replacement, dict) else pod


@given(mutated_pods() | json_values(POD_KEYS).filter(lambda v: isinstance(v, dict)))
def test_any_pod_object_gives_device_verdicts_and_a_profile(pod: dict[str, Any]) -> None:
    verdicts = device_verdicts(pod)
    assert all(isinstance(v, DeviceVerdict) for v in verdicts)
    assert len({v.key for v in verdicts}) == len(verdicts)
    profile = mig_profile(pod)
    assert profile is None or isinstance(profile, str)


# -- mig-agent -------------------------------------------------------------------------------------

AGENT_KEYS = st.sampled_from([
    "schema_version", "gpus", "slices", "uuid", "healthy", "reason", "gpu_uuid", "gpu_instance_id",
    "mig_uuid",
])  # fmt: skip
agent_documents = st.one_of(
    json_values(AGENT_KEYS),
    st.fixed_dictionaries(
        {},
        optional={
            "schema_version": st.sampled_from([1, 1.0, True, 2, "1"]),
            "gpus": st.lists(st.dictionaries(AGENT_KEYS, json_values(AGENT_KEYS)), max_size=3),
            "slices": st.lists(st.dictionaries(AGENT_KEYS, json_values(AGENT_KEYS)), max_size=3),
        },
    ),
)


@given(agent_documents)
def test_any_agent_document_gives_verdicts_or_value_error(doc: Any) -> None:
    try:
        verdicts = parse_agent_devices(doc)
    except ValueError as exc:
        assert str(exc).startswith("mig-agent devices:")
        return
    assert all(isinstance(v, DeviceVerdict) and isinstance(v.healthy, bool) for v in verdicts)


@given(st.binary(max_size=300))
@example(nested(100_000))  # found by fuzzing: RecursionError from json.loads
@example(b"1" * 5000)  # past Python's int-digits limit: a plain ValueError, not JSONDecodeError
@example(b'{"gpus": [{"uuid": "GPU-1", "healthy": true, "reason": "\\ud800"}]}')
def test_any_agent_bytes_give_verdicts_or_value_error(body: bytes) -> None:
    try:
        verdicts = parse_agent_devices(body)
    except ValueError as exc:
        assert str(exc).startswith("mig-agent devices:")
        return
    assert all(isinstance(v, DeviceVerdict) for v in verdicts)
    assert len(verdicts) <= body.count(b"{")

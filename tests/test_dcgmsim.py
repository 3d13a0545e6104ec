"""The fake dcgm-exporter as a real process over a real socket, read back with our own DCGM parser."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.health.dcgm import DcgmReport, parse_dcgm
from gateway.health.verdict import DeviceKey
from loadtest.dcgmsim import (
    Dcgmsim,
    DcgmsimConfig,
    DcgmsimProcess,
    DcgmsimStartError,
    GpuSpec,
    PodRef,
    SliceSpec,
    parse_gpu_spec,
)

WIRE = Path(__file__).resolve().parents[2] / "shared" / "wire"
DCGM_SAMPLE = (WIRE / "dcgm-exporter-mig.txt").read_text() if WIRE.exists() else None

GPU = "GPU-5e0f8a2c-1b7d-4c1e-9a55-0c3f2d7e8b11"  # the sample's GPU, slices and pod
GPU2 = "GPU-0b9d3c1e-77aa-4f00-8e21-5d6c7b8a9f10"  # a whole GPU mapped to one pod
SLICE_A = DeviceKey(gpu_uuid=GPU, gpu_instance_id=9, pod="llm/vllm-a-7d9f-x2k")
SLICE_B = DeviceKey(gpu_uuid=GPU, gpu_instance_id=3)
WHOLE = DeviceKey(gpu_uuid=GPU2, pod="llm/big")
ARGS = [
    "--gpu",
    f"{GPU}:1g.10gb@9=llm/vllm-a-7d9f-x2k,2g.20gb@3",
    "--gpu",
    f"{GPU2}=llm/big",
    "--hostname",
    "gpu-node-3",
]
SERIES = re.compile(r"^(\w+)\{(.*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def dcgm() -> Iterator[DcgmsimProcess]:
    with DcgmsimProcess(ARGS) as proc:
        yield proc


@pytest.fixture
def client(dcgm: DcgmsimProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dcgm.url, timeout=10) as http:
        yield http
        http.delete("/faults").raise_for_status()  # each test starts from healthy GPUs


def scrape(client: httpx.Client) -> DcgmReport:
    response = client.get("/metrics")
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_dcgm(response.text)


def health(report: DcgmReport) -> dict[DeviceKey, tuple[bool, str]]:
    return {v.key: (v.healthy, v.reason) for v in report.verdicts}


def series_labels(text: str) -> dict[tuple[str, str | None], list[tuple[str, str]]]:
    """(metric, GPU_I_ID) -> the series' labels in order, for the sample's GPU."""
    found = {}
    for line in text.splitlines():
        match = SERIES.match(line)
        if match:
            labels = LABEL.findall(match.group(2))
            if dict(labels).get("UUID") == GPU:
                found[(match.group(1), dict(labels).get("GPU_I_ID"))] = labels
    return found


# --- over the socket ------------------------------------------------------------------------------


def test_healthy_gpus_and_per_slice_usage(client: httpx.Client) -> None:
    report = scrape(client)
    assert health(report) == {
        DeviceKey(gpu_uuid=GPU): (True, "no fault reported"),
        WHOLE: (True, "no fault reported"),
    }
    assert set(report.slices) == {SLICE_A, SLICE_B, WHOLE}
    a, b = report.slices[SLICE_A], report.slices[SLICE_B]
    assert (a.profile, a.hostname, a.fb_used_mib + a.fb_free_mib) == ("1g.10gb", "gpu-node-3", 9728)
    assert a.fb_used_mib > 0 and b.fb_used_mib == 0  # a vLLM pod holds slice 9; slice 3 is idle


@pytest.mark.skipif(DCGM_SAMPLE is None, reason="shared wire samples not present")
def test_page_has_the_real_exporters_help_type_lines_and_labels(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    ours = series_labels(text)
    theirs = series_labels(DCGM_SAMPLE)
    assert theirs and set(theirs) <= set(ours)
    for key, labels in theirs.items():
        # same label names in the same order, same values but for the XID message wording
        assert [k for k, _ in ours[key]] == [k for k, _ in labels], key
        assert [kv for kv in ours[key] if kv[0] != "err_msg"] == [
            (k, "0" if k == "err_code" else v) for k, v in labels if k != "err_msg"
        ], key
    headers = {line for line in DCGM_SAMPLE.splitlines() if line.startswith("#")}
    assert headers <= set(text.splitlines())


def test_xid_injected_on_a_slice_shows_on_its_parent_gpu_as_with_the_real_exporter(
    client: httpx.Client,
) -> None:
    answer = client.post("/faults", json={"gpu_uuid": GPU, "gpu_instance_id": 9, "xid": 79})
    assert answer.status_code == 200
    assert answer.json()["rendered_on"] == "gpu"
    text = client.get("/metrics").text
    xid_lines = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_XID_ERRORS{")]
    assert all("GPU_I_ID" not in line for line in xid_lines)
    verdicts = health(parse_dcgm(text))
    healthy, reason = verdicts[DeviceKey(gpu_uuid=GPU)]
    assert not healthy and reason.startswith("XID 79 (")
    assert verdicts[WHOLE] == (True, "no fault reported")  # the other GPU is untouched


def test_application_xid_does_not_mark_the_gpu_unhealthy(client: httpx.Client) -> None:
    client.post("/faults", json={"gpu_uuid": GPU, "xid": 13}).raise_for_status()
    healthy, reason = health(scrape(client))[DeviceKey(gpu_uuid=GPU)]
    assert healthy and "application" in reason


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"ecc_dbe": 2}, "double-bit ECC errors since the driver loaded: 2"),
        ({"row_remap_failure": 1}, "a memory row remap failed"),
        ({"temp_c": 95}, "temperature 95 C at or above the 90 C limit"),
    ],
)
def test_device_faults_make_the_whole_gpu_unhealthy(client: httpx.Client, fault: dict, reason: str) -> None:
    client.post("/faults", json={"gpu_uuid": GPU2, **fault}).raise_for_status()
    assert health(scrape(client))[WHOLE] == (False, reason)


def test_faults_merge_and_delete_clears_one_gpu_or_all(client: httpx.Client) -> None:
    client.post("/faults", json={"gpu_uuid": GPU, "xid": 48}).raise_for_status()
    client.post("/faults", json={"gpu_uuid": GPU, "temp_c": 93}).raise_for_status()
    client.post("/faults", json={"gpu_uuid": GPU2, "ecc_dbe": 1}).raise_for_status()
    _, reason = health(scrape(client))[DeviceKey(gpu_uuid=GPU)]
    assert "XID 48" in reason and "temperature 93 C" in reason
    assert client.get("/faults").json()[GPU]["xid"] == 48

    assert client.delete("/faults", params={"gpu_uuid": GPU}).json() == {"cleared": [GPU]}
    verdicts = health(scrape(client))
    assert verdicts[DeviceKey(gpu_uuid=GPU)][0] and not verdicts[WHOLE][0]
    client.delete("/faults").raise_for_status()
    assert all(healthy for healthy, _ in health(scrape(client)).values())


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ({"gpu_uuid": "GPU-nope", "xid": 79}, "no GPU"),
        ({"gpu_uuid": GPU, "gpu_instance_id": 5, "xid": 79}, "no GPU instance 5"),
        ({"gpu_uuid": GPU, "xid": 79, "severity": "high"}, "unknown keys"),
        ({"gpu_uuid": GPU}, "nothing to set"),
        ({"gpu_uuid": GPU, "xid": -1}, "xid must be"),
        ({"gpu_uuid": GPU, "row_remap_failure": 2}, "at most 1"),
        ({"xid": 79}, "give gpu_uuid"),  # two GPUs here: which one must be said
    ],
)
def test_bad_fault_requests_are_refused_and_change_nothing(
    client: httpx.Client, body: dict, complaint: str
) -> None:
    answer = client.post("/faults", json=body)
    assert answer.status_code == 400
    assert complaint in answer.json()["error"]
    assert all(healthy for healthy, _ in health(scrape(client)).values())


def test_non_json_fault_body_is_refused(client: httpx.Client) -> None:
    assert client.post("/faults", content=b"xid=79").status_code == 400


def test_usage_is_set_per_slice(client: httpx.Client) -> None:
    body = {"gpu_uuid": GPU, "gpu_instance_id": 3, "fb_used_mib": 5000, "gr_engine_active": 0.5}
    client.post("/usage", json=body).raise_for_status()
    report = scrape(client)
    b = report.slices[SLICE_B]
    assert (b.fb_used_mib, b.fb_free_mib, b.gr_engine_active) == (5000, 19456 - 5000, 0.5)
    assert report.slices[SLICE_A].gr_engine_active == 0.0
    refused = client.post("/usage", json={"gpu_uuid": GPU, "fb_used_mib": 1})
    assert refused.status_code == 400 and "gpu_instance_id" in refused.json()["error"]


# --- configuration and command line ---------------------------------------------------------------


def test_gpu_specs() -> None:
    assert parse_gpu_spec(f"{GPU}:1g.10gb@9=llm/a,2g.20gb@3") == GpuSpec(
        GPU, (SliceSpec("1g.10gb", 9, PodRef("llm", "a")), SliceSpec("2g.20gb", 3))
    )
    assert parse_gpu_spec(f"{GPU}=llm/big/server") == GpuSpec(GPU, pod=PodRef("llm", "big", "server"))
    assert parse_gpu_spec(GPU) == GpuSpec(GPU)
    for bad in ("gpu-1", f"{GPU}:1g.10gb", f"{GPU}:1g.10gb@x", f"{GPU}:9g@1", f"{GPU}:1g.10gb@1,1g.10gb@1"):
        with pytest.raises(ValueError):
            parse_gpu_spec(bad)


def test_single_gpu_without_ecc_and_with_the_newer_hostname_label() -> None:
    sim = Dcgmsim(
        DcgmsimConfig(
            [parse_gpu_spec(f"{GPU}:1g.10gb@1")], hostname="n1", hostname_label="hostname", ecc=False
        )
    )
    sim.inject({"xid": 94})  # the only GPU needs no name
    text = sim.render()
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" not in text and 'hostname="n1"' in text
    report = parse_dcgm(text)
    assert not report.verdicts[0].healthy
    assert report.slices[DeviceKey(gpu_uuid=GPU, gpu_instance_id=1)].hostname == "n1"


def test_help_and_a_bad_command_line() -> None:
    run = [sys.executable, "-m", "loadtest.dcgmsim"]
    shown = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "--gpu SPEC" in shown.stdout
    with pytest.raises(DcgmsimStartError, match="a slice is PROFILE@GPU_I_ID"):
        DcgmsimProcess(["--gpu", f"{GPU}:1g.10gb"]).start()

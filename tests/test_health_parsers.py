"""The sans-IO health parsers (XID policy, dcgm-exporter, vLLM /metrics, KEP-4680 pod status), on the real
wire samples in ../shared/wire and on small inline pages for the edge cases."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from gateway.health.dcgm import SliceUsage, parse_dcgm
from gateway.health.k8s_device import device_verdicts, mig_profile
from gateway.health.verdict import DeviceKey, DeviceVerdict
from gateway.health.vllm_metrics import PodLoad, parse_vllm_metrics
from gateway.health.xid import APPLICATION_XIDS, describe, is_critical
from loadtest.podsim.server import Podsim, PodsimConfig

WIRE = Path(__file__).resolve().parents[2] / "shared" / "wire"
DCGM_SAMPLE = (WIRE / "dcgm-exporter-mig.txt").read_text() if WIRE.exists() else None
VLLM_SAMPLE = (WIRE / "vllm-metrics.txt").read_text() if WIRE.exists() else None
POD_SAMPLE = yaml.safe_load((WIRE / "pod-device-health.yaml").read_text()) if WIRE.exists() else None
no_wire = pytest.mark.skipif(not WIRE.exists(), reason="shared wire samples not present")

GPU = "GPU-5e0f8a2c-1b7d-4c1e-9a55-0c3f2d7e8b11"
GPU2 = "GPU-0b9d3c1e-77aa-4f00-8e21-5d6c7b8a9f10"
MIG = "MIG-2ce7a541-c516-5dbc-a76e-26cc100d9b55"


def series(
    name: str, value: float, gpu: str = GPU, gi: int | None = None, pod: str | None = None, **more: str
) -> str:
    """One dcgm-exporter line with the exporter's label layout."""
    labels = [f'gpu="0",UUID="{gpu}",pci_bus_id="00000000:07:00.0",device="nvidia0"']
    if gi is not None:
        labels.append(f'GPU_I_PROFILE="1g.10gb",GPU_I_ID="{gi}"')
    labels.append('Hostname="node-1"')
    labels += [f'{k}="{v}"' for k, v in more.items()]
    if pod:
        namespace, name_ = pod.split("/")
        labels.append(f'container="vllm",namespace="{namespace}",pod="{name_}"')
    return f"{name}{{{','.join(labels)}}} {value}\n"


def only(verdicts: list[DeviceVerdict]) -> DeviceVerdict:
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


# --- XID policy -----------------------------------------------------------------------------------


def test_application_xids_are_not_device_faults_and_every_other_xid_is() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == APPLICATION_XIDS
    assert not any(is_critical(x) for x in APPLICATION_XIDS)
    assert all(is_critical(x) for x in (48, 63, 64, 74, 79, 94, 95, 119, 999))
    assert not is_critical(0)  # the exporter's "no XID yet"


def test_xid_descriptions_name_the_well_known_faults() -> None:
    assert "bus" in describe(79)
    assert "double-bit ECC" in describe(48)
    assert "uncontained" in describe(95) and "contained" in describe(94)
    assert "row remap" in describe(63) and "row remap" in describe(64)
    assert describe(4242)  # something readable even for an XID we have no text for


# --- dcgm-exporter --------------------------------------------------------------------------------


@no_wire
def test_wire_sample_gpu_wide_xid_79_takes_down_the_whole_gpu() -> None:
    report = parse_dcgm(DCGM_SAMPLE)
    verdict = only(report.verdicts)
    assert verdict.key == DeviceKey(gpu_uuid=GPU)  # no GPU instance: every slice of the GPU
    assert not verdict.healthy
    assert verdict.reason == "XID 79 (GPU has fallen off the bus)"
    assert verdict.source == "dcgm"


@no_wire
def test_wire_sample_slice_usage_is_keyed_by_parent_gpu_instance_and_pod() -> None:
    report = parse_dcgm(DCGM_SAMPLE.encode())  # bytes straight off the socket work too
    key = DeviceKey(gpu_uuid=GPU, gpu_instance_id=9, pod="llm/vllm-a-7d9f-x2k")
    assert report.slices == {key: SliceUsage(8512, 1216, 0.734, "1g.10gb", "gpu-node-3")}


def test_healthy_gpu_gets_a_healthy_verdict_so_old_faults_can_be_cleared() -> None:
    text = series("DCGM_FI_DEV_GPU_TEMP", 61) + series("DCGM_FI_DEV_XID_ERRORS", 0, err_code="0")
    verdict = only(parse_dcgm(text).verdicts)
    assert verdict.key == DeviceKey(gpu_uuid=GPU)
    assert verdict.healthy and verdict.reason == "no fault reported"


def test_application_xid_leaves_the_gpu_healthy_but_says_why() -> None:
    verdict = only(parse_dcgm(series("DCGM_FI_DEV_XID_ERRORS", 13, err_code="13")).verdicts)
    assert verdict.healthy
    assert "XID 13" in verdict.reason and "application" in verdict.reason


def test_device_wide_xid_concerns_every_slice_of_that_gpu_only() -> None:
    text = (
        series("DCGM_FI_DEV_FB_USED", 100, gi=9, pod="llm/a")
        + series("DCGM_FI_DEV_FB_USED", 200, gi=3, pod="llm/b")
        + series("DCGM_FI_DEV_FB_USED", 300, gpu=GPU2, gi=1, pod="llm/c")
        + series("DCGM_FI_DEV_XID_ERRORS", 48, err_code="48", err_msg="Double Bit ECC Error")
        + series("DCGM_FI_DEV_XID_ERRORS", 0, gpu=GPU2, err_code="0")
    )
    report = parse_dcgm(text)
    assert [(v.key, v.healthy) for v in report.verdicts] == [
        (DeviceKey(gpu_uuid=GPU2), True),
        (DeviceKey(gpu_uuid=GPU), False),
    ]
    assert report.verdicts[1].reason == "XID 48 (Double Bit ECC Error)"
    assert sorted(k.gpu_instance_id for k in report.slices if k.gpu_uuid == GPU) == [3, 9]


def test_health_field_exported_per_slice_gives_that_slice_its_own_verdict() -> None:
    report = parse_dcgm(series("DCGM_FI_DEV_XID_ERRORS", 79, gi=3, err_code="79"))
    assert [(v.key, v.healthy) for v in report.verdicts] == [
        (DeviceKey(gpu_uuid=GPU), True),
        (DeviceKey(gpu_uuid=GPU, gpu_instance_id=3), False),
    ]
    assert report.verdicts[0].reason == "no GPU-wide health fields exported"
    assert "fell off the bus" in report.verdicts[1].reason  # our text when the exporter gives none


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 2), "double-bit ECC errors since the driver loaded: 2"),
        (series("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", 1), "double-bit ECC errors in the GPU's lifetime: 1"),
        (series("DCGM_FI_DEV_ROW_REMAP_FAILURE", 1), "a memory row remap failed"),
        (series("DCGM_FI_DEV_GPU_TEMP", 90), "temperature 90 C at or above the 90 C limit"),
    ],
)
def test_device_faults_other_than_xid(line: str, reason: str) -> None:
    verdict = only(parse_dcgm(line).verdicts)
    assert (verdict.healthy, verdict.reason) == (False, reason)


def test_zero_counters_and_a_cool_gpu_are_healthy_and_the_temperature_limit_is_a_parameter() -> None:
    text = (
        series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 0)
        + series("DCGM_FI_DEV_ROW_REMAP_FAILURE", 0)
        + series("DCGM_FI_DEV_GPU_TEMP", 84)
    )
    assert only(parse_dcgm(text).verdicts).healthy
    assert not only(parse_dcgm(text, max_temp_c=80).verdicts).healthy


def test_several_faults_are_all_named() -> None:
    text = series("DCGM_FI_DEV_XID_ERRORS", 95, err_code="95") + series("DCGM_FI_DEV_GPU_TEMP", 97)
    reason = only(parse_dcgm(text).verdicts).reason
    assert "XID 95" in reason and "temperature 97 C" in reason


def test_lenient_with_unknown_metrics_series_without_uuid_and_the_newer_hostname_label() -> None:
    text = (
        "# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).\n# TYPE DCGM_FI_DEV_SM_CLOCK gauge\n"
        + series("DCGM_FI_DEV_SM_CLOCK", 1410)
        + 'DCGM_FI_DEV_GPU_TEMP{gpu="0"} 99\n'
        + series("DCGM_FI_DEV_FB_FREE", 10, gi=2).replace("Hostname", "hostname")
    )
    report = parse_dcgm(text)
    assert only(report.verdicts).healthy  # the UUID-less 99 C series cannot be pinned on any GPU
    assert report.slices[DeviceKey(gpu_uuid=GPU, gpu_instance_id=2)].hostname == "node-1"
    assert parse_dcgm("").verdicts == []


@pytest.mark.parametrize(
    "text",
    [
        'DCGM_FI_DEV_GPU_TEMP{UUID="GPU-1" 61\n',
        "DCGM_FI_DEV_GPU_TEMP hot\n",
        series("DCGM_FI_DEV_FB_USED", 1, gi=9).replace('GPU_I_ID="9"', 'GPU_I_ID="nine"'),
    ],
)
def test_malformed_dcgm_text_is_a_clear_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="malformed dcgm-exporter metrics text"):
        parse_dcgm(text)


# --- vLLM /metrics --------------------------------------------------------------------------------


@no_wire
def test_wire_sample_pod_load() -> None:
    expected = PodLoad(0.91, 14, 3, 512, 88.4, 9100, 301.7, ((0.01, 3000.0), (math.inf, 9100.0)))
    assert parse_vllm_metrics(VLLM_SAMPLE) == expected
    assert parse_vllm_metrics(VLLM_SAMPLE, model="llama-8b") == expected
    assert parse_vllm_metrics(VLLM_SAMPLE, model="qwen-0.5b") == PodLoad()


def vllm(name: str, value: float, engine: str = "0", model: str = "llama-8b") -> str:
    return f'{name}{{engine="{engine}",model_name="{model}"}} {value}\n'


def test_old_metric_names_are_accepted_and_the_new_ones_win_when_both_are_there() -> None:
    old = (
        vllm("vllm:gpu_cache_usage_perc", 0.5)
        + vllm("vllm:time_per_output_token_seconds_count", 10)
        + vllm("vllm:time_per_output_token_seconds_sum", 0.3)
    )
    load = parse_vllm_metrics(old)
    assert (load.kv_cache_usage, load.itl_count, load.itl_sum_s) == (0.5, 10, 0.3)
    both = old + vllm("vllm:kv_cache_usage_perc", 0.75) + vllm("vllm:inter_token_latency_seconds_count", 4)
    load = parse_vllm_metrics(both)
    assert (load.kv_cache_usage, load.itl_count) == (0.75, 4)


def test_engines_are_summed_the_kv_cache_averaged_and_models_filtered() -> None:
    text = (
        vllm("vllm:num_requests_running", 3, engine="0")
        + vllm("vllm:num_requests_running", 5, engine="1")
        + vllm("vllm:num_requests_running", 7, model="qwen-0.5b")
        + vllm("vllm:kv_cache_usage_perc", 0.2, engine="0")
        + vllm("vllm:kv_cache_usage_perc", 0.6, engine="1")
        + vllm("vllm:time_to_first_token_seconds_count", 4, engine="0")
        + vllm("vllm:time_to_first_token_seconds_count", 6, engine="1")
    )
    load = parse_vllm_metrics(text, model="llama-8b")
    assert load.num_requests_running == 8
    assert load.kv_cache_usage == pytest.approx(0.4)
    assert load.ttft_count == 10
    assert parse_vllm_metrics(text).num_requests_running == 15
    assert parse_vllm_metrics(text, model="qwen-0.5b").num_requests_running == 7


def test_missing_metrics_are_none_not_errors() -> None:
    load = parse_vllm_metrics(vllm("vllm:num_requests_waiting", 2))
    assert load == PodLoad(num_requests_waiting=2)


def test_recent_means_come_from_two_scrapes() -> None:
    before = PodLoad(ttft_count=100, ttft_sum_s=20.0, itl_count=1000, itl_sum_s=30.0)
    after = PodLoad(ttft_count=110, ttft_sum_s=25.0, itl_count=1000, itl_sum_s=30.0)
    assert after.ttft_mean_since(before) == pytest.approx(0.5)
    assert after.itl_mean_since(before) is None  # no tokens streamed in between
    restarted = PodLoad(ttft_count=3, ttft_sum_s=0.3)
    assert restarted.ttft_mean_since(before) is None
    assert after.ttft_mean_since(PodLoad()) is None


def test_only_the_series_routing_reads_are_parsed_so_others_cannot_break_a_scrape() -> None:
    page = (
        "# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency.\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        + "".join(
            f'vllm:e2e_request_latency_seconds_bucket{{le="{le}",model_name="llama-8b"}} {i}\n'
            for i, le in enumerate((0.3, 0.5, 0.8, 1.0, 1.5, "+Inf"))
        )
        + "vllm:some_future_series{this is not valid prometheus text\n"
        + "# TYPE vllm:num_requests_waiting gauge\n"
        + vllm("vllm:num_requests_waiting", 6)
    )
    assert parse_vllm_metrics(page) == PodLoad(num_requests_waiting=6)


def itl(buckets: dict[float, float]) -> PodLoad:
    return PodLoad(itl_buckets=tuple(sorted(buckets.items())))


def test_inter_token_quantile_between_two_scrapes_interpolates_like_histogram_quantile() -> None:
    before = itl({0.01: 100, 0.05: 100, 0.1: 100, math.inf: 100})
    # since then: 60 gaps under 10 ms, 30 of 10-50 ms, 10 of 50-100 ms
    after = itl({0.01: 160, 0.05: 190, 0.1: 200, math.inf: 200})
    assert after.itl_quantile_since(before, 0.5) == pytest.approx(0.01 * 50 / 60)
    assert after.itl_quantile_since(before, 0.95) == pytest.approx(0.05 + 0.05 * 0.5)
    assert after.itl_quantile_since(before, 0.95, min_tokens=101) is None  # too few gaps to say
    slower = itl({0.01: 100, 0.05: 100, 0.1: 100, math.inf: 200})  # every new gap over 100 ms
    assert slower.itl_quantile_since(before, 0.95) == 0.1  # the last finite bound, as Prometheus
    assert before.itl_quantile_since(after, 0.95) is None  # counts went down: the pod restarted
    assert after.itl_quantile_since(PodLoad(), 0.95) is None


def test_inter_token_buckets_are_summed_over_engines() -> None:
    text = "".join(
        f'vllm:inter_token_latency_seconds_bucket{{engine="{e}",le="{le}",model_name="m"}} {n}\n'
        for e, le, n in (("0", "0.05", 3), ("0", "+Inf", 4), ("1", "0.05", 5), ("1", "+Inf", 5))
    )
    assert parse_vllm_metrics(text).itl_buckets == ((0.05, 8.0), (math.inf, 9.0))


def test_malformed_vllm_text_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="malformed vLLM metrics text"):
        parse_vllm_metrics('vllm:num_requests_running{engine="0" 1\n')


async def test_reads_what_our_pod_simulator_serves() -> None:
    sim = Podsim(PodsimConfig(models=["llama-8b", "qwen-0.5b"]))
    try:
        sim.stats["llama-8b"].ttft.observe(0.2)
        sim.stats["llama-8b"].ttft.observe(0.4)
        sim.stats["qwen-0.5b"].itl.observe(0.01)
        text = generate_latest(sim.registry)
    finally:
        sim.engine.shutdown()
    llama = parse_vllm_metrics(text, model="llama-8b")
    assert (llama.kv_cache_usage, llama.num_requests_waiting, llama.ttft_count) == (0.0, 0, 2)
    assert llama.ttft_sum_s == pytest.approx(0.6)
    assert llama.itl_buckets is not None and llama.itl_buckets[-1] == (math.inf, 0.0)
    qwen = parse_vllm_metrics(text, model="qwen-0.5b")
    assert qwen.itl_count == 1
    assert qwen.itl_buckets is not None and all(count == 1 for le, count in qwen.itl_buckets if le >= 0.01)
    assert parse_vllm_metrics(text).ttft_count == 2


# --- Kubernetes device health (KEP-4680) ----------------------------------------------------------


@no_wire
def test_wire_sample_pod_with_an_unhealthy_mig_slice() -> None:
    assert device_verdicts(POD_SAMPLE) == [
        DeviceVerdict(DeviceKey(mig_uuid=MIG), False, "Kubernetes device health: Unhealthy", "kubernetes")
    ]
    assert mig_profile(POD_SAMPLE) == "1g.10gb"


def pod(*resources: dict[str, Any], limits: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "spec": {"containers": [{"name": "vllm", "resources": {"requests": limits or {}}}]},
        "status": {
            "containerStatuses": [
                {"name": "vllm", "allocatedResourcesStatus": [{"name": "x", "resources": list(resources)}]}
            ]
        },
    }


def test_healthy_unknown_and_whole_gpus() -> None:
    verdicts = device_verdicts(
        pod(
            {"resourceID": MIG, "health": "Healthy"},
            {"resourceID": "MIG-other", "health": "Unknown"},
            {"resourceID": GPU},  # the kubelet has no health for it yet
            {"resourceID": f"{GPU2}::3", "health": "Unhealthy"},  # a time-sliced replica
            {"resourceID": "0000:3b:00.0", "health": "Unhealthy"},  # another device plugin's device
        )
    )
    assert [(v.key, v.healthy, v.reason) for v in verdicts] == [
        (DeviceKey(mig_uuid=MIG), True, "Kubernetes device health: Healthy"),
        (DeviceKey(mig_uuid="MIG-other"), True, "Kubernetes device health: Unknown (not treated as a fault)"),
        (DeviceKey(gpu_uuid=GPU), True, "Kubernetes device health: Unknown (not treated as a fault)"),
        (DeviceKey(gpu_uuid=GPU2), False, "Kubernetes device health: Unhealthy"),
    ]


def test_a_device_listed_twice_is_unhealthy_if_either_listing_says_so() -> None:
    twice = pod({"resourceID": MIG, "health": "Unhealthy"}, {"resourceID": MIG, "health": "Healthy"})
    verdict = only(device_verdicts(twice))
    assert not verdict.healthy


def test_pods_without_device_status_or_mig_resources() -> None:
    assert device_verdicts({"metadata": {"name": "p"}}) == []
    assert device_verdicts({"status": {"containerStatuses": None}}) == []
    assert mig_profile(pod(limits={"nvidia.com/gpu": "1"})) is None  # strategy single or whole GPU
    assert mig_profile(pod(limits={"cpu": "2", "nvidia.com/mig-3g.40gb": "1"})) == "3g.40gb"

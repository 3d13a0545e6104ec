"""Kubernetes discovery against the fake API server over real sockets: list, watch, bookmarks, 410, drops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from gateway.config import MigIdentity
from gateway.health.verdict import DeviceKey, DeviceVerdict
from gateway.pods.kubernetes import KubePod, KubernetesDiscovery, describe_pod
from gateway.pods.monitor import DeviceFaults
from gateway.pods.registry import Pod as RegistryPod
from loadtest.fakekube import PODS, SLICES, FakeKube, make_endpoint, make_pod, make_slice
from tests.conftest import GPU, MIG_A

NS = "llm"
MIG_RES = "nvidia.com/mig-1g.10gb"
WAIT_S = 5.0


class Watching:
    """Runs a discovery and records every snapshot it reports."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self.discovery = discovery
        self.snapshots: list[list[KubePod]] = []
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(discovery.run(self._record))

    def _record(self, pods: list[KubePod]) -> None:
        self.snapshots.append(pods)
        self._changed.set()

    async def until(self, check: Callable[[list[KubePod]], bool]) -> list[KubePod]:
        """The first snapshot (the latest, if already reported) that passes ``check``."""

        async def wait() -> list[KubePod]:
            while not (self.snapshots and check(self.snapshots[-1])):
                self._changed.clear()
                await self._changed.wait()
            return self.snapshots[-1]

        return await asyncio.wait_for(wait(), WAIT_S)

    async def names(self, *expected: str) -> list[KubePod]:
        return await self.until(lambda pods: [p.name for p in pods] == [f"{NS}/{n}" for n in expected])

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(NS) as server:
        yield server


@pytest.fixture
async def watch(kube: FakeKube) -> AsyncIterator[Callable[..., Watching]]:
    started: list[Watching] = []

    def start(**options: object) -> Watching:
        options.setdefault("backoff_base_s", 0.01)
        options.setdefault("backoff_max_s", 0.2)
        started.append(Watching(KubernetesDiscovery(NS, "vllm", api_url=kube.url, **options)))  # type: ignore[arg-type]
        return started[-1]

    yield start
    for watching in started:
        await watching.stop()


def vllm_pod(name: str, ip: str, **options: object) -> dict:
    options.setdefault("labels", {"app": "vllm", "model": "llama-8b", "variant": "stable"})
    return make_pod(name, ip, namespace=NS, **options)  # type: ignore[arg-type]


async def test_initial_list_describes_every_pod(kube: FakeKube, watch) -> None:
    kube.add_pod(
        "vllm",
        vllm_pod(
            "a",
            "10.4.2.17",
            node="gpu-node-3",
            limits={MIG_RES: "1"},
            annotations={
                "sluicegate.io/gpu-uuid": GPU,
                "sluicegate.io/gpu-instance-id": "3",
                "sluicegate.io/models": "qwen-0.5b,meta-llama/Llama-3.1-8B",
            },
            device_health=[(MIG_RES, MIG_A, "Healthy")],
        ),
    )
    kube.add_pod("vllm", vllm_pod("b", "10.4.2.18", labels={"model": "qwen-0.5b"}))
    kube.add_pod("other", vllm_pod("c", "10.4.2.19"))  # another Service's pod: not ours

    watching = watch()
    pods = await watching.names("a", "b")
    assert len(watching.snapshots) == 1  # nothing was reported before both kinds were listed
    a, b = pods
    assert a == KubePod(
        name="llm/a",
        url="http://10.4.2.17:8000",
        ready=True,
        models=("llama-8b", "qwen-0.5b", "meta-llama/Llama-3.1-8B"),
        labels={"app": "vllm", "model": "llama-8b", "variant": "stable"},
        node="gpu-node-3",
        mig_profile="1g.10gb",
        mig_uuid=MIG_A,
        gpu_uuid=GPU,
        gpu_instance_id=3,
        device_health=(
            DeviceVerdict(
                DeviceKey(mig_uuid=MIG_A, pod="llm/a"),
                True,
                "Kubernetes device health: Healthy",
                "kubernetes",
            ),
        ),
    )
    config = a.to_pod_config()
    assert config.mig == MigIdentity(gpu_uuid=GPU, mig_uuid=MIG_A, profile="1g.10gb", gpu_instance_id=3)
    assert config.labels["variant"] == "stable" and config.url == "http://10.4.2.17:8000"
    assert (b.models, b.mig_profile, b.mig_uuid, b.device_health) == (("qwen-0.5b",), None, None, ())
    assert b.to_pod_config().mig is None


def test_a_pod_known_only_by_its_slice_still_hears_of_a_fault_on_its_whole_gpu() -> None:
    """Kubernetes device health names the MIG device, not its GPU (a template cannot carry the GPU
    UUID: each replica lands on another slice); the mig-agent's slice list supplies the parent."""
    seen = KubePod(name="llm/a", url="http://10.4.2.17:8000", mig_profile="1g.10gb", mig_uuid=MIG_A)
    pod = RegistryPod(seen.to_pod_config())
    assert pod.config.mig == MigIdentity(mig_uuid=MIG_A, profile="1g.10gb")
    faults = DeviceFaults()
    xid = "XID 79 (GPU has fallen off the bus)"
    gpu_fault = DeviceVerdict(DeviceKey(gpu_uuid=GPU), False, xid, "mig-agent")
    faults.update("agent", [gpu_fault])
    assert faults.fault_for(pod) is None  # which GPU is this slice on? not known yet
    slice_a = DeviceVerdict(DeviceKey(gpu_uuid=GPU, gpu_instance_id=3, mig_uuid=MIG_A), True, "", "mig-agent")
    faults.update("agent", [gpu_fault, slice_a])
    assert faults.fault_for(pod) == "XID 79 (GPU has fallen off the bus) (mig-agent)"
    with pytest.raises(ValueError, match=r"gpu_uuid \(the parent GPU\) or mig_uuid"):
        MigIdentity(profile="1g.10gb")


async def test_port_is_chosen_by_name_or_else_the_first(kube: FakeKube, watch) -> None:
    pod = kube.put(PODS, vllm_pod("a", "10.0.0.1"))
    ports = [("metrics", 9090), ("http", 8000)]
    kube.put(SLICES, make_slice("vllm-x1", "vllm", [make_endpoint(pod)], namespace=NS, ports=ports))
    by_name, first = watch(port_name="http"), watch()
    assert (await by_name.names("a"))[0].url == "http://10.0.0.1:8000"
    assert (await first.names("a"))[0].url == "http://10.0.0.1:9090"


async def test_pods_come_become_ready_terminate_and_go(kube: FakeKube, watch) -> None:
    watching = watch()
    assert await watching.until(lambda pods: pods == []) == []

    kube.add_pod("vllm", vllm_pod("a", "10.0.0.1", ready=False), ready=False)
    assert [p.ready for p in await watching.names("a")] == [False]
    kube.set_endpoint("vllm", "a", ready=True)
    await watching.until(lambda pods: pods[0].ready)
    kube.add_pod("vllm", vllm_pod("b", "10.0.0.2"))
    await watching.names("a", "b")
    kube.set_endpoint("vllm", "a", ready=True, terminating=True)
    pods = await watching.until(lambda pods: not pods[0].ready)
    assert [p.ready for p in pods] == [False, True]
    kube.remove_pod("vllm", "a")
    await watching.names("b")


async def test_device_health_reaches_the_snapshot(kube: FakeKube, watch) -> None:
    kube.add_pod("vllm", vllm_pod("a", "10.0.0.1", limits={MIG_RES: "1"}))
    watching = watch()
    (pod,) = await watching.names("a")
    assert pod.device_health == () and pod.mig_uuid is None

    kube.set_device_health("a", MIG_RES, MIG_A, "Unhealthy")
    (pod,) = await watching.until(lambda pods: pods[0].device_health != ())
    assert pod.mig_uuid == MIG_A
    assert pod.device_health == (
        DeviceVerdict(
            DeviceKey(mig_uuid=MIG_A, pod="llm/a"), False, "Kubernetes device health: Unhealthy", "kubernetes"
        ),
    )
    kube.set_device_health("a", MIG_RES, MIG_A, "Unknown")  # no verdict either way
    await watching.until(lambda pods: pods[0].device_health == ())


def test_the_documented_pod_shape_is_read() -> None:
    """The KEP-4680 excerpt from the wire notes, as the API server would send it."""
    wire = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "vllm-a-7d9f-x2k",
            "namespace": "llm",
            "labels": {"app": "vllm", "model": "llama-8b", "variant": "stable"},
        },
        "spec": {
            "nodeName": "gpu-node-3",
            "containers": [{"name": "vllm", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}],
        },
        "status": {
            "podIP": "10.4.2.17",
            "containerStatuses": [
                {
                    "name": "vllm",
                    "ready": True,
                    # required fields the excerpt leaves out (every real container status has them)
                    "image": "vllm/vllm-openai:latest",
                    "imageID": "",
                    "restartCount": 0,
                    "allocatedResourcesStatus": [
                        {
                            "name": "nvidia.com/mig-1g.10gb",
                            "resources": [{"resourceID": MIG_A, "health": "Unhealthy"}],
                        }
                    ],
                }
            ],
        },
    }
    pod = describe_pod(msgspec.convert(wire, Pod), "http://10.4.2.17:8000", True)
    assert (pod.name, pod.models, pod.labels["variant"], pod.node) == (
        "llm/vllm-a-7d9f-x2k",
        ("llama-8b",),
        "stable",
        "gpu-node-3",
    )
    assert (pod.mig_profile, pod.mig_uuid, pod.gpu_uuid) == ("1g.10gb", MIG_A, None)
    assert [v.healthy for v in pod.device_health] == [False]


async def test_bookmarks_move_the_resume_point(kube: FakeKube, watch) -> None:
    kube.add_pod("vllm", vllm_pod("a", "10.0.0.1"))
    watching = watch(pod_labels={"app": "vllm"})
    await watching.names("a")
    await asyncio.wait_for(kube.wait_for_watches(2), WAIT_S)

    # changes neither watch is shown (another Service), so only a bookmark tells the client about them
    kube.put(PODS, make_pod("z", "10.0.9.9", labels={"app": "other"}))
    kube.put(SLICES, make_slice("other-x", "other", [], namespace=NS))
    current = str(kube.rv)
    kube.bookmark()
    kube.drop_watches()
    kube.expire_history()  # anything older than the bookmark would now be 410 Gone

    await asyncio.wait_for(kube.wait_for_watches(4), WAIT_S)
    assert sorted(kube.watches[2:]) == [(SLICES, current), (PODS, current)]
    assert sorted(kube.lists) == [SLICES, PODS]  # resumed, not listed again


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_gone_relists_and_the_snapshot_catches_up(gone_as_http: bool) -> None:
    async with FakeKube(NS, gone_as_http=gone_as_http) as kube:
        kube.add_pod("vllm", vllm_pod("a", "10.0.0.1"))
        kube.add_pod("vllm", vllm_pod("b", "10.0.0.2"))
        watching = Watching(KubernetesDiscovery(NS, "vllm", api_url=kube.url, backoff_base_s=0.01))
        try:
            await watching.names("a", "b")
            await asyncio.wait_for(kube.wait_for_watches(2), WAIT_S)
            # while the client is away: a is deleted, c arrives, and the history of both is compacted
            kube.drop_watches()
            kube.remove_pod("vllm", "a")
            kube.add_pod("vllm", vllm_pod("c", "10.0.0.3"))
            kube.expire_history()

            await watching.names("b", "c")
            await asyncio.wait_for(kube.wait_for_watches(6), WAIT_S)  # 2 refused, 2 from the new lists
            assert sorted(kube.lists) == [SLICES, SLICES, PODS, PODS]
            assert watching.discovery.snapshot() == watching.snapshots[-1]
        finally:
            await watching.stop()


async def test_a_dropped_watch_resumes_where_it_was(kube: FakeKube, watch) -> None:
    kube.add_pod("vllm", vllm_pod("a", "10.0.0.1"))
    watching = watch()
    await watching.names("a")
    await asyncio.wait_for(kube.wait_for_watches(2), WAIT_S)
    seen = str(kube.rv)

    kube.drop_watches()
    kube.add_pod("vllm", vllm_pod("b", "10.0.0.2"))  # happens while no watch is open
    await watching.names("a", "b")
    assert sorted(kube.watches[2:4]) == [(SLICES, seen), (PODS, seen)]
    assert len(kube.lists) == 2


async def test_an_api_server_restart_is_retried(kube: FakeKube, watch) -> None:
    kube.add_pod("vllm", vllm_pod("a", "10.0.0.1"))
    watching = watch()
    await watching.names("a")
    port = int(kube.url.rsplit(":", 1)[1])

    await kube.stop()  # connections refused until it is back; the state (and history) survive
    kube.add_pod("vllm", vllm_pod("b", "10.0.0.2"))
    await kube.start(port=port)
    await watching.names("a", "b")
    assert len(kube.lists) == 2

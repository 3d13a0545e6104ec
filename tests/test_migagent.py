"""The mig-agent on a fake NVML, over a real socket: inventory, the XID policy, stickiness, the
gateway-side parser, the exit without a driver, and (only where a driver exists) the real pynvml path.

Waiting is bounded polling of ``/v1/devices`` until the expected state (or the agent's ``last_xid``
proving an event was handled) shows, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pynvml
import pytest

from gateway.health.mig_agent import parse_agent_devices
from gateway.health.verdict import DeviceKey
from gateway.migagent import ALL_INSTANCES, READY_PREFIX, MigAgent, main, serve
from loadtest.fakenvml import FakeNVML, write_injection

GPU0 = "GPU-11111111-2222-3333-4444-555555555555"
GPU1 = "GPU-66666666-7777-8888-9999-000000000000"
GPU2 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
MIG_3G = "MIG-00000000-0000-0000-0000-000000000001"  # GI 1 CI 0
MIG_1C_A = "MIG-00000000-0000-0000-0000-000000000002"  # GI 5 CI 0
MIG_1C_B = "MIG-00000000-0000-0000-0000-000000000003"  # GI 5 CI 1
MIG_1G = "MIG-00000000-0000-0000-0000-000000000004"  # GI 9 CI 0, after an empty slot
GB = 1000**3
Doc = dict[str, Any]  # a /v1/devices document

SPEC: Doc = {
    "driver": "550.54.15",
    "gpus": [
        {
            "uuid": GPU0,
            "name": "NVIDIA A100-SXM4-80GB",
            "mig": True,
            "slices": [
                {"uuid": MIG_3G, "profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0,
                 "memory_used_bytes": 5 * GB},
                {"uuid": MIG_1C_A, "profile": "1c.2g.20gb", "gpu_instance_id": 5, "compute_instance_id": 0},
                {"uuid": MIG_1C_B, "profile": "1c.2g.20gb", "gpu_instance_id": 5, "compute_instance_id": 1},
                {"uuid": MIG_1G, "profile": "1g.10gb", "gpu_instance_id": 9, "compute_instance_id": 0,
                 "slot": 5},
            ],
        },
        {"uuid": GPU1, "name": "NVIDIA H100 80GB HBM3", "mig": False},
        {"uuid": GPU2, "name": "NVIDIA L4", "mig": None, "xid_events": False, "memory_total_bytes": 24 * GB},
    ],
}
ALL_SLICES = {MIG_3G, MIG_1C_A, MIG_1C_B, MIG_1G}


class LoopGuard:
    """Passes calls through to an NVML object and records any made on the event loop's thread."""

    def __init__(self, nvml: Any, loop_thread: int) -> None:
        self._nvml = nvml
        self._loop_thread = loop_thread
        self.on_loop: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nvml, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._loop_thread:
                self.on_loop.append(name)
            return attr(*args, **kwargs)

        return call


@dataclass
class Running:
    """An agent's URL, a client for it, and (when in-process) its fake NVML."""

    url: str
    client: httpx.AsyncClient
    fake: FakeNVML = field(default_factory=lambda: FakeNVML({}))

    async def devices(self) -> Doc:
        response = await self.client.get(f"{self.url}/v1/devices")
        response.raise_for_status()
        return response.json()

    async def until(self, predicate: Callable[[Doc], bool], timeout_s: float = 10.0) -> Doc:
        """Poll ``/v1/devices`` until ``predicate`` holds; fail with the last document after the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            doc = await self.devices()
            if predicate(doc):
                return doc
            if time.monotonic() > deadline:
                pytest.fail(f"not met within {timeout_s}s; last document: {json.dumps(doc, indent=1)}")
            await asyncio.sleep(0.01)

    async def clear(self, uuid: str) -> httpx.Response:
        return await self.client.post(f"{self.url}/v1/clear", json={"uuid": uuid})


def gpu(doc: Doc, uuid: str) -> Doc:
    return next(g for g in doc["gpus"] if g["uuid"] == uuid)


def piece(doc: Doc, mig_uuid: str) -> Doc:
    return next(s for s in doc["slices"] if s["mig_uuid"] == mig_uuid)


def unhealthy(doc: Doc) -> set[str]:
    return {g["uuid"] for g in doc["gpus"] if not g["healthy"]} | {
        s["mig_uuid"] for s in doc["slices"] if not s["healthy"]
    }


@contextlib.asynccontextmanager
async def running_agent(spec: Doc = SPEC) -> AsyncIterator[Running]:
    fake = FakeNVML(spec)
    guard = LoopGuard(fake, threading.get_ident())
    agent = MigAgent(guard, node="node-a", poll_ms=50)
    await asyncio.to_thread(agent.start)
    stop = asyncio.Event()
    bound: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(agent, "127.0.0.1", 0, announce=bound.set_result, stop=stop))
    try:
        url = await asyncio.wait_for(bound, 10)
        async with httpx.AsyncClient(timeout=5) as client:
            yield Running(url, client, fake)
    finally:
        stop.set()
        await server
        await asyncio.to_thread(agent.stop)
    assert guard.on_loop == [], f"NVML called on the event loop thread: {guard.on_loop}"


async def test_enumerates_gpus_and_slices() -> None:
    async with running_agent() as run:
        health = await run.client.get(f"{run.url}/healthz")
        assert health.status_code == 200
        doc = await run.devices()
    assert (doc["schema_version"], doc["node"], doc["driver"]) == (1, "node-a", "550.54.15")
    assert isinstance(doc["updated_at"], float)
    assert [(g["index"], g["uuid"], g["mig_mode"], g["xid_events"]) for g in doc["gpus"]] == [
        (0, GPU0, True, True),
        (1, GPU1, False, True),
        (2, GPU2, None, False),  # MIG unsupported -> null; events unsupported -> not watched
    ]
    assert gpu(doc, GPU2)["memory_total_bytes"] == 24 * GB
    assert all(g["healthy"] and g["reason"] is None and g["last_xid"] is None for g in doc["gpus"])
    assert [(s["gpu_uuid"], s["mig_uuid"], s["gpu_instance_id"], s["compute_instance_id"], s["profile"])
            for s in doc["slices"]] == [
        (GPU0, MIG_3G, 1, 0, "3g.40gb"),
        (GPU0, MIG_1C_A, 5, 0, "1c.2g.20gb"),
        (GPU0, MIG_1C_B, 5, 1, "1c.2g.20gb"),
        (GPU0, MIG_1G, 9, 0, "1g.10gb"),  # found past the empty slots (NVMLError_NotFound)
    ]
    big = piece(doc, MIG_3G)
    assert (big["memory_total_bytes"], big["memory_used_bytes"]) == (40 * GB, 5 * GB)
    assert all(s["healthy"] and s["reason"] is None for s in doc["slices"])


async def test_inventory_is_refreshed() -> None:
    async with running_agent() as run:
        run.fake.set_memory_used(MIG_1G, 3 * GB)
        doc = await run.until(lambda d: piece(d, MIG_1G)["memory_used_bytes"] == 3 * GB)
    assert piece(doc, MIG_1G)["memory_total_bytes"] == 10 * GB


async def test_application_xids_leave_devices_healthy() -> None:
    async with running_agent() as run:
        assert run.fake.inject_xid(0, 13, gpu_instance_id=5, compute_instance_id=0) == 1
        assert run.fake.inject_xid(0, 43) == 1
        assert run.fake.inject_xid(1, 31) == 1
        doc = await run.until(
            lambda d: piece(d, MIG_1C_A)["last_xid"] == 13 and gpu(d, GPU0)["last_xid"] == 43
            and gpu(d, GPU1)["last_xid"] == 31
        )
    assert unhealthy(doc) == set()


async def test_critical_xid_on_a_slice_marks_only_that_slice() -> None:
    async with running_agent() as run:
        run.fake.inject_xid(0, 94, gpu_instance_id=5, compute_instance_id=1)
        doc = await run.until(lambda d: not piece(d, MIG_1C_B)["healthy"])
        assert unhealthy(doc) == {MIG_1C_B}  # not its GI sibling on CI 0, not the GPU
        assert piece(doc, MIG_1C_B)["reason"] == "XID 94 (contained uncorrectable ECC error)"
        assert piece(doc, MIG_1C_B)["last_xid"] == 94

        # A GPU-instance-wide XID (CI id 0xFFFFFFFF) concerns every compute instance of that GI.
        run.fake.inject_xid(0, 48, gpu_instance_id=5, compute_instance_id=ALL_INSTANCES)
        doc = await run.until(lambda d: not piece(d, MIG_1C_A)["healthy"])
        assert unhealthy(doc) == {MIG_1C_A, MIG_1C_B}
        assert piece(doc, MIG_1C_B)["reason"].startswith("XID 94")  # the first fault is kept
        assert piece(doc, MIG_1C_B)["last_xid"] == 48

        # An XID naming a GPU instance that does not exist is ignored.
        run.fake.inject_xid(0, 48, gpu_instance_id=3, compute_instance_id=0)
        run.fake.inject_xid(0, 13, gpu_instance_id=1, compute_instance_id=0)  # a marker after it
        doc = await run.until(lambda d: piece(d, MIG_3G)["last_xid"] == 13)
        assert unhealthy(doc) == {MIG_1C_A, MIG_1C_B}


async def test_device_wide_xid_marks_the_gpu_and_all_its_slices() -> None:
    async with running_agent() as run:
        run.fake.inject_xid(0, 79)  # GI and CI ids 0xFFFFFFFF
        doc = await run.until(lambda d: not gpu(d, GPU0)["healthy"])
        assert unhealthy(doc) == {GPU0} | ALL_SLICES
        assert gpu(doc, GPU0)["reason"] == "XID 79 (GPU fell off the bus)"
        assert {piece(doc, m)["reason"] for m in ALL_SLICES} == {"XID 79 (GPU fell off the bus)"}

        # On a GPU without MIG mode any XID is device-wide, whatever ids it carries.
        run.fake.inject_xid(1, 48, gpu_instance_id=0, compute_instance_id=0)
        doc = await run.until(lambda d: not gpu(d, GPU1)["healthy"])
        assert unhealthy(doc) == {GPU0, GPU1} | ALL_SLICES
        assert gpu(doc, GPU2)["healthy"]


async def test_a_lost_gpu_keeps_its_entry_and_is_unhealthy() -> None:
    async with running_agent() as run:
        run.fake.lose_gpu(1)
        doc = await run.until(lambda d: gpu(d, GPU1)["nvml_error"] is not None)
    lost = gpu(doc, GPU1)
    assert (lost["index"], lost["name"], lost["healthy"]) == (1, "NVIDIA H100 80GB HBM3", False)
    assert (lost["nvml_error"], lost["reason"]) == ("GPU is lost", "NVML: GPU is lost")
    assert unhealthy(doc) == {GPU1}


async def test_unhealthy_is_sticky_until_cleared() -> None:
    async with running_agent() as run:
        run.fake.inject_xid(0, 79)
        run.fake.inject_xid(0, 48, gpu_instance_id=9, compute_instance_id=0)
        doc = await run.until(lambda d: not gpu(d, GPU0)["healthy"] and piece(d, MIG_1G)["last_xid"] == 48)
        first = doc["updated_at"]
        # several inventory refreshes later, nothing has healed by itself
        doc = await run.until(lambda d: d["updated_at"] > first + 0.2)
        assert unhealthy(doc) == {GPU0} | ALL_SLICES

        # Clearing one slice removes its own fault, but the GPU's still covers it.
        response = await run.clear(MIG_1G)
        assert response.json() == {"cleared": [MIG_1G]}
        assert unhealthy(await run.devices()) == {GPU0} | ALL_SLICES
        # Clearing the GPU clears it and its slices.
        response = await run.clear(GPU0)
        assert response.status_code == 200 and response.json() == {"cleared": [GPU0]}
        doc = await run.devices()
        assert unhealthy(doc) == set()
        assert gpu(doc, GPU0)["last_xid"] == 79  # history stays

        run.fake.inject_xid(0, 48, gpu_instance_id=1, compute_instance_id=0)
        await run.until(lambda d: unhealthy(d) == {MIG_3G})
        response = await run.clear(GPU0)
        assert response.json() == {"cleared": [MIG_3G]}

        assert (await run.clear("MIG-nope")).status_code == 404
        bad = await run.client.post(f"{run.url}/v1/clear", content=b"not json")
        assert bad.status_code == 400
        assert (await run.client.post(f"{run.url}/v1/clear", json={"uuid": 7})).status_code == 400


async def test_parser_turns_agent_json_into_verdicts() -> None:
    async with running_agent() as run:
        run.fake.inject_xid(0, 94, gpu_instance_id=9, compute_instance_id=0)
        await run.until(lambda d: not piece(d, MIG_1G)["healthy"])
        raw = (await run.client.get(f"{run.url}/v1/devices")).content
    verdicts = parse_agent_devices(raw)
    assert parse_agent_devices(json.loads(raw)) == verdicts
    by_key = {v.key: v for v in verdicts}
    assert set(by_key) == {
        DeviceKey(gpu_uuid=GPU0),
        DeviceKey(gpu_uuid=GPU1),
        DeviceKey(gpu_uuid=GPU2),
        DeviceKey(gpu_uuid=GPU0, gpu_instance_id=1, mig_uuid=MIG_3G),
        DeviceKey(gpu_uuid=GPU0, gpu_instance_id=5, mig_uuid=MIG_1C_A),
        DeviceKey(gpu_uuid=GPU0, gpu_instance_id=5, mig_uuid=MIG_1C_B),
        DeviceKey(gpu_uuid=GPU0, gpu_instance_id=9, mig_uuid=MIG_1G),
    }
    assert {v.source for v in verdicts} == {"mig-agent"}
    sick = by_key[DeviceKey(gpu_uuid=GPU0, gpu_instance_id=9, mig_uuid=MIG_1G)]
    assert (sick.healthy, sick.reason) == (False, "XID 94 (contained uncorrectable ECC error)")
    assert [v.key for v in verdicts if not v.healthy] == [sick.key]
    assert by_key[DeviceKey(gpu_uuid=GPU0)].reason == "healthy"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "expected a JSON object"),
        ({"schema_version": 2, "gpus": []}, "schema_version"),
        ({"gpus": {}}, "'gpus' must be a list"),
        ({"gpus": [{"uuid": "GPU-x", "healthy": "yes"}]}, "gpus[0].healthy"),
        ({"gpus": [{"uuid": "", "healthy": True}]}, "gpus[0].uuid"),
        ({"gpus": [{"uuid": "GPU-x", "healthy": False, "reason": 5}]}, "gpus[0].reason"),
        ({"slices": [{"gpu_uuid": "GPU-x", "mig_uuid": "MIG-y", "healthy": True}]},
         "slices[0].gpu_instance_id"),
        ({"slices": [{"gpu_uuid": "GPU-x", "mig_uuid": "MIG-y", "gpu_instance_id": True, "healthy": True}]},
         "slices[0].gpu_instance_id"),
        ({"slices": ["MIG-y"]}, "'slices' must be a list of objects"),
    ],
)
def test_parser_refuses_malformed_documents(payload: Any, message: str) -> None:
    with pytest.raises(ValueError, match="mig-agent devices") as caught:
        parse_agent_devices(payload)
    assert message in str(caught.value)


def test_fake_follows_pynvml_semantics() -> None:
    fake = FakeNVML(SPEC)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    try:
        assert fake.nvmlDeviceGetCount() == 3
        gpu0, gpu2 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(2)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            fake.nvmlDeviceGetHandleByIndex(3)
        assert fake.nvmlDeviceGetMigMode(gpu0) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
        with pytest.raises(pynvml.NVMLError_NotSupported) as caught:
            fake.nvmlDeviceGetMigMode(gpu2)
        assert caught.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
        assert isinstance(caught.value, fake.NVMLError)
        assert fake.nvmlDeviceGetMaxMigDeviceCount(gpu2) == 0
        with pytest.raises(pynvml.NVMLError_NotFound):
            fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 4)
        mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 5)
        assert fake.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
        assert (fake.nvmlDeviceGetGpuInstanceId(mig), fake.nvmlDeviceGetComputeInstanceId(mig)) == (9, 0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceGetGpuInstanceId(gpu0)
        attrs = fake.nvmlDeviceGetAttributes(mig)
        assert (attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount) == (1, 1)
        assert isinstance(fake.nvmlDeviceGetMemoryInfo(mig), pynvml.c_nvmlMemory_t)

        events = fake.nvmlEventSetCreate()
        with pytest.raises(pynvml.NVMLError_NotSupported):
            fake.nvmlDeviceRegisterEvents(gpu2, pynvml.nvmlEventTypeXidCriticalError, events)
        assert fake.inject_xid(0, 79) == 0  # nobody registered: the event is lost, as with NVML
        started = time.monotonic()
        fake.nvmlDeviceRegisterEvents(gpu0, pynvml.nvmlEventTypeXidCriticalError, events)
        with pytest.raises(pynvml.NVMLError_Timeout):
            fake.nvmlEventSetWait(events, 50)
        assert time.monotonic() - started >= 0.045
        threading.Timer(0.05, fake.inject_xid, (0, 48, 9, 0)).start()
        event = fake.nvmlEventSetWait(events, 5000)  # woken by the injection from another thread
        assert event.device is gpu0
        assert (event.eventType, event.eventData, event.gpuInstanceId, event.computeInstanceId) == (
            pynvml.nvmlEventTypeXidCriticalError, 48, 9, 0,
        )
        assert {name for name, _ in pynvml.c_nvmlEventData_t._fields_} == set(type(event).__slots__)
        fake.nvmlEventSetFree(events)
    finally:
        fake.nvmlShutdown()


def test_fake_has_pynvml_signatures() -> None:
    fake = FakeNVML({})
    names = [n for n in dir(fake) if n.startswith("nvml") and callable(getattr(fake, n))]
    assert {"nvmlInit", "nvmlEventSetWait", "nvmlDeviceGetMigDeviceHandleByIndex"} <= set(names)
    for name in names:
        real = inspect.signature(getattr(pynvml, name)).parameters
        assert list(inspect.signature(getattr(fake, name)).parameters) == list(real), name
    for name in dir(pynvml):
        if name.startswith(("NVMLError", "NVML_", "nvmlEventType")):
            assert getattr(fake, name) is getattr(pynvml, name)


def test_without_nvml_the_agent_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "nodriver.json"
    spec.write_text(json.dumps({"init_error": "DRIVER_NOT_LOADED"}))
    assert main(["--fake-nvml", str(spec), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mig-agent: cannot initialise NVML: Driver Not Loaded")


def _real_nvml_available() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


REAL_NVML = _real_nvml_available()


@pytest.mark.skipif(REAL_NVML, reason="this machine has an NVIDIA driver")
async def test_real_pynvml_without_a_driver_exits_2() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.migagent", "--port", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and out == b""
    lines = err.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mig-agent: cannot initialise NVML:"), lines


async def test_agent_process_receives_injections_through_the_control_file(tmp_path: Path) -> None:
    spec = tmp_path / "node.json"
    spec.write_text(json.dumps(SPEC))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.migagent", "--fake-nvml", str(spec), "--host", "127.0.0.1",
        "--port", "0", "--poll-ms", "50", "--node-name", "node-b",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()  # type: ignore[union-attr]
        assert line.startswith(READY_PREFIX), line
        url = line[len(READY_PREFIX):].strip()
        write_injection(f"{spec}.xid", 0, 94, gpu_instance_id=1, compute_instance_id=0)
        async with httpx.AsyncClient(timeout=5) as client:
            run = Running(url, client)
            doc = await run.until(lambda d: not piece(d, MIG_3G)["healthy"])
        assert doc["node"] == "node-b" and unhealthy(doc) == {MIG_3G}
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0


@pytest.mark.skipif(not REAL_NVML, reason="needs an NVIDIA driver (libnvidia-ml.so.1)")
async def test_real_nvml_snapshot() -> None:
    """On a GPU machine: the same code path on the real pynvml, whatever MIG mode the GPUs are in."""
    agent = MigAgent(pynvml, node="real", poll_ms=100)
    await asyncio.to_thread(agent.start)
    try:
        first = agent.snapshot()
        deadline = time.monotonic() + 10
        while agent.snapshot()["updated_at"] == first["updated_at"]:  # a monitor cycle ran (event wait)
            assert time.monotonic() < deadline and agent.alive()
            await asyncio.sleep(0.05)
        doc = agent.snapshot()
    finally:
        await asyncio.to_thread(agent.stop)
    print(json.dumps(doc, indent=1))
    assert doc["driver"] and doc["gpus"]
    for g in doc["gpus"]:
        assert g["uuid"].startswith("GPU-") and g["mig_mode"] in (True, False, None)
    for s in doc["slices"]:
        assert s["mig_uuid"].startswith("MIG-") and s["profile"]
    assert len(parse_agent_devices(json.dumps(doc).encode())) == len(doc["gpus"]) + len(doc["slices"])


def test_gpu_node_check_passes_on_the_fake_nvml(tmp_path: Path) -> None:
    """The GPU node's check script (agent, a pod on the first GPU, a gateway polling the agent), run
    on the fake so that it cannot rot between the sessions that have a GPU."""
    from loadtest import gpu_node_check

    spec = tmp_path / "node.json"
    gpu = {"uuid": GPU1, "name": "NVIDIA H200", "mig": False}
    spec.write_text(json.dumps({"driver": "550.54.15", "gpus": [gpu]}))
    summary = gpu_node_check.run(str(spec))
    assert summary["ok"], summary
    assert summary["pod_identity"] == {"gpu_uuid": GPU1}
    assert summary["stream"]["done"] and summary["agent_exit_on_sigterm"] == 0

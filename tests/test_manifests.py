"""The Kubernetes manifests in config/kubernetes/ checked against the code they deploy.

Each check stands for a mistake that would otherwise surface only in a cluster: a misspelt field that
the API server silently drops, a config the gateway refuses at start-up, a Role missing a verb the
discovery code uses, a probe on a route that does not exist, a grace period shorter than the drain, a
model server the gateway would not recognise. Expectations are derived from the code wherever it can
say them (the CLI parser, the config models, the app's routes, the discovery code's own requests), so
the manifests and the code cannot drift apart unnoticed.

The TLS listener is shipped commented out (it needs a certificate Secret); the blocks between
``# --- TLS:`` and ``# --- end TLS`` markers are also checked enabled, together, so they stay valid
against ``server.tls`` in gateway/config.py.

No cluster and no network: at most a loopback socket for the recording API server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from aiohttp import web
from lightkube import codecs
from lightkube.core.resource import NamespacedResource
from lightkube.models.core_v1 import Container, PodSpec, Volume
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import DaemonSet, Deployment
from lightkube.resources.core_v1 import ConfigMap, Namespace, Pod, Service, ServiceAccount
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding

from gateway.app import Gateway
from gateway.auth.keystore import KeyStore, hash_key, new_key, write_file
from gateway.cli import build_parser, resolve_config
from gateway.config import Config, MigIdentity
from gateway.migagent import MigAgent, make_app
from gateway.pods.kubernetes import MIG_RESOURCE_PREFIX, KubernetesDiscovery, describe_pod
from gateway.server import build_server

K8S = Path(__file__).resolve().parent.parent / "config" / "kubernetes"
KUSTOMIZATION = K8S / "kustomization.yaml"
TLS_START, TLS_END = "# --- TLS:", "# --- end TLS"

# Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/), the
# parts these manifests could get wrong.
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
    "secret",
}


# --- small helpers ------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p != KUSTOMIZATION)


def with_tls(text: str) -> str:
    """``text`` with the lines between the TLS markers uncommented (their first ``# `` removed)."""
    lines, inside = [], False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith(TLS_START) or stripped.startswith(TLS_END):
            inside = stripped.startswith(TLS_START)
        elif inside:
            at = line.find("# ")
            assert at >= 0 and not line[:at].strip(), f"not a commented-out line in a TLS block: {line!r}"
            line = line[:at] + line[at + 2:]
        lines.append(line)
    assert not inside, "a TLS block is not closed"
    return "".join(lines)


def containers(spec: PodSpec) -> list[Container]:
    return [*(spec.initContainers or []), *spec.containers]


def argv(container: Container) -> list[str]:
    return [*(container.command or []), *(container.args or [])]


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in an argument list."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def selects(selector: dict[str, str] | None, labels: dict[str, str] | None) -> bool:
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def port_number(spec: PodSpec, port: int | str, protocol: str = "TCP") -> int | None:
    """A probe's or Service's port (a number or a container port's name) as a number, if declared."""
    for container in spec.containers:
        for declared in container.ports or []:
            if (declared.protocol or "TCP") == protocol and port in (declared.name, declared.containerPort):
                return declared.containerPort
    return None


def volume_for(spec: PodSpec, container: Container, path: str) -> tuple[Volume, str]:
    """The volume a container sees ``path`` in, and the path's key (file name) within that volume."""
    for mount in container.volumeMounts or []:
        if mount.subPath:
            if path != mount.mountPath:
                continue
            key = mount.subPath
        elif PurePosixPath(mount.mountPath) in PurePosixPath(path).parents:
            key = str(PurePosixPath(path).relative_to(mount.mountPath))
        else:
            continue
        volume = next(v for v in spec.volumes or [] if v.name == mount.name)
        source = volume.configMap or volume.secret
        for item in (source.items or []) if source else []:
            if item.path == key:
                key = item.key
        return volume, key
    raise AssertionError(f"nothing is mounted at {path} in container {container.name}")


class Manifests:
    """The manifests as lightkube objects, as shipped or with the TLS blocks enabled."""

    def __init__(self, tls: bool = False) -> None:
        self.tls = tls
        self.texts = {}
        for path in manifest_files():
            text = path.read_text(encoding="utf-8")
            self.texts[path.name] = with_tls(text) if tls else text
        self.raw = [
            (name, doc) for name, text in self.texts.items() for doc in yaml.safe_load_all(text) if doc
        ]
        self.objects = [obj for text in self.texts.values() for obj in codecs.load_all_yaml(text)]

    def of_kind(self, kind: type) -> list[Any]:
        return [obj for obj in self.objects if isinstance(obj, kind)]

    def one(self, kind: type, name: str, namespace: str | None = None) -> Any:
        found = [
            obj for obj in self.of_kind(kind)
            if obj.metadata.name == name and namespace in (None, obj.metadata.namespace)
        ]
        assert len(found) == 1, f"expected one {kind.__name__} {namespace}/{name}, found {len(found)}"
        return found[0]

    def workloads(self) -> Iterator[tuple[str, Deployment | DaemonSet]]:
        for workload in [*self.of_kind(Deployment), *self.of_kind(DaemonSet)]:
            yield f"{workload.kind} {workload.metadata.namespace}/{workload.metadata.name}", workload

    def gateway(self) -> Deployment:
        return self.one(Deployment, "sluicegate", "sluicegate")

    def gateway_container(self) -> Container:
        return next(c for c in self.gateway().spec.template.spec.containers if c.name == "gateway")

    def agent(self) -> DaemonSet:
        return self.one(DaemonSet, "sluicegate-mig-agent")

    def gateway_config(self, directory: Path) -> Config:
        """The config the gateway container really runs with: its command line parsed by the real
        CLI parser, the file its ConfigMap mount provides, the command-line flags applied."""
        deployment, container = self.gateway(), self.gateway_container()
        args = build_parser().parse_args(argv(container)[1:])
        assert args.command == "serve" and args.config, "the gateway must run `sluicegate serve --config`"
        volume, key = volume_for(deployment.spec.template.spec, container, args.config)
        assert volume.configMap is not None, f"{args.config} does not come from a ConfigMap"
        config_map = self.one(ConfigMap, volume.configMap.name, deployment.metadata.namespace)
        assert key in (config_map.data or {}), f"ConfigMap {config_map.metadata.name} has no key {key}"
        copy = directory / PurePosixPath(args.config).name
        copy.write_text(config_map.data[key], encoding="utf-8")
        args.config = str(copy)
        return resolve_config(args)


@functools.cache
def shipped() -> Manifests:
    return Manifests()


@functools.cache
def tls_enabled() -> Manifests:
    return Manifests(tls=True)


@pytest.fixture(params=["shipped", "tls-enabled"])
def manifests(request: pytest.FixtureRequest) -> Manifests:
    return shipped() if request.param == "shipped" else tls_enabled()


@pytest.fixture(scope="module")
def gateway_config(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """The shipped config, its key store (a Secret in the cluster) a real one written here."""
    directory = tmp_path_factory.mktemp("config")
    config = shipped().gateway_config(directory)
    store = directory / "keys.yaml"
    write_file(store, [{"id": "ops", "hash": hash_key(new_key()), "rights": ["admin"]}])
    return config.model_copy(update={"auth": config.auth.model_copy(update={"keys_file": str(store)})})


def get_routes(config: Config) -> set[str]:
    """The paths the gateway answers GET on (its public control-plane routes)."""
    return {r.path for r in Gateway(config).control.routes if "GET" in (r.methods or ())}


def admin_get_routes(config: Config) -> set[str]:
    """The paths the admin listener answers GET on (``/metrics``, ``/admin/...``)."""
    return {r.path for r in Gateway(config).admin.app.routes if "GET" in (r.methods or ())}


# --- the files themselves -----------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_once() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text(encoding="utf-8"))
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed)), "a file is listed twice"
    assert sorted(listed) == [p.name for p in manifest_files()]
    # Namespaces differ per file (the Role must sit in the model servers' namespace): a global
    # `namespace:` would move every object, the Role and the RoleBinding's subject included.
    assert "namespace" not in kustomization


def test_the_kustomize_image_override_names_the_image_the_manifests_use() -> None:
    names = {entry["name"] for entry in yaml.safe_load(KUSTOMIZATION.read_text())["images"]}
    for container in [shipped().gateway_container(), *shipped().agent().spec.template.spec.containers]:
        repository = container.image.rsplit(":", 1)[0]
        assert repository in names, f"kustomization.yaml images: does not rewrite {container.image}"


def test_every_document_loads_into_lightkube_models_without_losing_a_field(manifests: Manifests) -> None:
    """lightkube ignores keys its models do not know, as the API server drops unknown fields; a
    round trip that loses something means a misspelt or misplaced field."""
    assert len(manifests.raw) == len(manifests.objects)
    for (name, doc), obj in zip(manifests.raw, manifests.objects, strict=True):
        assert obj.to_dict() == doc, f"{name}: {doc['kind']} {doc['metadata']['name']} lost or changed fields"


def test_names_are_unique_and_every_namespace_is_declared() -> None:
    declared = {ns.metadata.name for ns in shipped().of_kind(Namespace)}
    seen = set()
    for obj in shipped().objects:
        key = (obj.kind, obj.metadata.namespace, obj.metadata.name)
        assert key not in seen, f"{key} is defined twice"
        seen.add(key)
        if isinstance(obj, NamespacedResource):
            assert obj.metadata.namespace in declared, f"{key}: namespace missing or not declared"
        else:
            assert obj.metadata.namespace is None, f"{key} is cluster-scoped"


# --- the gateway --------------------------------------------------------------------------------


def test_the_gateway_config_is_valid_and_listens_where_the_pod_expects(gateway_config: Config) -> None:
    assert gateway_config.discovery.kubernetes is not None
    assert gateway_config.server.host in ("0.0.0.0", "::"), "a loopback listener fails every probe"
    assert gateway_config.server.tls is None, "shipped without TLS: it needs a certificate Secret"
    spec = shipped().gateway().spec.template.spec
    assert port_number(spec, "http") == gateway_config.server.port


def test_the_key_store_is_a_mounted_secret_the_gateway_rereads(tmp_path: Path) -> None:
    """Auth is on, so the pod starts only with its key store: a Secret's key mounted where
    auth.keys_file points, as a directory (a subPath mount is never updated, so a rotated key store
    would never reach the gateway)."""
    config = shipped().gateway_config(tmp_path)
    assert config.auth.enabled, "auth is on by default and the shipped config keeps it on"
    spec, container = shipped().gateway().spec.template.spec, shipped().gateway_container()
    volume, key = volume_for(spec, container, config.auth.keys_file)
    assert volume.secret is not None and volume.secret.secretName == "sluicegate-keys"
    assert key == "keys.yaml", f"{config.auth.keys_file} is the Secret's key {key}, not keys.yaml"
    mount = next(m for m in container.volumeMounts if m.name == volume.name)
    assert not mount.subPath, "a subPath mount of a Secret is never updated: key changes would not arrive"
    assert mount.readOnly
    assert config.auth.reload_interval_s <= 5


def _kubelet_writes(directory: Path, version: str, records: list[dict[str, Any]]) -> None:
    """Update a Secret volume as the kubelet's atomic writer does: the files go into a new hidden
    directory, the ``..data`` link is swapped to it by a rename, and each key is a link through
    ``..data``; so the file at the mounted path changes identity, never contents in place."""
    write_file(directory / version / "keys.yaml", records)
    (directory / "..data_tmp").symlink_to(version)
    old = (directory / "..data").readlink() if (directory / "..data").is_symlink() else None
    (directory / "..data_tmp").rename(directory / "..data")
    if not (directory / "keys.yaml").is_symlink():
        (directory / "keys.yaml").symlink_to("..data/keys.yaml")
    if old is not None:
        for leftover in (directory / old).iterdir():
            leftover.unlink()
        (directory / old).rmdir()


async def test_a_secret_updated_in_place_is_reread_without_a_restart(tmp_path: Path) -> None:
    first, second = new_key(), new_key()
    _kubelet_writes(tmp_path, "..v1", [{"id": "alice", "hash": hash_key(first)}])
    store = KeyStore.load(tmp_path / "keys.yaml", None, reload_interval_s=0.05)
    assert store.lookup(first) is not None and store.lookup(second) is None
    _kubelet_writes(tmp_path, "..v2", [{"id": "bob", "hash": hash_key(second)}])  # alice revoked
    assert await store.refresh()
    assert store.lookup(first) is None and store.lookup(second) is not None


def test_probes_and_scrape_annotations_use_real_gateway_routes(gateway_config: Config) -> None:
    get_paths = get_routes(gateway_config)
    deployment, container = shipped().gateway(), shipped().gateway_container()
    spec = deployment.spec.template.spec
    assert container.readinessProbe.httpGet.path == "/readyz"
    assert container.livenessProbe.httpGet.path == "/healthz"
    for probe in (container.readinessProbe, container.livenessProbe, container.startupProbe):
        if probe is not None:
            assert probe.httpGet.path in get_paths
            assert port_number(spec, probe.httpGet.port) == gateway_config.server.port
    annotations = deployment.spec.template.metadata.annotations
    assert annotations["prometheus.io/path"] not in get_paths  # /metrics is not on the public port
    assert annotations["prometheus.io/path"] in admin_get_routes(gateway_config)
    assert int(annotations["prometheus.io/port"]) == gateway_config.admin.port


def test_the_admin_listener_is_a_named_pod_port_that_no_service_exposes(gateway_config: Config) -> None:
    """Prometheus (another pod) must reach the admin listener, so it binds the pod IP; clients must
    not, so it is in no Service: not by name, not by number."""
    admin = gateway_config.admin
    assert admin.enabled and admin.host in ("0.0.0.0", "::"), "a loopback admin listener cannot be scraped"
    assert admin.port != gateway_config.server.port
    spec = shipped().gateway().spec.template.spec
    assert port_number(spec, "admin") == admin.port
    labels = shipped().gateway().spec.template.metadata.labels
    for manifests in (shipped(), tls_enabled()):
        for service in manifests.of_kind(Service):
            if selects(service.spec.selector, labels):
                targets = {p.targetPort or p.port for p in service.spec.ports}
                assert not targets & {"admin", admin.port}, f"{service.metadata.name} exposes the admin port"


def prestop_sleep_s(container: Container) -> float:
    pre_stop = container.lifecycle.preStop if container.lifecycle else None
    if pre_stop is None:
        return 0.0
    if pre_stop.sleep is not None:
        return float(pre_stop.sleep.seconds)
    command = pre_stop.exec.command
    assert command[0] in ("sleep", "/bin/sleep", "/usr/bin/sleep"), f"unexpected preStop {command}"
    return float(command[1])


def test_the_grace_period_outlasts_the_drain(gateway_config: Config) -> None:
    """SIGTERM comes after the preStop hook; the drain and uvicorn's own shutdown must both finish
    before the kubelet's SIGKILL, or streams are cut without their closing event."""
    server = build_server(gateway_config)
    needed = (
        prestop_sleep_s(shipped().gateway_container())
        + gateway_config.server.drain_timeout_s
        + server.config.timeout_graceful_shutdown
    )
    grace = shipped().gateway().spec.template.spec.terminationGracePeriodSeconds
    assert grace is not None and grace > needed, f"terminationGracePeriodSeconds {grace} <= {needed}"


def test_the_gateway_is_replicated_spread_and_protected_by_a_budget() -> None:
    deployment = shipped().gateway()
    assert deployment.spec.replicas >= 2
    assert deployment.spec.strategy.rollingUpdate.maxUnavailable == 0
    template = deployment.spec.template
    spread = template.spec.topologySpreadConstraints or []
    assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= {c.topologyKey for c in spread}
    for constraint in spread:
        assert selects(constraint.labelSelector.matchLabels, template.metadata.labels)
    budgets = [
        pdb for pdb in shipped().of_kind(PodDisruptionBudget)
        if pdb.metadata.namespace == deployment.metadata.namespace
        and selects(pdb.spec.selector.matchLabels, template.metadata.labels)
    ]
    assert len(budgets) == 1
    assert budgets[0].spec.maxUnavailable is not None
    assert budgets[0].spec.maxUnavailable < deployment.spec.replicas


def test_the_tls_blocks_enabled_together_make_a_working_listener(tmp_path: Path) -> None:
    """Uncommenting the four TLS blocks must give a config the current ``server.tls`` model accepts,
    its certificate and key mounted from a Secret, and container and Service ports for HTTPS (TCP)
    and, with HTTP/3 on, for QUIC (UDP)."""
    manifests = tls_enabled()
    assert manifests.texts != shipped().texts, "no TLS block found"
    config = manifests.gateway_config(tmp_path)
    tls = config.server.tls
    assert tls is not None, "the TLS blocks did not enable server.tls"
    deployment, container = manifests.gateway(), manifests.gateway_container()
    spec = deployment.spec.template.spec
    for path in (tls.cert, tls.key):
        volume, key = volume_for(spec, container, path)
        assert volume.secret is not None and volume.secret.secretName, f"{path} is not from a Secret"
        assert key in ("tls.crt", "tls.key"), f"{path}: a kubernetes.io/tls Secret has no key {key}"
    assert port_number(spec, "https", "TCP") == tls.port
    assert port_number(spec, "http", "TCP") == config.server.port  # the probes' port is unchanged
    expected = {("https", "TCP")}
    if tls.h3:
        assert port_number(spec, "h3", "UDP") == (tls.h3_port if tls.h3_port is not None else tls.port)
        expected.add(("h3", "UDP"))
    service = manifests.one(Service, "sluicegate", deployment.metadata.namespace)
    exposed = {(p.targetPort, p.protocol or "TCP") for p in service.spec.ports}
    assert expected <= exposed, f"the Service does not expose {expected - exposed}"


# --- RBAC ---------------------------------------------------------------------------------------


def request_info(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str, str | None]:
    """(API group, resource, verb, namespace) of an API request, as the API server's authorizer sees it."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        assert parts[0] == "apis", path
        group, rest = parts[1], parts[3:]
    watch = query.get("watch") in ("true", "1")
    if rest[:1] == ["watch"]:
        watch, rest = True, rest[1:]
    namespace = None
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource += "/" + rest[2]
    if method == "GET":
        verb = "watch" if watch else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}[method]
    return group, resource, verb, namespace


@contextlib.asynccontextmanager
async def recording_api_server(seen: list[tuple[str, str, str, str | None]], asked: asyncio.Event) -> Any:
    """An API server that answers every list with no items and ends every watch at once, and
    remembers what it was asked (``asked`` is set on each request)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        info = request_info(request.method, request.path, dict(request.query))
        seen.append(info)
        asked.set()
        if info[2] == "watch":
            return web.Response(status=200, content_type="application/json")
        if info[2] == "list":
            return web.json_response(
                {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "7"}, "items": []}
            )
        return web.json_response({"kind": "Status", "apiVersion": "v1", "code": 404}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_the_role_grants_exactly_what_the_discovery_code_asks_for(gateway_config: Config) -> None:
    """Runs the discovery the gateway starts (built as gateway/app.py builds it) against a recording
    API server: every (group, resource, verb) it uses must be granted, and nothing else."""
    k8s = gateway_config.discovery.kubernetes
    assert k8s is not None
    seen: list[tuple[str, str, str, str | None]] = []
    asked = asyncio.Event()
    async with recording_api_server(seen, asked) as url:
        discovery = KubernetesDiscovery(
            k8s.namespace, k8s.service, port_name=k8s.port_name, model_label=k8s.model_label,
            api_url=url, backoff_base_s=0.001, backoff_max_s=0.01,
        )
        task = asyncio.create_task(discovery.run(lambda pods: None))

        def settled() -> bool:  # every resource asked for has been watched at least twice since
            resources = {(g, r) for g, r, _, _ in seen}
            return bool(resources) and all(
                sum(1 for s in seen if s[:3] == (g, r, "watch")) >= 2 for g, r in resources
            )

        try:
            async with asyncio.timeout(5):
                while not settled():
                    asked.clear()
                    await asked.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    used = {(g, r, v) for g, r, v, _ in seen}
    assert {ns for *_, ns in seen} == {k8s.namespace}, "discovery reached outside its namespace"
    assert {r for _, r, _ in used} >= {"pods", "endpointslices"}

    roles = [role for role in shipped().of_kind(Role) if role.metadata.namespace == k8s.namespace]
    assert len(roles) == 1, f"expected one Role in {k8s.namespace}"
    granted = set()
    for rule in roles[0].rules:
        assert "*" not in [*rule.apiGroups, *rule.resources, *rule.verbs], "no wildcards"
        assert not rule.resourceNames, "lists and watches cannot be narrowed by name"
        granted |= {(g, r, v) for g in rule.apiGroups for r in rule.resources for v in rule.verbs}
    assert used <= granted, f"missing from the Role: {sorted(used - granted)}"
    assert granted <= used, f"granted but never used: {sorted(granted - used)}"


def test_the_role_is_bound_to_the_account_the_gateway_runs_as(gateway_config: Config) -> None:
    k8s = gateway_config.discovery.kubernetes
    m = shipped()
    deployment = m.gateway()
    spec = deployment.spec.template.spec
    account = m.one(ServiceAccount, spec.serviceAccountName, deployment.metadata.namespace)
    role = m.one(Role, "sluicegate-discovery", k8s.namespace)
    bindings = [
        b for b in m.of_kind(RoleBinding)
        if b.metadata.namespace == k8s.namespace and b.roleRef.kind == "Role"
        and b.roleRef.name == role.metadata.name
    ]
    assert len(bindings) == 1
    assert any(
        s.kind == "ServiceAccount" and s.name == account.metadata.name
        and s.namespace == account.metadata.namespace
        for s in bindings[0].subjects
    )
    # without a token the in-cluster client cannot authenticate at all
    automount = spec.automountServiceAccountToken
    if automount is None:
        automount = account.automountServiceAccountToken
    assert automount is not False


# --- the example model server -------------------------------------------------------------------


def test_the_example_vllm_pods_are_discovered_with_their_model_and_slice(gateway_config: Config) -> None:
    k8s = gateway_config.discovery.kubernetes
    m = shipped()
    service = m.one(Service, k8s.service, k8s.namespace)
    service_port = next(p for p in service.spec.ports if k8s.port_name in (None, p.name))
    backends = [
        d for d in m.of_kind(Deployment)
        if d.metadata.namespace == k8s.namespace
        and selects(service.spec.selector, d.spec.template.metadata.labels)
    ]
    assert backends, f"no Deployment behind Service {k8s.namespace}/{k8s.service}"
    for deployment in backends:
        template = deployment.spec.template
        vllm = template.spec.containers[0]
        # The EndpointSlice carries the target port; the gateway dials the pod there.
        port = port_number(template.spec, service_port.targetPort or service_port.port)
        assert port is not None and str(port) == flag(vllm.args, "--port")
        pod = Pod(
            metadata=ObjectMeta(
                name=f"{deployment.metadata.name}-0", namespace=deployment.metadata.namespace,
                labels=template.metadata.labels, annotations=template.metadata.annotations,
            ),
            spec=template.spec,
        )
        seen = describe_pod(pod, f"http://10.4.2.17:{port}", True, k8s.model_label)
        assert seen.models, "the gateway would find no model on this pod"
        assert flag(vllm.args, "--served-model-name") in seen.models
        slices = [r for r in (vllm.resources.limits or {}) if r.startswith(MIG_RESOURCE_PREFIX)]
        assert len(slices) == 1
        assert seen.mig_profile == slices[0].removeprefix(MIG_RESOURCE_PREFIX)
        MigIdentity(gpu_uuid="GPU-0", profile=seen.mig_profile)  # a profile the config model accepts
        assert seen.to_pod_config().url == f"http://10.4.2.17:{port}"


# --- the mig-agent ------------------------------------------------------------------------------


def test_the_mig_agent_runs_on_gpu_nodes_with_nvml_but_takes_no_gpu() -> None:
    spec = shipped().agent().spec.template.spec
    assert spec.nodeSelector == {"nvidia.com/gpu.present": "true"}
    assert any(t.key == "nvidia.com/gpu" and t.operator == "Exists" for t in spec.tolerations or [])
    assert spec.runtimeClassName == "nvidia"
    assert not (spec.hostNetwork or spec.hostPID or spec.hostIPC)
    for container in spec.containers:
        env = {e.name: e.value for e in container.env or []}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
        assert env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
        # the toolkit injects the MIG monitor device only with SYS_ADMIN in the bounding set
        assert container.securityContext.capabilities.add == ["SYS_ADMIN"]
        resources = container.resources
        for amount in (resources.limits or {}, resources.requests or {}):
            taken = [name for name in amount if name.startswith("nvidia.com/")]
            assert not taken, f"the agent would take {taken} away from the model servers"


def test_the_mig_agent_command_probes_and_port_match_the_agent() -> None:
    spec = shipped().agent().spec.template.spec
    container = spec.containers[0]
    args = build_parser().parse_args(argv(container)[1:])
    assert args.command == "mig-agent" and args.fake_nvml is None
    assert args.host in ("0.0.0.0", "::")
    assert port_number(spec, "http") == args.port
    routes = make_app(MigAgent(None, node="test")).router.routes()
    get_paths = {route.resource.canonical for route in routes if route.method == "GET"}
    for probe in (container.readinessProbe, container.livenessProbe):
        assert probe is not None and probe.httpGet.path in get_paths
        assert port_number(spec, probe.httpGet.port) == args.port
    assert "/v1/devices" in get_paths  # what the gateway fetches under each agent URL


def test_the_gateway_config_reaches_the_agents_and_only_the_gateway_may(gateway_config: Config) -> None:
    m = shipped()
    daemonset = m.agent()
    template = daemonset.spec.template
    assert gateway_config.health.devices.agent_urls
    for url in gateway_config.health.devices.agent_urls:
        parts = urlsplit(url)
        name, namespace = parts.hostname.split(".")[:2]
        service = m.one(Service, name, namespace)
        assert namespace == daemonset.metadata.namespace
        assert selects(service.spec.selector, template.metadata.labels)
        service_port = next(p for p in service.spec.ports if p.port == (parts.port or 80))
        assert port_number(template.spec, service_port.targetPort) is not None

    # POST /v1/clear is unauthenticated: a NetworkPolicy admits the gateway pods and nobody else.
    gateway = m.gateway()
    gateway_ns = m.one(Namespace, gateway.metadata.namespace)
    ns_labels = dict(gateway_ns.metadata.labels or {})
    ns_labels["kubernetes.io/metadata.name"] = gateway_ns.metadata.name  # set by the API server
    policies = [
        p for p in m.of_kind(NetworkPolicy)
        if p.metadata.namespace == daemonset.metadata.namespace
        and selects(p.spec.podSelector.matchLabels, template.metadata.labels)
    ]
    assert policies and all("Ingress" in p.spec.policyTypes for p in policies)
    admitted = [peer for p in policies for rule in p.spec.ingress or [] for peer in rule.from_ or []]
    assert admitted, "the policy admits nobody"
    for peer in admitted:
        assert peer.ipBlock is None
        assert selects(peer.namespaceSelector.matchLabels, ns_labels)
        assert selects(peer.podSelector.matchLabels, gateway.spec.template.metadata.labels)


# --- every workload -----------------------------------------------------------------------------


def pod_security_violations(spec: PodSpec, level: str) -> list[str]:
    """What the Pod Security admission would reject at ``level`` (the checks these pods can fail)."""
    if level == "privileged":
        return []
    found = []
    if spec.hostNetwork or spec.hostPID or spec.hostIPC:
        found.append("host namespaces")
    for volume in spec.volumes or []:
        kinds = {k for k, v in volume.to_dict().items() if k != "name" and v is not None}
        if "hostPath" in kinds:
            found.append(f"hostPath volume {volume.name}")
        if level == "restricted" and not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume.name} of type {kinds}")
    pod_sc = spec.securityContext
    for container in containers(spec):
        sc = container.securityContext
        added = set(sc.capabilities.add or []) if sc and sc.capabilities else set()
        if sc and sc.privileged:
            found.append(f"{container.name}: privileged")
        if any(port.hostPort for port in container.ports or []):
            found.append(f"{container.name}: hostPort")
        if added - BASELINE_CAPABILITIES:
            found.append(f"{container.name}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if level != "restricted":
            continue
        non_root = sc.runAsNonRoot if sc and sc.runAsNonRoot is not None else pod_sc and pod_sc.runAsNonRoot
        user = sc.runAsUser if sc and sc.runAsUser is not None else pod_sc and pod_sc.runAsUser
        seccomp = sc.seccompProfile if sc and sc.seccompProfile else pod_sc and pod_sc.seccompProfile
        if not non_root or user == 0:
            found.append(f"{container.name}: may run as root")
        if not seccomp or seccomp.type not in ("RuntimeDefault", "Localhost"):
            found.append(f"{container.name}: no seccomp profile")
        if not sc or sc.allowPrivilegeEscalation is not False:
            found.append(f"{container.name}: privilege escalation allowed")
        if not sc or not sc.capabilities or "ALL" not in (sc.capabilities.drop or []):
            found.append(f"{container.name}: capabilities not dropped")
        if added - {"NET_BIND_SERVICE"}:
            found.append(f"{container.name}: adds {sorted(added)}")
    return found


def test_every_pod_passes_its_namespaces_pod_security_level(manifests: Manifests) -> None:
    levels = {
        ns.metadata.name: (ns.metadata.labels or {}).get("pod-security.kubernetes.io/enforce", "privileged")
        for ns in manifests.of_kind(Namespace)
    }
    assert levels[manifests.gateway().metadata.namespace] == "restricted"
    for name, workload in manifests.workloads():
        level = levels[workload.metadata.namespace]
        problems = pod_security_violations(workload.spec.template.spec, level)
        assert not problems, f"{name} fails Pod Security '{level}': {problems}"


def test_security_contexts_are_tight_and_acceptable_to_the_api_server() -> None:
    m = shipped()
    for name, workload in m.workloads():
        spec = workload.spec.template.spec
        assert spec.securityContext.seccompProfile.type == "RuntimeDefault", name
        for container in containers(spec):
            sc = container.securityContext
            assert sc is not None and "ALL" in sc.capabilities.drop, f"{name}: capabilities kept"
            added = set(sc.capabilities.add or [])
            if sc.allowPrivilegeEscalation is False:
                # the API server's own validation rule
                assert not sc.privileged and not added & {"SYS_ADMIN", "CAP_SYS_ADMIN"}, name
    for container in [m.gateway_container(), *m.agent().spec.template.spec.containers]:
        assert container.securityContext.readOnlyRootFilesystem is True
        assert container.securityContext.privileged is not True
    assert m.agent().spec.template.spec.securityContext.runAsNonRoot is True


def test_every_container_has_requests_and_a_memory_limit() -> None:
    for name, workload in shipped().workloads():
        for container in containers(workload.spec.template.spec):
            resources = container.resources
            assert resources and resources.requests, f"{name}/{container.name}: no requests"
            assert {"cpu", "memory"} <= set(resources.requests), f"{name}/{container.name}"
            assert "memory" in (resources.limits or {}), f"{name}/{container.name}: no memory limit"


def test_selectors_services_probes_and_volumes_line_up(manifests: Manifests) -> None:
    workloads = [w for _, w in manifests.workloads()]
    for name, workload in manifests.workloads():
        template = workload.spec.template
        assert selects(workload.spec.selector.matchLabels, template.metadata.labels), name
        spec = template.spec
        volume_names = {v.name for v in spec.volumes or []}
        for container in containers(spec):
            for probe in (container.readinessProbe, container.livenessProbe, container.startupProbe):
                if probe is not None and probe.httpGet is not None:
                    assert port_number(spec, probe.httpGet.port) is not None, f"{name}: probe port"
            for mount in container.volumeMounts or []:
                assert mount.name in volume_names, f"{name}: no volume {mount.name}"
        for volume in spec.volumes or []:
            if volume.configMap is not None:
                manifests.one(ConfigMap, volume.configMap.name, workload.metadata.namespace)
        if spec.serviceAccountName:
            manifests.one(ServiceAccount, spec.serviceAccountName, workload.metadata.namespace)

    for service in manifests.of_kind(Service):
        backends = [
            w for w in workloads
            if w.metadata.namespace == service.metadata.namespace
            and selects(service.spec.selector, w.spec.template.metadata.labels)
        ]
        assert backends, f"Service {service.metadata.name} selects no workload"
        for port in service.spec.ports:
            for workload in backends:
                target = port.targetPort or port.port
                assert port_number(workload.spec.template.spec, target, port.protocol or "TCP"), (
                    f"Service {service.metadata.name} port {port.name}: {target} not declared"
                )

    for pdb in manifests.of_kind(PodDisruptionBudget):
        assert any(
            w.metadata.namespace == pdb.metadata.namespace
            and selects(pdb.spec.selector.matchLabels, w.spec.template.metadata.labels)
            for w in workloads
        ), f"PodDisruptionBudget {pdb.metadata.name} covers no workload"

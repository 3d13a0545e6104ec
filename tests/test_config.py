"""Config validation: good files load, bad ones give one clear paragraph and exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError
from gateway.config_load import load_config, parse_config, with_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_demo_config_loads_with_three_pods_on_distinct_mig_slices() -> None:
    config = load_config(ROOT / "config" / "demo.yaml")
    assert [p.name for p in config.pods] == ["pod-a", "pod-b", "pod-c"]
    slices = {p.mig.mig_uuid for p in config.pods}
    gpus = {p.mig.gpu_uuid for p in config.pods}
    assert len(slices) == 3 and len(gpus) == 1


def test_example_config_loads() -> None:
    config = load_config(ROOT / "config" / "example.yaml")
    assert config.pods


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"pods": [{"name": "a", "url": "ftp://x"}]}, "'pods.0.url'"),
        ({"pods": [{"name": "a", "url": "http://x:1/v1"}]}, "without a path"),
        ({"server": {"port": 70000}}, "'server.port'"),
        ({"server": {"prot": 1}}, "'server.prot': Extra inputs are not permitted"),
        ({"pods": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "used twice"),
        ({"pods": [{"name": "a", "url": "http://x", "mig": {"gpu_uuid": "nope"}}]}, "'pods.0.mig.gpu_uuid'"),
        ([1, 2], "must be a YAML mapping"),
    ],
)
def test_bad_config_names_the_field(data: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("test.yaml")


def test_flags_override_the_file_and_add_pods() -> None:
    base = parse_config({"pods": [{"name": "upstream-1", "url": "http://a:1"}]})
    config = with_overrides(base, port=9999, upstreams=["http://b:2/"])
    assert config.server.port == 9999
    assert [(p.name, p.url) for p in config.pods] == [
        ("upstream-1", "http://a:1"),
        ("upstream-1x", "http://b:2"),
    ]


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("pods: [{name: a, url: 'http://x:1'}\n", "is not valid YAML at line"),
        ("pods:\n  - name: a\n    url: http://x:1\n    models: 7\n", "'pods.0.models'"),
        ("timeouts: {connect_s: -1}\npods: [{name: a, url: 'http://x:1'}]\n", "'timeouts.connect_s'"),
        (
            "timeouts: {connect_s: 5, total_s: 1}\npods: [{name: a, url: 'http://x:1'}]\n",
            "timeouts.connect_s (5 s), timeouts.first_token_s (60 s), timeouts.stall_s (30 s) are "
            "longer than timeouts.total_s (1 s)",
        ),
        (
            "pods:\n  - {name: a, url: 'http://x:1', models: llama-8b}\n",
            "must be a list of model names, e.g. [llama-8b]",
        ),
        (
            "pods:\n  - {name: a, url: 'ftp://x:1'}\n  - {name: a, url: 'http://y:1'}\n",
            "http://10.0.0.5:8000; 'pods.1.name': pod name 'a' is used twice",  # with pods.0.url's problem
        ),
    ],
)
def test_cli_rejects_a_bad_file_without_a_traceback(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    result = _serve("--config", str(path))
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1  # one paragraph


def test_cli_missing_file_and_no_pods_are_clear(tmp_path: Path) -> None:
    missing = _serve("--config", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "cannot read config file" in missing.stderr
    empty = _serve()
    assert empty.returncode == 2 and "no pods are configured" in empty.stderr


def test_kubernetes_and_dns_discovery_are_not_combined() -> None:
    with pytest.raises(ConfigError, match="not both"):
        parse_config(
            {
                "discovery": {
                    "kubernetes": {"namespace": "llm", "service": "vllm"},
                    "dns": {"host": "vllm.llm.svc", "port": 8000},
                }
            }
        )


@pytest.mark.parametrize(
    ("timeouts", "tiers", "expected"),
    [
        (
            {"connect_s": 5, "total_s": 1, "first_token_s": 1, "stall_s": 1},
            {},
            "'timeouts': timeouts.connect_s (5 s) is longer than timeouts.total_s (1 s)",
        ),
        # a model's override merged over the defaults
        (
            {"models": {"llama-70b": {"first_token_s": 900}}},
            {},
            "timeouts.models.llama-70b.first_token_s (900 s) is longer than timeouts.total_s (600 s)",
        ),
        (
            {"models": {"qwen": {"total_s": 20}}},
            {},
            "timeouts.first_token_s (60 s), timeouts.stall_s (30 s) are longer than "
            "timeouts.models.qwen.total_s (20 s)",
        ),
        # a tier's override merged over the defaults, and over a model's
        (
            {},
            {"fast": {"timeouts": {"total_s": 10}}},
            "'tiers': timeouts.first_token_s (60 s), timeouts.stall_s (30 s) are longer than "
            "tiers.fast.timeouts.total_s (10 s)",
        ),
        (
            {"models": {"qwen": {"total_s": 20, "first_token_s": 10, "stall_s": 5}}},
            {"batch": {"timeouts": {"first_token_s": 300}}},
            "tiers.batch.timeouts.first_token_s (300 s) is longer than timeouts.models.qwen.total_s (20 s)",
        ),
    ],
)
def test_a_stage_longer_than_the_total_is_an_error_naming_both_keys(
    timeouts: dict, tiers: dict, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"timeouts": timeouts, "tiers": tiers}, "t.yaml")
    assert expected in str(info.value)
    assert str(info.value).count("no stage may outlast the whole request") == 1


def test_stages_within_every_merged_total_are_accepted() -> None:
    config = parse_config(
        {
            "timeouts": {"models": {"qwen": {"total_s": 60, "first_token_s": 30}}},
            "tiers": {"interactive": {"timeouts": {"total_s": 120, "stall_s": 10}}},
        }
    )
    assert config.timeouts.models["qwen"].total_s == 60


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"pods": [{"name": "a", "url": "http://x", "models": "llama-8b"}]},
         "'pods.0.models': must be a list of model names, e.g. [llama-8b]"),
        ({"tiers": {"gold": {"api_keys": "sk-1"}}},
         "'tiers.gold.api_keys': must be a list of API keys, e.g. [sk-1]"),
        ({"resume": {"models": "*"}}, "'resume.models': must be a list of model names, e.g. [*]"),
        ({"health": {"devices": {"dcgm_urls": "http://dcgm:9400/metrics"}}},
         "must be a list of dcgm-exporter /metrics URLs, e.g. [http://dcgm:9400/metrics]"),
        ({"pods": "pod-a"}, "'pods': must be a list of pods, e.g. [{name: pod-a, url:"),
    ],
)
def test_a_string_where_a_list_belongs_says_so(data: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "t.yaml")
    assert expected in str(info.value)
    assert "tuple" not in str(info.value)


def test_a_duplicate_pod_name_is_reported_with_the_other_problems() -> None:
    data = {
        "server": {"port": 70000},
        "pods": [
            {"name": "a", "url": "ftp://x"},
            {"name": "b", "url": "http://y", "models": "llama-8b"},
            {"name": "a", "url": "http://z"},
        ],
    }
    with pytest.raises(ConfigError) as info:
        parse_config(data, "t.yaml")
    message = str(info.value)
    assert message.startswith("t.yaml has 4 problems:")
    for part in (
        "'server.port'",
        "'pods.0.url'",
        "'pods.1.models': must be a list of model names",
        "'pods.2.name': pod name 'a' is used twice",
    ):
        assert part in message

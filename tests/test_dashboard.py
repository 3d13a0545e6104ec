"""The Grafana dashboard queries only what a real gateway exports.

A dashboard is code that nothing runs until someone needs it: a renamed metric or label leaves a
panel empty, silently, on the day of an incident. So a real gateway with a canary route and a
rollout serves a few streams, its ``/metrics`` is scraped, and every ``expr`` of
``config/grafana/sluicegate.json`` is taken apart: each metric name must be a series the scrape
has (histograms as ``_bucket``/``_sum``/``_count``, counters as ``_total``), and each label in a
matcher or a ``by (...)``/``without (...)`` clause must be a label of the metrics it applies to.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from loadtest.procs import GatewayProcess
from tests.canary import canary_config, canary_pods

DASHBOARD = Path(__file__).resolve().parent.parent / "config" / "grafana" / "sluicegate.json"

# PromQL words that look like names but are not metrics
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
    | {"offset", "inf", "nan"}
)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*,?')
_GROUPING = re.compile(r"\b(by|without)\s*\(([^)]*)\)\s*\(")
_VECTOR_MATCHING = re.compile(r"\b(?:on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SUFFIX_GROUPING = re.compile(r"\)\s*(by|without)\s*\(")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)")

Series = dict[str, set[str]]  # a queryable series name -> its label names


def exported(text: str) -> Series:
    """The series names a scrape offers, with their labels.

    A family with no samples yet (a labelled counter nothing has incremented) still has its
    ``# TYPE`` line; its labels then come from the gateway's own declaration of it.
    """
    declared = _declared_labels()
    series: Series = {}
    for family in text_string_to_metric_families(text):
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(
            family.type, ("",)
        )
        for suffix in suffixes:
            name = family.name + suffix
            labels = {k for s in family.samples if s.name == name for k in s.labels}
            if not any(s.name == name for s in family.samples):
                labels = set(declared.get(family.name, ())) | ({"le"} if suffix == "_bucket" else set())
            series[name] = labels
    return series


def _declared_labels() -> dict[str, tuple[str, ...]]:
    registry = GatewayMetrics().registry  # every series it declares (compiled, it has no __dict__)
    return {
        m._name: tuple(m._labelnames)
        for m in registry._collector_to_names
        if isinstance(m, Counter | Gauge | Histogram)
    }


def uses(expr: str) -> tuple[dict[str, set[str]], list[tuple[set[str], set[str]]]]:
    """What one PromQL expression reads: ``{metric: labels matched on it}``, and for each
    ``by``/``without`` clause the labels it names with the metrics inside its aggregation."""
    assert not _SUFFIX_GROUPING.search(expr), f"write 'sum by (...) (x)', not 'sum(x) by (...)': {expr}"
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # range selectors: [$__rate_interval], [5m]
    groupings: list[tuple[set[str], set[str]]] = []
    for match in _GROUPING.finditer(expr):
        labels = {label.strip() for label in match.group(2).split(",") if label.strip()}
        groupings.append((labels, _metric_names(expr[match.end() - 1 : _close(expr, match.end() - 1)])))
    matched: dict[str, set[str]] = {}
    for match in _SELECTOR.finditer(expr):
        body = match.group(2)
        labels = set(_MATCHER.findall(body))
        assert _MATCHER.sub("", body).strip() == "", f"unparsed matcher {body!r} in {expr}"
        if match.group(1):
            matched.setdefault(match.group(1), set()).update(labels)
    for name in _metric_names(expr):
        matched.setdefault(name, set())
    return matched, groupings


def _close(expr: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return i + 1
    raise AssertionError(f"unbalanced parentheses in {expr}")


def _metric_names(expr: str) -> set[str]:
    """The metric names in ``expr``: what is left once matchers, clauses, functions and strings go."""
    expr = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", expr)
    expr = _GROUPING.sub("(", expr)
    expr = _VECTOR_MATCHING.sub(" ", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings: label values, label_replace arguments
    expr = re.sub(r"\$\{?\w+\}?", " ", expr)  # Grafana variables
    names = set()
    for match in _NAME.finditer(expr):
        name, rest = match.group(), expr[match.end() :].lstrip()
        before = expr[match.start() - 1] if match.start() else " "
        if rest.startswith("(") or name.lower() in _KEYWORDS or before.isdigit() or before == ".":
            continue  # a function, a keyword, or the exponent of a number such as 1e3
        names.add(name)
    return names


def problems(dashboard: dict[str, Any], series: Series) -> list[str]:
    """Every metric or label the dashboard queries that the scrape does not have."""
    found: list[str] = []
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", []) if t.get("expr")]
    assert exprs, "the dashboard has no queries"
    for expr in exprs:
        matched, groupings = uses(expr)
        assert matched, f"no metric found in {expr}"
        for name, labels in matched.items():
            if name not in series:
                found.append(f"{name} is not exported (in {expr})")
            elif labels - series[name]:
                found.append(f"{name} has no label {sorted(labels - series[name])} (in {expr})")
        for labels, names in groupings:
            for name in names & series.keys():
                if labels - series[name]:
                    found.append(
                        f"{name} has no label {sorted(labels - series[name])} to group by (in {expr})"
                    )
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        for name, label in _LABEL_VALUES.findall(text):
            if label not in series.get(name, ()):
                found.append(f"variable {variable['name']}: {name} has no label {label}")
    return found


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def test_the_dashboard_queries_only_series_a_real_gateway_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert any(
        v["type"] == "datasource" and v["query"] == "prometheus" for v in dashboard["templating"]["list"]
    )
    with canary_pods() as (stable, new):
        plan = {"steps": [50, 100], "min_hold_s": 3600, "min_samples": 10**6}
        config = canary_config(stable.url, new.url, plan)
        with GatewayProcess(config) as gw:
            pods = set()
            for user in range(12):
                body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                        "max_tokens": 6, "user": f"user-{user}",
                        "stream_options": {"include_usage": True}}  # fmt: skip
                resp = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30)
                assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
                pods.add(resp.headers["x-sluicegate-pod"])
            text = httpx.get(gw.admin_url + "/metrics", timeout=10).text
    assert pods == {"stable-1", "canary-1"}  # both variants served, so both have samples

    series = exported(text)
    assert problems(dashboard, series) == []

    # the new series have samples from both variants, not only a declaration; the pods decode a
    # token every 2 ms, so the inter-token latency is a few milliseconds
    samples = {
        (x.name, x.labels.get("variant"), x.labels.get("kind")): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }
    for variant in ("stable", "canary"):
        itl_sum = samples[("sluicegate_time_per_output_token_seconds_sum", variant, None)]
        itl_count = samples[("sluicegate_time_per_output_token_seconds_count", variant, None)]
        assert itl_count >= 1 and 0.001 <= itl_sum / itl_count <= 0.05
        assert samples[("sluicegate_tokens_by_variant_total", variant, "completion")] == 6 * itl_count

    # and the check itself catches a misspelt metric, a misspelt label and an unknown grouping label
    broken = json.loads(
        DASHBOARD.read_text()
        .replace("sluicegate_pod_kv_cache_usage", "sluicegate_pod_kv_cache_usag")
        .replace("sum by (variant, status)", "sum by (varient, status)")
        .replace("sluicegate_shed_total{model=~", "sluicegate_shed_total{modle=~")
    )
    found = "\n".join(problems(broken, series))
    assert "sluicegate_pod_kv_cache_usag is not exported" in found
    assert "no label ['varient'] to group by" in found
    assert "sluicegate_shed_total has no label ['modle']" in found


def test_the_expression_parser() -> None:
    matched, groupings = uses(
        'histogram_quantile(0.99, sum by (variant, le) (rate(a_seconds_bucket{model=~"$model", x!="y"}[5m])))'
        " / on (model) group_left b_total * 1e3 > 0.5"
    )
    assert matched == {"a_seconds_bucket": {"model", "x"}, "b_total": set()}
    assert groupings == [({"variant", "le"}, {"a_seconds_bucket"})]

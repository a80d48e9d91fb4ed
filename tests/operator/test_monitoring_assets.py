"""manifests/monitoring: the Grafana dashboard and the PrometheusRule use only metric names and
labels that the runtime server and the gateway really export.

The exported names are read from the real registries, built in-process (`ServerMetrics` with
an engine snapshot, `GatewayMetrics` with a pool of one replica and an activator), so renaming a
metric or a label in the code fails here until the dashboard and the alerts follow. PromQL is
checked by a small tokenizer (metric selectors, their label matchers, `by`/`on` label lists);
where `promtool` is installed (Debian's `prometheus` package) it also checks the syntax of every
expression and runs unit tests of the alerts.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from argosy_operator.constants import RUNTIME_CONTAINER, RUNTIME_PORT_NAME
from argosy_runtime.gateway.activation import Activator
from argosy_runtime.gateway.backends.pool import ReplicaPool
from argosy_runtime.gateway.config import ActivationConfig
from argosy_runtime.gateway.metrics import GatewayMetrics
from argosy_runtime.outputs import EngineStats
from argosy_runtime.server.metrics import _ROUTES, ServerMetrics
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "manifests" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "prometheus-rules.yaml"
PODMONITOR = MONITORING / "gateway-podmonitor.yaml"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

# Labels the Prometheus Operator puts on every series scraped through a ServiceMonitor or a
# PodMonitor (from the target's pod, Service and port), next to the metric's own.
TARGET_LABELS = frozenset({"namespace", "pod", "service", "job", "instance", "container",
                           "endpoint"})
# Series Prometheus makes itself for each target.
SYNTHETIC = {"up": frozenset()}


# --- the names really exported ---------------------------------------------------------------

def _instantiate_children(obj: object) -> None:
    """A labelled counter or histogram exports no sample (so no label names) until a child
    exists: make one for every labelled metric the object holds."""
    for metric in vars(obj).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames \
                and not metric._labelvalues:
            metric.labels(*("x",) * len(metric._labelnames))


def _sample_labels(registry: CollectorRegistry) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in out.items()}


@cache
def server_samples() -> dict[str, frozenset[str]]:
    metrics = ServerMetrics("m")
    metrics.attach_engine(EngineStats, lambda: 0, {"block_size": "16"}, lambda: ["sql"])
    _instantiate_children(metrics)
    return _sample_labels(metrics.registry)


@cache
def gateway_samples() -> dict[str, frozenset[str]]:
    pool = ReplicaPool("m", ["http://10.0.0.1:8000"])
    metrics = GatewayMetrics(lambda: [pool], lambda: [Activator(pool, ActivationConfig())])
    _instantiate_children(metrics)
    return _sample_labels(metrics.registry)


@cache
def exported() -> dict[str, frozenset[str]]:
    out = {**server_samples(), **gateway_samples(), **SYNTHETIC}
    return {name: labels | TARGET_LABELS for name, labels in out.items()}


def test_the_registries_export_the_public_names() -> None:
    """The reading above works: DESIGN.md's names, with histogram and counter suffixes."""
    names = exported()
    for name in ("argosy:kv_cache_usage_perc", "argosy:num_requests_waiting",
                 "argosy:prompt_tokens_total", "argosy:time_to_first_token_seconds_bucket",
                 "argosy:http_requests_total", "argosy:lora_adapter_loaded",
                 "argosy:gateway_requests_total", "argosy:gateway_backend_healthy",
                 "argosy:gateway_requests_held", "argosy:gateway_tenant_rate_limited_total"):
        assert name in names, name
    assert "le" in names["argosy:time_to_first_token_seconds_bucket"]
    assert {"model_name", "path", "status"} <= names["argosy:http_requests_total"]
    assert {"model", "backend", "code"} <= names["argosy:gateway_requests_total"]


# --- a small PromQL reader -------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<dur>\d+(?:ms|[smhdwy])\b)
  | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],])
  | (?P<ws>\s+)
""", re.X)
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "count_values", "group"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
FUNCTIONS = {"rate", "irate", "increase", "delta", "histogram_quantile", "max_over_time",
             "min_over_time", "avg_over_time", "sum_over_time", "abs", "clamp_min", "clamp_max",
             "vector", "scalar", "absent", "label_values"}
# Grafana's interval variables, replaced by what they resolve to before reading.
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def tokens(expr: str) -> list[tuple[str, str]]:
    for var, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(var, value)
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot read PromQL at {expr[pos:pos + 30]!r} in {expr!r}"
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _closing(toks: list[tuple[str, str]], i: int) -> int:
    """Index of the bracket closing the one at i."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    depth, opening = 0, toks[i][1]
    for j in range(i, len(toks)):
        if toks[j][1] == opening:
            depth += 1
        elif toks[j][1] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return j
    raise AssertionError(f"unbalanced {opening}")


class Query:
    """What one PromQL expression uses: selectors (metric, {label: (op, value)}) and the
    label lists of its `by`/`on`/... clauses, each with the metrics it applies to."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.selectors: list[tuple[str, dict[str, tuple[str, str]]]] = []
        self.groupings: list[tuple[str, list[str], set[str]]] = []  # (keyword, labels, scope)
        toks = tokens(expr)
        i = 0
        while i < len(toks):
            kind, text = toks[i]
            nxt = toks[i + 1][1] if i + 1 < len(toks) else None
            if kind == "ident" and text in GROUPING:
                assert nxt == "(", f"{text} without a label list in {expr!r}"
                end = _closing(toks, i + 1)
                labels = [t for k, t in toks[i + 2:end] if k == "ident"]
                self.groupings.append((text, labels, self._scope(toks, i, end)))
                i = end + 1
            elif kind == "ident" and (text in AGGREGATIONS or text in FUNCTIONS) \
                    and nxt in ("(", "by", "without"):
                i += 1
            elif kind == "ident" and text in KEYWORDS:
                i += 1
            elif kind == "ident":
                assert nxt != "(", f"unknown function {text} in {expr!r}"
                matchers: dict[str, tuple[str, str]] = {}
                if nxt == "{":
                    end = _closing(toks, i + 1)
                    inner = [t for _, t in toks[i + 2:end] if t != ","]
                    assert len(inner) % 3 == 0, f"bad matchers after {text} in {expr!r}"
                    for j in range(0, len(inner), 3):
                        label, op, value = inner[j:j + 3]
                        assert op in ("=", "!=", "=~", "!~"), f"{op} in {expr!r}"
                        matchers[label] = (op, value[1:-1])
                    i = end
                self.selectors.append((text, matchers))
                i += 1
            elif text == "[":
                i = _closing(toks, i) + 1  # a range or subquery duration
            else:
                i += 1

    def _scope(self, toks: list[tuple[str, str]], start: int, end: int) -> set[str]:
        """The metrics a grouping clause applies to: the aggregation's argument (`sum by (x)
        (arg)` or `sum (arg) by (x)`), else (on/ignoring) the whole expression."""
        keyword = toks[start][1]
        if keyword in ("by", "without"):
            if end + 1 < len(toks) and toks[end + 1][1] == "(":
                span = toks[end + 1:_closing(toks, end + 1) + 1]
            else:  # postfix form: the argument list just before
                close = start - 1
                depth, j = 0, close
                while j >= 0:
                    depth += {")": 1, "(": -1}.get(toks[j][1], 0)
                    if depth == 0:
                        break
                    j -= 1
                span = toks[j:close + 1]
        else:
            span = toks
        return {t for k, t in span if k == "ident" and t not in AGGREGATIONS | FUNCTIONS
                | GROUPING | KEYWORDS}

    def problems(self) -> Iterator[str]:
        names = exported()
        metrics_seen: set[str] = set()
        for metric, matchers in self.selectors:
            if metric not in names:
                yield f"unknown metric {metric}"
                continue
            metrics_seen.add(metric)
            for label in matchers:
                if label not in names[metric]:
                    yield f"{metric} has no label {label}"
            path = matchers.get("path")
            if path is not None and path[0] == "=~":
                if not any(re.fullmatch(path[1], route) for route in _ROUTES):
                    yield f"path=~{path[1]!r} matches no route the server labels"
        for keyword, labels, scope in self.groupings:
            known = set().union(*(names[m] for m in scope if m in names)) if scope else set()
            for label in labels:
                if label not in known:
                    yield f"{keyword} ({label}): no metric of its argument has that label"
        if not self.selectors:
            yield "no metric"


def check(expr: str, where: str) -> list[str]:
    return [f"{where}: {p}: {expr}" for p in Query(expr).problems()]


def test_the_promql_reader_catches_renames() -> None:
    """The reader fails on what a rename leaves behind, and on nothing else."""
    good = ('histogram_quantile(0.9, sum by (le, model_name) '
            '(rate(argosy:time_to_first_token_seconds_bucket{namespace=~"$namespace"}'
            '[$__rate_interval])))')
    assert check(good, "t") == []
    assert check("sum(argosy:kv_cache_usage_percent)", "t")  # a renamed metric
    assert check('argosy:kv_cache_usage_perc{model="m"}', "t")  # a label it lacks
    assert check("sum by (lora_name) (argosy:num_requests_running)", "t")  # group by: lacks it
    assert check('sum(rate(argosy:http_requests_total{path=~"/v9/.+"}[5m]))', "t")
    assert check("max(argosy:kv_cache_usage_perc) by (pod)", "t") == []  # postfix form
    q = Query('up{container="runtime"} == 0 and on (namespace, pod) '
              'max_over_time(up{container="runtime"}[1h]) == 1')
    assert [m for m, _ in q.selectors] == ["up", "up"]
    assert list(q.problems()) == []


# --- the dashboard ---------------------------------------------------------------------------

@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target."""
    return [(f"panel {p['title']!r} {t['refId']}", t["expr"])
            for p in panels() for t in p.get("targets", [])]


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] == "argosy-overview" and d["title"]
    assert 36 <= d["schemaVersion"] <= 41
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "model_name", "pod"} <= set(variables)
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels():
        assert panel["title"], panel
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, \
            panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
    # Panels do not overlap (Grafana would move them around on load).
    cells: set[tuple[int, int]] = set()
    for panel in panels():
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
    # Well under the 256 KiB that `kubectl apply` (client-side) allows its annotation.
    assert DASHBOARD.stat().st_size < 200_000


def test_dashboard_shows_what_an_sre_watches() -> None:
    used = {m for _, expr in dashboard_queries() for m, _ in Query(expr).selectors}
    for name in ("argosy:http_requests_total", "argosy:time_to_first_token_seconds_bucket",
                 "argosy:inter_token_latency_seconds_bucket",
                 "argosy:e2e_request_latency_seconds_bucket", "argosy:generation_tokens_total",
                 "argosy:num_requests_running", "argosy:num_requests_waiting",
                 "argosy:kv_cache_usage_perc", "argosy:prefix_cache_hits_total",
                 "argosy:prefix_cache_queries_total", "argosy:num_preemptions_total",
                 "argosy:batch_requests_pending", "argosy:lora_adapter_loaded",
                 "argosy:lora_adapter_loads_total", "argosy:gateway_config_refused",
                 "argosy:gateway_requests_total", "argosy:gateway_retries_total",
                 "argosy:gateway_tenant_requests_total",
                 "argosy:gateway_tenant_rate_limited_total", "argosy:gateway_requests_held"):
        assert name in used, f"no panel shows {name}"
    quantile_panels = [expr for _, expr in dashboard_queries() if "histogram_quantile" in expr]
    for q in ("0.5", "0.9", "0.99"):
        assert any(e.startswith(f"histogram_quantile({q},") for e in quantile_panels)


def test_every_dashboard_query_uses_exported_metrics_and_labels() -> None:
    problems = [p for where, expr in dashboard_queries() for p in check(expr, where)]
    assert problems == []


_LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\)\s*$")


def test_template_variables_read_exported_labels() -> None:
    problems = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        assert m, f"variable {var['name']}: {query}"
        selector, label = m.groups()
        problems += check(selector, f"variable {var['name']}")
        (metric, _), = Query(selector).selectors
        if label not in exported().get(metric, ()):
            problems.append(f"variable {var['name']}: {metric} has no label {label}")
    assert problems == []


def test_runtime_panels_filter_by_the_template_variables() -> None:
    for where, expr in dashboard_queries():
        for metric, matchers in Query(expr).selectors:
            if metric in server_samples():
                assert {"namespace", "model_name", "pod"} <= set(matchers), (where, metric)


# --- the alerts ------------------------------------------------------------------------------

@cache
def rule_object() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def rules() -> list[dict[str, Any]]:
    return [r for g in rule_object()["spec"]["groups"] for r in g["rules"]]


def _output_labels(expr: str) -> set[str]:
    """Labels an alert carries: its aggregations' `by` labels, else its first metric's."""
    q = Query(expr)
    by = [set(labels) - {"le"} for kw, labels, _ in q.groupings if kw == "by"]
    if by:
        return set.intersection(*by)
    return set(exported()[q.selectors[0][0]])


def test_prometheus_rule_structure() -> None:
    obj = rule_object()
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["kind"] == "PrometheusRule"
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names))
    assert {"ArgosyReplicaDown", "ArgosyKVCacheNearlyFull", "ArgosyRequestsWaiting",
            "ArgosyHighErrorRate", "ArgosyTimeToFirstTokenHigh",
            "ArgosyGatewayNoBackendInRotation"} <= set(names)
    for rule in rules():
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        # Every label an annotation prints is on the alert, and it names where to look.
        carried = _output_labels(rule["expr"])
        text = " ".join(rule["annotations"].values())
        used = set(re.findall(r"\$labels\.(\w+)", text))
        assert used <= carried, (rule["alert"], used - carried)
        # Where to look: a model, or the one gateway pod whose config is at fault.
        assert used & {"model_name", "model", "job", "pod"}, f"{rule['alert']} names no model"
        if "model_name" in carried:
            assert {"model_name", "pod"} <= used, rule["alert"]


def test_every_rule_uses_exported_metrics_and_labels() -> None:
    problems = [p for r in rules() for p in check(r["expr"], r["alert"])]
    assert problems == []


def test_replica_down_watches_the_operators_runtime_container() -> None:
    (rule,) = [r for r in rules() if r["alert"] == "ArgosyReplicaDown"]
    for metric, matchers in Query(rule["expr"]).selectors:
        assert metric == "up"
        assert matchers["container"] == ("=", RUNTIME_CONTAINER)
        assert matchers["endpoint"] == ("=", RUNTIME_PORT_NAME)


def test_gateway_podmonitor_selects_the_documented_gateway() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    fence = re.compile(r"```yaml\n(.*?)```", re.S)
    docs = [d for body in fence.findall(DEPLOY_DOC.read_text()) for d in yaml.safe_load_all(body)
            if isinstance(d, dict)]
    (deployment,) = [d for d in docs if d.get("kind") == "Deployment"
                     and d["metadata"]["name"] == "argosy-gateway"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


# --- the kustomization -----------------------------------------------------------------------

def test_kustomization_ships_the_dashboard_the_rules_and_the_podmonitor() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (needed for `kubectl kustomize`)")
    out = subprocess.run([kubectl, "kustomize", str(MONITORING)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    objects = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert set(objects) == {("ConfigMap", "argosy-grafana-dashboard"),
                            ("PrometheusRule", "argosy"), ("PodMonitor", "argosy-gateway")}
    config_map = objects["ConfigMap", "argosy-grafana-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's label
    (content,) = config_map["data"].values()
    assert json.loads(content) == dashboard()
    assert objects["PrometheusRule", "argosy"]["spec"] == rule_object()["spec"]
    # Optional: the operator's install does not pull it in.
    operator = yaml.safe_load((REPO / "manifests" / "operator" / "kustomization.yaml")
                              .read_text())
    assert not any("monitoring" in r for r in operator.get("resources", []))


# --- promtool, where installed ---------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(apt-get install prometheus)")


def _promtool(*args: str, cwd: Path) -> None:
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_checks_the_rules_and_every_dashboard_query(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_object()["spec"]))
    recorded = [{"record": f"argosy:dashboard_query_{i}",
                 "expr": tokens_text(expr)} for i, (_, expr) in enumerate(dashboard_queries())]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "dashboard", "rules": recorded}]}))
    _promtool("check", "rules", "rules.yaml", "dashboard.yaml", cwd=tmp_path)


def tokens_text(expr: str) -> str:
    """A dashboard query as Prometheus sees it: Grafana's variables resolved."""
    for var, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


@needs_promtool
def test_promtool_unit_tests_of_the_alerts(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_object()["spec"]))
    shutil.copy(Path(__file__).with_name("monitoring_rules_test.yaml"), tmp_path / "test.yaml")
    _promtool("test", "rules", "test.yaml", cwd=tmp_path)

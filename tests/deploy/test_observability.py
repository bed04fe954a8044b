"""deploy/'s observability, run: the PrometheusRule through Prometheus' own tools, and a real Prometheus
scraping a running `pdserve up` the way the ServiceMonitor describes.

- `promtool check rules` on the rendered PrometheusRule's spec.groups;
- `promtool test rules`: for each alert, input series that make it fire (with its labels and rendered
  summary) and series that must leave it silent (below the threshold, not yet for long enough, another
  role, 4xx instead of 5xx, no data);
- a Prometheus server (Debian's 2.42, on 127.0.0.1, its own config and a temporary TSDB) scraping
  `pdserve up` (the real model, one prefill and one decode runtime) with the scrape job the Prometheus
  Operator would generate from the ServiceMonitor: its selector, port, path, scheme, credentials (none:
  /metrics is open) and relabelings, over targets that carry the meta labels Kubernetes service discovery
  would give them (the rendered Services' labels, namespace, pod); only the interval is shortened. Every
  target must be up, every pdserve_/paramstore_ metric an alert or a dashboard panel names must exist
  after a little traffic (with the relabelled `role` and `namespace` the queries select on), every panel
  query must evaluate, the rules must evaluate without error, and vLLM's names must be there, equal to ours.

Needs the Debian package `prometheus` (server + promtool; .ci/run installs it): without it these tests
skip locally and fail in CI (tests/required.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from compute.node.launcher import Services
from tests.deploy.manifests import DEPLOY, metric_names, objects
from tests.deploy.prometheus import Prometheus, binary, discovered, scrape_job
from tests.procs import children, kill_left
from tests.services import TOKEN, admin_headers, wait_for

NAMESPACE = "pdserve"  # both overlays' namespace
SCRAPE_S = 1  # the ServiceMonitor's 15 s interval, shortened for the test (nothing else is changed)
OURS = re.compile(r"^(pdserve|paramstore)_")


def rule_groups() -> list[dict]:
    (rule,) = objects("production", "PrometheusRule").values()
    (local,) = objects("local", "PrometheusRule").values()
    assert local["spec"] == rule["spec"]  # one set of alerts for both overlays
    return rule["spec"]["groups"]


def alerts() -> dict[str, dict]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"]}


def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "pdserve-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    return path


def test_the_prometheus_rule_passes_promtool_check(tmp_path):
    out = subprocess.run([binary("promtool"), "check", "rules", str(rules_file(tmp_path))], check=False,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout, out.stdout


# --- promtool test rules: each alert fires, and stays silent --------------------------------------------
def _shard_buckets(seconds: float, per_min: int) -> dict[str, str]:
    """paramstore_shard_load_seconds_bucket series for `per_min` loads a minute, each taking `seconds`."""
    from paramstore.metrics import SHARD_LOAD_SECONDS

    les = [s.labels["le"] for s in next(iter(SHARD_LOAD_SECONDS.collect())).samples if s.name.endswith("_bucket")]
    return {f'paramstore_shard_load_seconds_bucket{{namespace="{NAMESPACE}",role="decode",le="{le}"}}':
            f"0+{per_min if float(le) >= seconds else 0}x40" for le in les}  # fmt: skip


def _kv(role: str, used: int, minutes: int) -> dict[str, str]:
    """Two `role` nodes, each `used` of 100 KV blocks, for `minutes`."""
    out = {}
    for pod in ("a", "b"):
        sel = f'namespace="{NAMESPACE}",role="{role}",pod="pdserve-{role}-{pod}",model="smollm2"'
        out[f"pdserve_node_kv_blocks_used{{{sel}}}"] = f"{used}x{minutes}"
        out[f"pdserve_node_kv_blocks_total{{{sel}}}"] = f"100x{minutes}"
    return out


def _cache(hits_per_min: int, misses_per_min: int) -> dict[str, str]:
    sel = f'namespace="{NAMESPACE}",role="prefill"'
    return {f'paramstore_cache_hits_total{{{sel},tier="disk"}}': f"0+{hits_per_min}x40",
            f'paramstore_cache_hits_total{{{sel},tier="memory"}}': "0x40",  # at zero, as a node exports it
            f"paramstore_cache_misses_total{{{sel}}}": f"0+{misses_per_min}x40"}  # fmt: skip


def _requests(**per_status: int) -> dict[str, str]:
    return {f'pdserve_gateway_requests_total{{namespace="{NAMESPACE}",role="gateway",status="{s[1:]}"}}':
            f"0+{n}x20" for s, n in per_status.items()}  # fmt: skip


# alert -> [(what, input series, eval time, the summary it fires with, or None: silent)]
SCENARIOS = {
    "PdserveDecodeLoadHigh": [
        ("decode KV at 90% for 10 min", _kv("decode", 90, 10), "10m", "decode KV load 90% for 5m"),
        ("decode KV at 90% for 4 min: pending", _kv("decode", 90, 4), "4m", None),
        ("decode KV at 70%", _kv("decode", 70, 10), "10m", None),
        ("prefill KV at 95%: not decode", _kv("prefill", 95, 10), "10m", None),
    ],
    "PdserveShardLoadSlow": [
        ("shard loads of 400 ms", _shard_buckets(0.4, 10), "20m", "parameter-store shard load P99 497ms (> 200 ms)"),
        ("shard loads of 40 ms", _shard_buckets(0.04, 10), "20m", None),
        ("no shard loads (NaN)", _shard_buckets(0.4, 0), "20m", None),
    ],
    "PdserveShardCacheHitRatioLow": [
        ("9 hits a miss", _cache(9, 1), "30m", "shard cache hit ratio 90% (< 95%)"),
        ("a cache that never hits", _cache(0, 5), "30m", "shard cache hit ratio 0% (< 95%)"),
        ("99 hits a miss", _cache(99, 1), "30m", None),
    ],
    "PdserveGatewayErrorRate": [
        ("2% 503s", _requests(s200=98, s503=2), "10m", "gateway 5xx rate 2% (> 1%)"),
        ("0.5% 500s", _requests(s200=199, s500=1), "10m", None),
        ("half 429s: overload is not an error", _requests(s200=50, s429=50), "10m", None),
    ],
}


def test_each_alert_fires_and_stays_silent_under_promtool(tmp_path):
    """One promtool unit-test group per scenario; a firing one carries its severity, the namespace it sums
    by and its annotations rendered (the summary's template with the value)."""
    rules = alerts()
    assert set(SCENARIOS) == set(rules)
    for name, cases in SCENARIOS.items():  # each alert both fires and stays silent here
        assert {c[3] is None for c in cases} == {True, False}, name
    groups = []
    for name, cases in SCENARIOS.items():
        rule = rules[name]
        for what, series, at, summary in cases:
            fired = [] if summary is None else [{
                "exp_labels": {"severity": rule["labels"]["severity"], "namespace": NAMESPACE},
                "exp_annotations": {"summary": summary, "description": rule["annotations"]["description"]},
            }]  # fmt: skip
            groups.append({"name": f"{name}: {what}", "interval": "1m",
                           "input_series": [{"series": s, "values": v} for s, v in series.items()],
                           "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": fired}]})  # fmt: skip
    rules_path = rules_file(tmp_path)
    test_path = tmp_path / "pdserve-rules.test.yaml"
    test_path.write_text(yaml.safe_dump({"rule_files": [rules_path.name], "evaluation_interval": "1m",
                                         "tests": groups}, sort_keys=False))  # fmt: skip
    out = subprocess.run([binary("promtool"), "test", "rules", test_path.name], check=False, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


class Up:
    """`pdserve up --prefill 1 --decode 1` (the split, as on Kubernetes) with the real model, no standby runtimes
    (a fixed target set)."""

    def __init__(self, tmp: Path, store: list[str], model: str):
        (tmp / "logs").mkdir()
        (tmp / "pdserve.toml").write_text("[autoscaler]\npool_size = 0\n")
        self.model, self.seen = model, {}
        self.proc = Services(store, model, str(tmp), TOKEN).start(
            "up", ["up", "--prefill", "1", "--decode", "1", "--log-dir", str(tmp / "logs"), "--config",
                   str(tmp / "pdserve.toml")])  # fmt: skip
        self.url = self.proc.url

    def runtimes(self) -> list[dict]:
        self.seen.update(children(self.proc.p.pid))
        st = httpx.get(self.url + "/admin/status", headers=admin_headers(self.url), timeout=10).json()
        return st["supervisor"]["pool"]["runtimes"]

    def placed(self) -> list[dict] | None:
        rts = self.runtimes()
        held = {rt["role"] for rt in rts if rt["models"].get(self.model) == "ready"}
        return rts if held == {"prefill", "decode"} and len(rts) == 2 else None

    def close(self) -> None:
        try:
            self.proc.stop()
        finally:
            kill_left(self.seen)


@pytest.fixture(scope="module")
def up(tmp_path_factory, real_model_store):
    binary("prometheus")  # before starting anything to scrape
    locations, name = real_model_store
    u = Up(tmp_path_factory.mktemp("up-observed"), list(locations), name)
    try:
        u.proc.wait_ready(timeout=300)
        wait_for(u.placed, 240, "the model ready on the prefill and the decode runtime", every=0.5)
        yield u
    finally:
        u.close()


@pytest.fixture(scope="module")
def prom(up, tmp_path_factory):
    """Prometheus scraping `up` through the ServiceMonitor's job, with the PrometheusRule's groups loaded."""
    tmp = tmp_path_factory.mktemp("prometheus")
    services = objects("local", "Service")
    (sm,) = objects("local", "ServiceMonitor").values()
    targets = discovered(services["pdserve-gateway"], up.url.removeprefix("http://"), "pdserve-gateway-0")
    for i, rt in enumerate(up.placed()):
        targets += discovered(services[f"pdserve-{rt['role']}"], rt["url"].removeprefix("http://"),
                              f"pdserve-{rt['role']}-{i}")  # fmt: skip
    job = scrape_job(sm, targets, SCRAPE_S, {("pdserve-secrets", "internal-token"): TOKEN}, tmp)  # the pods' Secret
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
              "rule_files": [str(rules_file(tmp))], "scrape_configs": [job]}  # fmt: skip
    p = Prometheus(tmp / "server", config)
    try:
        yield p.wait_ready()
    finally:
        p.stop()


def traffic(up: Up, n: int = 3) -> None:
    """A little of it: chat completions, streamed and not, through the gateway."""
    body = {"model": up.model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    for i in range(n):
        r = httpx.post(up.url + "/v1/chat/completions", json=body | {"stream": i % 2 == 1}, timeout=120)
        assert r.status_code == 200, r.text


def panel_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "pdserve.json").read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:  # label_values(METRIC, LABEL): the namespace picker
        if m := re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", str(var.get("definition", ""))):
            out.append((f"variable {var['name']}", f"count by ({m[2]}) ({m[1]})"))
    return out


def for_grafana(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$namespace", NAMESPACE)


def selectors(expr: str) -> list[str]:
    """The vector selectors of `expr`, as written (name and matchers)."""
    import promql_parser as pp

    found: list[str] = []
    pp.walk(pp.parse(expr), lambda n: found.append(str(n)) if isinstance(n, pp.VectorSelector) else None)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prometheus_scrapes_pdserve_up_as_the_service_monitor_says(up, prom):
    t0 = time.monotonic()
    want = 3  # the gateway, the prefill and the decode runtime

    def all_up():
        t = prom.api("targets")["activeTargets"]
        return t if len(t) == want and all(x["health"] == "up" for x in t) else None

    try:
        targets = wait_for(all_up, 60, "every target up", every=0.5)
    except AssertionError:
        states = [(t["labels"].get("role"), t["scrapeUrl"], t["health"], t["lastError"])
                  for t in prom.api("targets")["activeTargets"]]  # fmt: skip
        pytest.fail(f"not every target up 60 s after Prometheus started: {states}")
    assert prom.api("targets")["droppedTargets"] == []  # the selector and port keep every Service's target
    (sm,) = objects("local", "ServiceMonitor").values()
    path = sm["spec"]["endpoints"][0]["path"]
    assert sorted(t["labels"]["role"] for t in targets) == ["decode", "gateway", "prefill"]
    assert {t["labels"]["namespace"] for t in targets} == {NAMESPACE}
    assert all(t["scrapeUrl"].endswith(path) for t in targets)
    print(f"targets up {time.monotonic() - t0:.1f} s after Prometheus started")

    traffic(up)
    finished = f'sum(vllm:request_success_total{{model_name="{up.model}"}})'
    wait_for(lambda: (r := prom.query(finished)) and float(r[0]["value"][1]) >= 3, 30, "the requests scraped")

    exprs = [(name, r["expr"]) for name, r in alerts().items()] + [(t, for_grafana(e)) for t, e in panel_exprs()]
    names = {n for _, e in exprs for n in metric_names(e) if OURS.match(n)}
    missing = [n for n in sorted(names) if not prom.api("series", **{"match[]": n})]
    assert not missing, f"named by an alert or a panel, absent from every target: {missing}"
    for where, expr in exprs:
        prom.query(expr)  # evaluates (an error is a 400 / status error)
        for sel in selectors(expr):
            if OURS.match(sel) and "status=~" not in sel:  # 5xx series exist only once something failed
                assert prom.query(f"count({sel})"), f"{where}: {sel} selects nothing"
    def rules():
        return [r for g in prom.api("rules")["groups"] for r in g["rules"]]

    wait_for(lambda: len(rules()) == len(alerts()) and all(r["lastEvaluation"] > "2000" for r in rules()), 10,
             "every rule evaluated")  # fmt: skip
    for rule in rules():
        assert rule["health"] == "ok" and rule["state"] == "inactive", rule  # and silent: nothing is wrong

    model = f'model_name="{up.model}"'
    for vllm in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):  # fmt: skip
        roles = {r["metric"]["role"] for r in prom.query(f"count by (role) ({vllm}{{{model}}})")}
        assert {"prefill", "decode"} <= roles, (vllm, roles)
    for vllm, ours in (("vllm:generation_tokens_total", "pdserve_node_generated_tokens_total"),
                       ("vllm:time_to_first_token_seconds_count", "pdserve_node_ttft_seconds_count")):  # fmt: skip
        (a,), (b,) = prom.query(f"sum({vllm})"), prom.query(f"sum({ours})")
        assert float(a["value"][1]) == float(b["value"][1]) > 0, (vllm, a, b)
    print(f"checked {len(names)} metric names, {len(exprs)} queries in {time.monotonic() - t0:.1f} s")


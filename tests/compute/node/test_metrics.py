"""A node's /metrics as Prometheus and vLLM dashboards read it (a real node process, the tiny model):
open without the internal token (every other route still needs it), nothing secret or request-specific in
it, vLLM's names beside ours with `model_name`, equal to ours and moving with traffic, and a model's gauges
gone once it is unloaded (compute/node/metrics.py)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.services import AUTH, TOKEN, Services, node_generate, wait_for

pytestmark = pytest.mark.slow
PROMPT = [5, 17, 33, 90, 41, 7]
MAX_TOKENS = 8
# vLLM sample -> ours (the same measurement, renamed): what a vLLM dashboard or an autoscaling recipe reads
VLLM = {
    "vllm:time_to_first_token_seconds_count": "pdserve_node_ttft_seconds_count",
    "vllm:time_per_output_token_seconds_count": "pdserve_node_tpot_seconds_count",
    "vllm:inter_token_latency_seconds_count": "pdserve_node_tpot_seconds_count",
    "vllm:e2e_request_latency_seconds_count": "pdserve_node_request_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "pdserve_node_request_seconds_sum",
    "vllm:prompt_tokens_total": "pdserve_node_prompt_tokens_computed_total",
    "vllm:generation_tokens_total": "pdserve_node_generated_tokens_total",
    "vllm:num_requests_running": "pdserve_node_requests_running",
    "vllm:num_requests_waiting": "pdserve_node_requests_waiting",
}


def scrape(url: str, **kw) -> dict[tuple[str, frozenset], float]:
    """{(sample name, its labels): value} of GET /metrics, without credentials unless given."""
    r = httpx.get(url + "/metrics", timeout=10, **kw)
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}  # fmt: skip


def value(samples: dict, name: str, **labels) -> float | None:
    want = frozenset(labels.items())
    got = [v for (n, ls), v in samples.items() if n == name and want <= ls]
    return sum(got) if got else None


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model_store):
    locations, name = tiny_model_store
    n = Services(locations, name, str(tmp_path_factory.mktemp("metrics-node")), TOKEN).node(
        "both", kv_blocks=64, extra=("--weights", "fp32"))  # fmt: skip
    try:
        yield n.wait_ready()
    finally:
        n.stop()


def generate(node, rid: str) -> list[int]:
    return node_generate(node, rid, PROMPT, MAX_TOKENS, ignore_eos=True)


def test_metrics_are_open_and_every_other_route_still_needs_the_token(node):
    assert httpx.get(node.url + "/metrics", timeout=10).status_code == 200
    for path in ("/load", "/internal/models"):
        assert httpx.get(node.url + path, timeout=10).status_code == 401, path
    r = httpx.post(node.url + "/internal/generate", json={}, timeout=10)
    assert r.status_code == 401


def test_vllm_names_equal_ours_and_move_with_traffic(node):
    model = node.load()["model"]
    before = scrape(node.url)
    for name in VLLM:  # every vLLM name exists before traffic (at zero), labelled as vLLM labels it
        assert value(before, name, model_name=model, engine="0") is not None, name
    rid = "metrics-test-request-7f3a"
    assert len(generate(node, rid)) == MAX_TOKENS
    wait_for(lambda: node.load()["active_requests"] == 0, 10, "the request finished")
    after = scrape(node.url)
    for vllm, ours in VLLM.items():  # one measurement, two names: equal values
        assert value(after, vllm, model_name=model) == value(after, ours, model=model), vllm

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vllm:generation_tokens_total", model_name=model) == MAX_TOKENS
    assert moved("vllm:prompt_tokens_total", model_name=model) == len(PROMPT)
    assert moved("vllm:time_to_first_token_seconds_count", model_name=model) == 1
    assert moved("vllm:e2e_request_latency_seconds_count", model_name=model) == 1
    assert moved("vllm:inter_token_latency_seconds_count", model_name=model) == MAX_TOKENS - 1  # one per output
    assert moved("vllm:request_success_total", model_name=model, finished_reason="length") == 1
    assert value(after, "vllm:request_success_total", model_name=model, finished_reason="length") == value(
        after, "pdserve_node_requests_finished_total", model=model, finished_reason="length")  # fmt: skip
    assert value(after, "vllm:num_requests_running", model_name=model) == 0
    total = value(after, "pdserve_node_kv_blocks_total", model=model)
    assert total == 64
    usage = value(after, "vllm:kv_cache_usage_perc", model_name=model)
    assert usage == value(after, "pdserve_node_kv_blocks_used", model=model) / total and 0 <= usage <= 1
    text = httpx.get(node.url + "/metrics", timeout=10).text  # nothing of the request or of the secrets
    assert TOKEN not in text and rid not in text and "Bearer" not in text


def test_an_unloaded_model_leaves_no_gauges(node):
    model = node.load()["model"]
    assert value(scrape(node.url), "vllm:num_requests_waiting", model_name=model) == 0
    r = httpx.post(node.url + "/internal/models/unload", json={"model": model}, auth=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    after = scrape(node.url)  # still served, standby: counters stay, no gauge of a model not held
    gauges = ("pdserve_node_kv_blocks_used", "pdserve_node_kv_blocks_total", "pdserve_node_requests_running",
              "pdserve_node_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
              "vllm:num_requests_waiting")  # fmt: skip
    assert [g for g in gauges if value(after, g) is not None] == []
    assert value(after, "vllm:generation_tokens_total", model_name=model) >= MAX_TOKENS

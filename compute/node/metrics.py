"""The node's Prometheus metrics (GET /metrics): pdserve's names, and vLLM's for the same measurements.

/metrics is open, as vLLM's is: a scraper needs no secret, and nothing exposed is one — label values
are model names, roles, transfer backends, store locations, error classes and finish reasons, never a
prompt, a token or a credential (tests/compute/node/test_metrics.py looks).

Each measurement is recorded once, in a ``pdserve_node_*`` family labelled ``model``. vLLM's names —
what vLLM dashboards and the llm-d / KServe / KEDA autoscaling recipes query — are views of those
families renamed at scrape time (``VllmView``: ``model`` -> ``model_name``, ``engine="0"`` added, as
vLLM labels them), so the two can never disagree. The engine's state is read at scrape time from
the models the node holds (``HeldGauges``), so a model unloaded leaves no stale series:

  pdserve_node_ttft_seconds{model}                         vllm:time_to_first_token_seconds
  pdserve_node_tpot_seconds{model}                         vllm:time_per_output_token_seconds,
                                                           vllm:inter_token_latency_seconds
  pdserve_node_request_seconds{model}                      vllm:e2e_request_latency_seconds
  pdserve_node_requests_finished_total{model,finished_reason}  vllm:request_success_total
  pdserve_node_prompt_tokens_computed_total{model}         vllm:prompt_tokens_total
  pdserve_node_generated_tokens_total{model}               vllm:generation_tokens_total
  pdserve_node_kv_blocks_used, _total{model}               vllm:kv_cache_usage_perc (used / total)
  pdserve_node_requests_running{model}                     vllm:num_requests_running
  pdserve_node_requests_waiting{model}                     vllm:num_requests_waiting
  pdserve_node_prefix_cache_queries_total{model}           vllm:prefix_cache_queries_total (prompt tokens looked up)
  pdserve_node_prefix_cache_hits_total{model}              vllm:prefix_cache_hits_total (of them, found cached)
  pdserve_node_prefix_cache_evictions_total{model}         (cached blocks reused for other content)
  pdserve_node_kv_blocks_cached{model}                     (blocks a prompt can hit now, free or in use)
  pdserve_node_peer_pulled_blocks_total, _bytes_total{model}  (prompt blocks read from a peer's cache)
  pdserve_node_peer_pull_fallbacks_total{model,reason}     (pulls that failed: the prompt was computed instead)
  pdserve_node_peer_exports_total, _exported_blocks_total{model}  (cached prefixes offered to peers)
  pdserve_node_lora_load_seconds{model}                    (a LoRA adapter fetched from the store and fused, a miss)
  pdserve_node_lora_lookups_total{model,result}            (requests naming an adapter: hit | miss)
  /load's lora per model                                   vllm:lora_requests_info{running_lora_adapters,
                                                           waiting_lora_adapters,max_lora} (the Gateway API
                                                           Inference Extension's LoRA-affinity scorer reads it)

Where each is measured: TTFT from a request's arrival on this node to its first token (on a prefill
node the request's first token; on a decode node its first token after the KV handoff); TPOT between
consecutive outputs of a stream; request seconds and finished requests on the node whose stream ends
the request (colocated or decode); waiting = queued + importing KV (vLLM counts a request waiting for
remote KV as waiting).
"""

from __future__ import annotations

import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

ENGINE = "0"  # vLLM's `engine` label: the engine index within one server; a pdserve model has one engine

TTFT = Histogram("pdserve_node_ttft_seconds", "Request arrival to first token on this node", ["model"],
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40))  # fmt: skip
TPOT = Histogram("pdserve_node_tpot_seconds", "Time per output token after the first (between outputs)", ["model"],
                 buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5))  # fmt: skip
REQUEST_SECONDS = Histogram("pdserve_node_request_seconds", "Request arrival to its last output on this node",
                            ["model"], buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300))  # fmt: skip
FINISHED = Counter("pdserve_node_requests_finished_total", "Requests whose output ended on this node",
                   ["model", "finished_reason"])  # fmt: skip
GENERATED = Counter("pdserve_node_generated_tokens_total", "Tokens sampled by this node", ["model"])
PROMPT_COMPUTED = Counter("pdserve_node_prompt_tokens_computed_total",
                          "Prompt positions this node ran through the model (an n > 1 request's choices share theirs)",
                          ["model"])  # fmt: skip

PREFIX_QUERIES = Counter("pdserve_node_prefix_cache_queries_total",
                         "Prompt tokens looked up in the prefix cache (each admission of a request)", ["model"])
PREFIX_HITS = Counter("pdserve_node_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not computed)",
                      ["model"])  # fmt: skip
PREFIX_EVICTIONS = Counter("pdserve_node_prefix_cache_evictions_total", "Cached KV blocks reused for other content",
                           ["model"])  # fmt: skip

PEER_PULLED_BLOCKS = Counter("pdserve_node_peer_pulled_blocks_total",
                             "Prompt KV blocks pulled from a peer's prefix cache instead of computed", ["model"])
PEER_PULLED_BYTES = Counter("pdserve_node_peer_pulled_bytes_total", "KV bytes pulled from peers' prefix caches",
                            ["model"])  # fmt: skip
PEER_PULL_FALLBACKS = Counter("pdserve_node_peer_pull_fallbacks_total",
                              "Peer pulls that failed or were refused: the prompt was computed instead",
                              ["model", "reason"])  # fmt: skip
PEER_EXPORTS = Counter("pdserve_node_peer_exports_total", "Cached prefixes offered to a peer",
                       ["model"])  # fmt: skip
PEER_EXPORTED_BLOCKS = Counter("pdserve_node_peer_exported_blocks_total", "Cached KV blocks offered to peers",
                               ["model"])  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort", "error")  # compute.engine.sequence.FinishReason's values


def start_series(model: str) -> None:
    """Every per-model series of a model now held, at zero: a rate or ratio over them exists before traffic."""
    for family in (TTFT, TPOT, REQUEST_SECONDS, GENERATED, PROMPT_COMPUTED, PREFIX_QUERIES, PREFIX_HITS,
                   PREFIX_EVICTIONS, PEER_PULLED_BLOCKS, PEER_PULLED_BYTES, PEER_EXPORTS, PEER_EXPORTED_BLOCKS):  # fmt: skip
        family.labels(model)
    for reason in FINISH_REASONS:
        FINISHED.labels(model, reason)


VLLM_NAMES = (  # (our family, vLLM's family name): vLLM's exposition is ours renamed, never counted twice
    (TTFT, "vllm:time_to_first_token_seconds"),
    (TPOT, "vllm:time_per_output_token_seconds"),  # vLLM < 0.11's name for the gap between tokens
    (TPOT, "vllm:inter_token_latency_seconds"),  # and its name since
    (REQUEST_SECONDS, "vllm:e2e_request_latency_seconds"),
    (FINISHED, "vllm:request_success"),  # family name: the sample is vllm:request_success_total
    (PROMPT_COMPUTED, "vllm:prompt_tokens"),
    (GENERATED, "vllm:generation_tokens"),
    (PREFIX_QUERIES, "vllm:prefix_cache_queries"),
    (PREFIX_HITS, "vllm:prefix_cache_hits"),
)


def vllm_labels(labels: dict[str, str]) -> dict[str, str]:
    out = {("model_name" if k == "model" else k): v for k, v in labels.items()}
    out["engine"] = ENGINE
    return out


def renamed(fam: Metric, name: str) -> Metric:
    """``fam`` under another family name: every sample's name prefix and ``model`` label mapped to vLLM's."""
    ours = fam.name + ("_total" if fam.type == "counter" else "")
    out = Metric(name, f"{fam.documentation} (pdserve: {ours})", fam.type, fam.unit)
    for s in fam.samples:
        out.add_sample(name + s.name[len(fam.name) :], vllm_labels(s.labels), s.value, s.timestamp, s.exemplar)
    return out


class VllmView(Collector):
    """vLLM's names for this process's node families (registered once, in the default registry)."""

    def collect(self):
        for family, name in VLLM_NAMES:
            for fam in family.collect():
                yield renamed(fam, name)


REGISTRY.register(VllmView())


class HeldGauges(Collector):
    """Per held model, at scrape time: KV blocks and requests, under pdserve's and vLLM's names.

    ``view`` is the host's ``/load`` view (``models.ModelHost.view``): one reading serves both names."""

    def __init__(self, view):
        self.view = view

    def collect(self):
        used = GaugeMetricFamily("pdserve_node_kv_blocks_used", "KV blocks in use (held for transfer included)",
                                 labels=["model"])  # fmt: skip
        total = GaugeMetricFamily("pdserve_node_kv_blocks_total", "KV blocks in the cache", labels=["model"])
        running = GaugeMetricFamily("pdserve_node_requests_running", "Requests in the running batch",
                                    labels=["model"])  # fmt: skip
        waiting = GaugeMetricFamily("pdserve_node_requests_waiting", "Requests queued or importing their KV",
                                    labels=["model"])  # fmt: skip
        cached = GaugeMetricFamily("pdserve_node_kv_blocks_cached", "KV blocks named by content (a prompt can hit "
                                   "them), free or in use", labels=["model"])  # fmt: skip
        vl = ["model_name", "engine"]
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100% (pdserve: "
                                  "pdserve_node_kv_blocks_used / pdserve_node_kv_blocks_total)", labels=vl)  # fmt: skip
        v_running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch "
                                      "(pdserve: pdserve_node_requests_running)", labels=vl)  # fmt: skip
        v_waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued or importing their KV "
                                      "(pdserve: pdserve_node_requests_waiting)", labels=vl)  # fmt: skip
        lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters running and waiting, the bound (labels; the "
                                 "value: when read, s; pdserve: /load's lora)",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora", "model_name"])  # fmt: skip
        for name, m in self.view().models.items():
            if m.state not in ("ready", "draining"):
                continue
            if m.lora is not None:  # adapter names as clients ask for them (NAME, not NAME@vN)
                names = lambda refs: ",".join(sorted({r.split("@")[0] for r in refs}))  # noqa: E731
                lora.add_metric([names(m.lora.running), names(m.lora.waiting), str(m.lora.max_loras), name], time.time())
            n_used, n_total, n_wait = m.kv_blocks_used, m.kv_blocks_total, m.queued + m.importing
            used.add_metric([name], n_used)
            total.add_metric([name], n_total)
            running.add_metric([name], m.running)
            waiting.add_metric([name], n_wait)
            cached.add_metric([name], m.kv_blocks_cached)
            usage.add_metric([name, ENGINE], n_used / n_total if n_total else 0.0)
            v_running.add_metric([name, ENGINE], m.running)
            v_waiting.add_metric([name, ENGINE], n_wait)
        yield from (used, total, running, waiting, cached, usage, v_running, v_waiting, lora)


def host_registry(view) -> CollectorRegistry:
    """A registry of one node runtime's per-model gauges (``view``: its ``/load`` view), beside the default one."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(HeldGauges(view))
    return reg

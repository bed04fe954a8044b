"""The registry's view of a node between two polls: its last /load corrected by what this gateway sent and
saw finish since that poll was asked for (gateway/routing/registry.py, ``sent``)."""

from __future__ import annotations

from compute.node import protocol as P
from gateway.routing.registry import NodeRegistry


def polled(reg, url, model, queued, running):
    """A poll's answer as ``_check`` takes it: the counts as they were when it was asked, then the report."""
    n = reg.nodes[url]
    n.polled = {k: tuple(v) for k, v in n.sent.items()}
    n.load = P.LoadReport(ready=True, queued_prompt_tokens=queued, running=running,
                          models={model: P.ModelLoad(model=model, state="ready", queued_prompt_tokens=queued,
                                                     running=running)})  # fmt: skip
    n.healthy = True


def test_a_request_counts_from_its_send_and_stops_counting_when_it_ends_without_waiting_for_a_poll():
    reg = NodeRegistry(token=None)
    reg.add("http://127.0.0.1:1", "both")
    polled(reg, "http://127.0.0.1:1", "m", queued=0, running=0)
    view = lambda: reg.views("m")[0]  # noqa: E731
    with reg.sending("http://127.0.0.1:1", "m", tokens=300, streams=1) as sent:
        assert (view().queued_prompt_tokens, view().running) == (300, 1)  # sent, not yet in any report
        sent.prefilled()
        assert (view().queued_prompt_tokens, view().running) == (0, 1)
        polled(reg, "http://127.0.0.1:1", "m", queued=0, running=1)  # a poll sees it running
        assert view().running == 1  # counted once, not twice
    assert (view().queued_prompt_tokens, view().running) == (0, 0)  # over at once: the report still says 1
    assert reg.views()[0].running == 0  # the node as a whole too


def test_other_work_on_the_node_still_counts_and_the_view_never_goes_below_zero():
    reg = NodeRegistry(token=None)
    reg.add("http://127.0.0.1:1", "prefill")
    with reg.sending("http://127.0.0.1:1", "m", tokens=100):
        polled(reg, "http://127.0.0.1:1", "m", queued=900, running=0)  # 800 from another gateway
    assert reg.views("m")[0].queued_prompt_tokens == 800
    polled(reg, "http://127.0.0.1:1", "m", queued=0, running=0)
    with reg.sending("http://127.0.0.1:1", "m", tokens=50):
        pass
    assert reg.views("m")[0].queued_prompt_tokens == 0
    with reg.sending("http://127.0.0.1:9", "m", tokens=50):  # a node not (or no longer) known: nothing counted
        assert reg.views("m")[0].queued_prompt_tokens == 0


def test_the_view_carries_the_adapters_a_node_keeps_as_its_load_reports_them():
    reg = NodeRegistry(token=None)
    reg.add("http://127.0.0.1:1", "both")
    polled(reg, "http://127.0.0.1:1", "m", queued=0, running=0)
    assert reg.views("m")[0].adapters == frozenset()
    lora = P.LoraLoad(kept=["style@v2", "terse@v1"], max_loras=16, loads=2, load_seconds=0.04)
    reg.nodes["http://127.0.0.1:1"].load.models["m"].lora = lora
    view = reg.views("m")[0]
    assert view.adapters == {"style@v2", "terse@v1"} and view.adapter_load_s == 0.04

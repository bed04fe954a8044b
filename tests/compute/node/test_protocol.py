"""The node protocol (compute/node/protocol.py) and its one client's error mapping, without a node."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from compute.engine.sampling import SamplingParams
from compute.node import protocol as P
from compute.node.client import NodeFailed, RequestRejected, check


def test_sampling_params_travel_as_themselves():
    sp = SamplingParams(max_tokens=5, temperature=0.5, stop_token_ids=(3,), logit_bias={7: -1.0}, seed=9,
                        grammar={"type": "json_object"}, fork_group="g", cache_salt="t")  # fmt: skip
    got = P.decode(P.encode(P.GenerateRequest("r", [1, 2], sp)), P.GenerateRequest).params
    assert type(got) is SamplingParams and got == sp
    assert P.encode(SamplingParams()) == b"{}"  # defaults stay off the wire


def test_a_field_added_to_the_params_reaches_the_node_and_an_unknown_one_is_refused():
    class Grown(SamplingParams):
        truncate_prompt_tokens: int | None = None

    got = msgspec.json.decode(b'{"max_tokens": 3, "truncate_prompt_tokens": 8}', type=Grown)
    assert got.truncate_prompt_tokens == 8 and got.max_tokens == 3
    with pytest.raises(msgspec.ValidationError, match="bogus"):
        P.decode(b'{"request_id": "r", "prompt_token_ids": [1], "params": {"bogus": 1}}', P.GenerateRequest)
    with pytest.raises(msgspec.ValidationError, match=r"max_tokens must be >= 1.*params"):  # checked as decoded
        P.decode(b'{"request_id": "r", "prompt_token_ids": [1], "params": {"max_tokens": 0}}', P.GenerateRequest)
    with pytest.raises(ValueError, match="top_p"):  # and as made
        SamplingParams(top_p=0)


def test_stream_line_always_carries_its_finish_reason():
    assert P.encode_line(P.StreamLine([5], None)) == b'{"token_ids":[5],"finish_reason":null}\n'
    line = P.decode(b'{"token_ids":[5],"finish_reason":"stop","logprobs":[[-0.1,[[5,-0.1]]]]}', P.StreamLine)
    assert line.finish_reason == "stop" and line.logprobs == [[-0.1, [[5, -0.1]]]]


def _handle(**backend) -> bytes:
    common = {"request_id": "r1", "layout": {"num_layers": 1, "block_size": 4, "n_kv_heads": 1, "head_dim": 8},
              "num_tokens": 5, "num_blocks": 2, "nbytes": 256, "wire_nbytes": 256, "codec": "none", "expires_at": 1e10}
    return P.encode({**common, **backend})


def test_kv_handle_is_made_reachable_from_the_address_the_gateway_dialled():
    h = P.decode(_handle(backend="tcp", address=["0.0.0.0", 4100], secret="s"), P.AnyHandle)
    assert h.reachable_from("http://10.0.0.7:8001").address == ("10.0.0.7", 4100)
    assert h.address == ("0.0.0.0", 4100)  # a copy: the offer itself is unchanged
    named = P.decode(_handle(backend="tcp", address=["prefill-0", 4100], secret="s"), P.AnyHandle)
    assert named.reachable_from("http://10.0.0.7:8001") is named
    fake = P.decode(_handle(backend="fake", address="fake://x"), P.AnyHandle)
    assert fake.reachable_from("http://h:1") is fake


@pytest.mark.parametrize("change, names", [
    ({"backend": "udp"}, "udp"),  # no such transport
    ({"backend": "tcp", "address": ["h", 1]}, "secret"),  # a tcp handle without its secret
    ({"backend": "fake", "address": "fake://x", "num_blocks": 0}, "at least one block"),
    ({"backend": "fake", "address": "fake://x", "block_hashes": ["AAAA"]}, "1 block_hashes for 2 blocks"),
    ({"backend": "fake", "address": "fake://x", "cacheable_blocks": 3}, "cacheable_blocks 3"),
    ({"backend": "fake", "address": "fake://x", "extra": 1}, "extra"),
])
def test_a_bad_kv_handle_is_refused_as_it_is_decoded_naming_what_is_wrong(change, names):
    with pytest.raises(msgspec.ValidationError, match=names):
        P.decode(_handle(**change), P.AnyHandle)


@pytest.mark.parametrize("kind, status, error", [
    ("bad_request", 400, RequestRejected), ("overloaded", 503, NodeFailed), ("model_not_loaded", 503, NodeFailed),
    ("transfer_failed", 503, NodeFailed), ("internal", 500, NodeFailed),
])  # fmt: skip
def test_a_refusal_maps_by_its_kind_not_its_words(kind, status, error):
    assert P.STATUS[kind] == status
    r = httpx.Response(status, content=P.encode(P.NodeError("anything at all", kind)))
    with pytest.raises(error) as e:
        check("http://n:1", r)
    assert e.value.kind == kind


def test_an_answer_without_a_kind_maps_by_its_status():
    with pytest.raises(RequestRejected):
        check("http://n:1", httpx.Response(422, text="nope"))
    with pytest.raises(NodeFailed):
        check("http://n:1", httpx.Response(502, text="bad gateway"))


def test_load_report_keeps_unknown_fields_out_and_types_its_model_entries():
    body = (b'{"role": "both", "ready": true, "model": "m", "queued": 2, "newer_field": 1, '
            b'"models": {"m": {"model": "m", "state": "ready", "running": 3, "kernels": {"mode": "fixed"}, "x": 0}}}')
    rep = P.decode(body, P.LoadReport)
    assert rep.ready and rep.model == "m" and rep.queued == 2
    m = rep.models["m"]
    assert isinstance(m, P.ModelLoad) and (m.state, m.running, m.kv_blocks_free, m.kernels) == ("ready", 3, 0, {"mode": "fixed"})
    d = rep.as_dict()
    assert "newer_field" not in d and d["models"]["m"]["running"] == 3 and "x" not in d["models"]["m"]  # deep, plain
    assert P.decode(P.encode(rep), P.LoadReport) == rep

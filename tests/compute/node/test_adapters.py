"""A node's adapter cache on a real store: a miss fetched once however many ask, the least recently used idle one
out first, and at the bound with every kept adapter in use a request waits for a release (in order) instead of being
refused; refused only after the wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from compute.engine.sampling import AdapterRef
from compute.modeling.config import ModelConfig
from compute.node import adapters as node_adapters
from compute.node.adapters import AdapterCache
from compute.node.errors import NodeBusy
from paramstore import ParamStore, StoreConfig
from tests.lora import save_peft_adapter


@pytest.fixture(scope="module")
def store(tiny_hf, tmp_path_factory):
    """The tiny model and three adapters of it in a store; -> (StoreConfig, [AdapterRef])."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**tiny_hf[1])).eval()
    hf.load_state_dict(tiny_hf[2], strict=False)
    root = tmp_path_factory.mktemp("adapter-cache")
    cfg = StoreConfig([str(root / f"loc{i}") for i in range(3)], k=2, m=1)
    refs = []
    with ParamStore(cfg) as ps:
        ps.import_model(tiny_hf[0], "tiny", "fp32")
        for i in range(3):
            path = tmp_path_factory.mktemp(f"a{i}")
            save_peft_adapter(hf, dict(r=2, lora_alpha=4, target_modules=["q_proj"]), path, seed=i)
            m = ps.import_adapter(path, "tiny", f"a{i}").manifest
            refs.append(AdapterRef(m.ref, m.adapter["digest"]))
    return cfg, refs


def _cache(ps: ParamStore, tiny_hf, max_loras: int) -> AdapterCache:
    return AdapterCache("tiny", "tiny@v1", ModelConfig.from_hf(tiny_hf[1]), ps, None, max_loras)


def test_a_full_cache_makes_a_request_wait_for_a_release_not_fail(store, tiny_hf):
    cfg, (a, b, c) = store

    async def main():
        with ParamStore(cfg) as ps:
            cache = _cache(ps, tiny_hf, max_loras=1)
            first = await asyncio.gather(cache.acquire(a), cache.acquire(a))  # two misses of one adapter: one fetch
            assert first[0] is first[1] and cache.loads == 1
            fetch = cache._fetch
            cache._fetch = lambda r: (time.sleep(0.3) if r == b else None, fetch(r))[1]  # b asked first, fetched last
            waiting = [asyncio.ensure_future(cache.acquire(r)) for r in (b, c)]
            await asyncio.sleep(0.8)
            assert not any(w.done() for w in waiting)  # a is in use twice: nothing may be evicted
            cache.release(a)
            await asyncio.sleep(0.1)
            assert not any(w.done() for w in waiting)  # still in use once
            cache.release(a)
            await asyncio.wait_for(waiting[0], 10)  # b, which asked first, takes the room (though c waited first)
            assert [r.ref for r in cache._kept] == [b.ref] and not waiting[1].done()
            cache.release(b)
            await asyncio.wait_for(waiting[1], 10)
            assert [r.ref for r in cache._kept] == [c.ref] and cache.loads == 3

    asyncio.run(main())


def test_still_full_after_the_wait_is_a_refusal_to_retry_elsewhere(store, tiny_hf, monkeypatch):
    cfg, (a, b, _) = store
    monkeypatch.setattr(node_adapters, "WAIT_S", 0.3)

    async def main():
        with ParamStore(cfg) as ps:
            cache = _cache(ps, tiny_hf, max_loras=1)
            await cache.acquire(a)
            with pytest.raises(NodeBusy, match="stayed in use"):
                await cache.acquire(b)
            cache.release(a)
            assert (await cache.acquire(b)) is not None and [r.ref for r in cache._kept] == [b.ref]

    asyncio.run(main())

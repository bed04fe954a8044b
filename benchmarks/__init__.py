"""pdserve's benchmarks: the top of the stack, outside the library (as vLLM keeps `benchmarks/`).

Layout: one module per thing measured, each a `pdserve bench NAME` command with
``add_arguments(parser)`` / ``main(args)`` (dispatched by autoscaler/cli.py's BENCHES table):

    store.py         pdserve bench store     parameter store import/load vs memcpy, safetensors, zfec
    engine.py        pdserve bench engine    engine decode/prefill/spawn vs HF transformers (llama.cpp)
    quality.py       pdserve bench quality   INT8 vs fp32 weights: perplexity, KL, top-1
    pd.py            pdserve bench pd        KV transfer and colocated vs disaggregated serving
    gateway.py       pdserve bench gateway   gateway overhead vs a node served directly
    burst.py         pdserve bench burst     a burst sized from measured capacity: warm pool vs cold process
    first_start.py   pdserve bench first-start  launch -> answer with empty HOME and caches vs a warm start
    swap.py          pdserve bench swap      many models on one pool: cold-model first token, from zero
    kernels.py       pdserve bench kernels   int8 linears vs the measured memory bandwidth, native vs ATen's kernels
    weight_copies.py  pdserve bench weight-copies  int8-weight matmuls without a bf16 copy vs with one, per shape
    served.py        pdserve bench served    pdserve's defaults vs llama.cpp's llama-server on the same GGUF, served
    lora.py          pdserve bench lora      LoRA adapters mixed in one batch vs the base alone; a cold adapter's cost
    graph_step.py    python -m benchmarks.graph_step  the decode step compiled whole (torch.compile, AOTInductor) vs eager
  and what they share:
    served_systems.py  llama-server and `pdserve up` as servers started, settled and stopped (used by served.py)
    service.py       `pdserve up` in a process of its own, observed from outside (used by burst.py, swap.py)
    observe.py       its timeline: a /load sampler thread and the /load readers (used by burst.py, swap.py)
    synthetic.py     a ~1 GiB Llama-shaped model of random weights, cached (used by swap.py)
    kv_transfer.py   two-process KV transfer rates (used by pd.py)
    mixed_workload.py  chat streams + long prompts through a gateway (used by pd.py)
    loadgen.py       client-side requests and closed loops (used by gateway.py, burst.py, swap.py)
    common.py        the real model in a store, host accounting (CPU flags, load average)

Benchmarks may import any library package (paramstore, compute, gateway, autoscaler); no library
package imports them (tests/test_layering.py checks; the CLI names them by string in its BENCHES
table and imports one only when `pdserve bench NAME` runs). Run them through `pdserve bench NAME`,
never as scripts: `python benchmarks/gateway.py` would put benchmarks/ first on sys.path and
shadow the `gateway` package.
"""

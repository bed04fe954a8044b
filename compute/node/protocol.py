"""The node's HTTP API as types: every message a node takes or answers, defined once.

The node owns its API; the gateway, the autoscaler and the benchmarks import these types (downwards) and
talk to a node only through ``compute.node.client``. Routes (every one but /health, /ready, /metrics and
/prove is signed: compute/node/auth.py):

  POST /internal/generate  GenerateRequest  -> NDJSON of StreamLine (role both, or any)
  POST /internal/prefill   GenerateRequest  -> PrefillReply (the first token and a KV handle)
  POST /internal/decode    DecodeRequest    -> NDJSON of StreamLine
  POST /internal/abort     AbortRequest     -> AbortReply
  POST /internal/drain?timeout_s=S          -> DrainReply
  POST /internal/cache     CacheQuery       -> CacheReport (per model: the prefix cache's changes since a cursor)
  POST /internal/kv/export ExportRequest    -> ExportReply (a cached prefix held for a peer to pull)
  POST /internal/kv/import ImportRequest    -> ImportReply (a peer's export pulled into this node's cache)
  POST /internal/models/load   ModelLoadRequest   -> ModelLoadReply (202 while it loads)
  POST /internal/models/unload ModelUnloadRequest -> ModelUnloadReply
  GET  /load                                -> LoadReport (per model: ModelLoad)
  GET  /internal/models                     -> ModelsReport
  any refusal                               -> NodeError {detail, kind}: what the caller should do

``params`` is ``compute.engine.sampling.SamplingParams`` itself (a msgspec Struct): a field added there
reaches the node with no other file changing, and a field the node does not know is refused (400 naming
it), as the gateway refuses one; its checks run as it is decoded.

Why msgspec (measured by ``python -m benchmarks.protocol_codec``, one CPU core, µs per message, encode /
decode): a stream line 0.12 / 0.23 (a dict through json: 2.0 / 2.1; pydantic: 1.1 / 1.3); a generate
request of 200 prompt tokens, decoded to ``SamplingParams``, 1.3 / 5.7 (15 / 15; 5.0 / 10.7). The stream
line is paid once per token per request on both sides; pydantic stays at the public API.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from compute.engine.sampling import SamplingParams
from compute.kv_transfer.handle import AnyHandle, KVHandle  # noqa: F401  (re-exported)

# ---- requests and replies -----------------------------------------------------------------------


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A whole request (/internal/generate) or its first token and KV (/internal/prefill)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    model: str | None = None  # which of the node's models (None: its only one)
    replay_tokens: int = 0  # after a failover: the prompt's last tokens were streamed already; recomputed one a step
    output_tokens: int = 0  # the prompt's last tokens are earlier output (penalties and min_tokens count them)
    # a peer's export of this prompt's cached prefix (ExportReply.kv): the node pulls the blocks it lacks before
    # computing the rest; a pull that fails is computed instead (compute/node/peer.py)
    pull: AnyHandle | None = None


class DecodeRequest(GenerateRequest, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The rest of a request on a decode node: the prefill node's first token and its KV handle."""

    first_token_id: int
    kv: AnyHandle


class ExportRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /internal/kv/export: hold this node's cached blocks of a prompt's prefix for a peer to pull.
    The prompt's token ids (hashed here, with ``cache_salt``, as a request's are), or the block hashes."""

    prompt_token_ids: list[int] = []
    block_hashes: list[bytes] = []  # bytes travel base64 in JSON (msgspec): no hex at either end
    cache_salt: str | None = None
    model: str | None = None
    max_blocks: int = 0  # at most this many (0: every cached one, but a prompt leaves its last 2 tokens)


class ExportReply(msgspec.Struct):
    """The KV handle of the held blocks (compute/kv_transfer/handle.py; ``block_hashes``: theirs, in order)."""

    kv: AnyHandle
    num_blocks: int


class ImportRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """POST /internal/kv/import: pull a peer's export (``ExportReply.kv``, exported by block hashes) into this node's
    prefix cache, no request attached (a node joining the pool pre-pulls the hottest prefixes)."""

    kv: AnyHandle
    model: str | None = None


class ImportReply(msgspec.Struct):
    blocks: int  # blocks newly cached here (those it held already are not pulled)


class StreamLine(msgspec.Struct, omit_defaults=True):
    """One NDJSON line of a generate/decode stream. logprobs: per token ``[logprob, [[id, logprob], ...]]``."""

    token_ids: list[int]
    finish_reason: str | None  # null | stop | length | abort | error (always on the wire)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # once, on the first line, if asked
    error: str | None = None
    cached_tokens: int | None = None  # once, with the first token this node sampled: prompt tokens its prefix cache gave


class PrefillReply(StreamLine, omit_defaults=False):
    """The first token (and its logprobs) and the handle a decode node pulls the KV with (None: finished)."""

    kv: AnyHandle | None = None


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str


class AbortReply(msgspec.Struct):
    aborted: bool


class DrainReply(msgspec.Struct):
    drained: bool


class ModelLoadRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    model: str
    weights: str | None = None
    keep: list[str] = []  # models a load must not evict
    wait_s: float | None = None  # start within this or refuse (503) and do nothing


class ModelLoadReply(msgspec.Struct):
    model: str
    state: str
    evicted: list[str] = []


class ModelUnloadRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    timeout_s: float = 30.0


class ModelUnloadReply(msgspec.Struct):
    unloaded: bool
    drained: bool


class EngineLoad(msgspec.Struct, kw_only=True):
    """One engine's queue and KV use (``NodeService.load``); in /load per model, and summed over the models."""

    queued: int = 0
    running: int = 0
    importing: int = 0
    queued_prompt_tokens: int = 0
    active_requests: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    kv_blocks_held: int = 0
    kv_transfers_held: int = 0
    kv_blocks_cached: int = 0  # named by content: a prompt can hit them (free ones count in kv_blocks_free too)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_hits: int = 0  # of them, found cached (hit rate = prefix_hits / prefix_queries)
    prefix_pulled: int = 0  # of the hits, prompt tokens whose blocks were pulled from a peer's cache
    peer_pull_fallbacks: int = 0  # peer pulls that failed (the prompt computed instead)


class LoraLoad(msgspec.Struct, kw_only=True):
    """The LoRA adapters one model keeps (compute/node/adapters.py): what routes an adapter's requests to where it is
    warm, and vLLM's ``vllm:lora_requests_info``."""

    kept: list[str] = []  # NAME@vN in memory now
    running: list[str] = []  # of them, those requests are running (NAME@vN)
    waiting: list[str] = []  # being fetched from the store now
    max_loras: int = 0
    loads: int = 0  # fetched since start (misses)
    load_seconds: float = 0.0  # the last fetch's time (store -> fused)


class ModelLoad(EngineLoad, kw_only=True):
    """One model's entry in ``LoadReport.models`` (compute/node/held.py ``Held.view``)."""

    model: str = ""  # its name, as the key of ``LoadReport.models`` is
    lora: LoraLoad | None = None  # its adapters (None: it serves none yet)
    state: str = "loading"  # loading | ready | draining | failed
    ref: str | None = None
    weights: str | None = None
    bytes: int = 0
    weights_bytes: int = 0
    kv_bytes: int = 0
    last_used: float | None = None
    progress: dict[str, Any] = {}
    error: str | None = None
    ready_s: float | None = None
    transient_bytes: int = 0
    prefetch: int = 0
    kernels: dict[str, str] | None = None  # mode, source, measure (compute/modeling/loader.py kernel_state)
    graphs: dict | None = None  # [node] step = graph: installed batch ranges, where each package came from, steps run
    capacity: dict[str, Any] = {}


class LoadReport(EngineLoad, kw_only=True):
    """GET /load (contract A). Per model in ``models``; the load fields summed over the models. Unknown
    fields are kept out, never refused (a newer node)."""

    role: str = "both"
    state: str = "standby"  # loading | ready | draining | standby
    ready: bool = False
    draining: bool = False
    model: str | None = None  # the first ready model
    models: dict[str, ModelLoad] = {}
    memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    cached: dict[str, float] = {}
    rss_bytes: int = 0
    kv_transport: str | None = None
    progress: dict[str, Any] = {}

    def as_dict(self) -> dict:
        """As plain data, nested entries too (JSON for a status page; a test's reading)."""
        return msgspec.to_builtins(self)


class ModelsReport(msgspec.Struct):
    """GET /internal/models: every model the runtime holds, and its memory."""

    models: list[ModelLoad]
    memory_budget_bytes: int
    memory_used_bytes: int


# ---- the prefix cache, as a consumer (the gateway's index) follows it ----------------------------


class CacheCursor(msgspec.Struct, array_like=True):
    """Where a consumer is in one model's cache log: the log's ``epoch`` (a new one per engine: a model
    reloaded or a node restarted starts over) and the ``seq`` of the last change it folded."""

    epoch: str
    seq: int


class CacheQuery(msgspec.Struct, forbid_unknown_fields=True):
    """POST /internal/cache: per model, the cursor of the last report folded (a model not named, or a
    cursor the log no longer reaches: a full snapshot)."""

    since: dict[str, CacheCursor] = {}


class ModelCache(msgspec.Struct, kw_only=True):
    """One model's prefix cache since the consumer's cursor (compute/node/cache_feed.py).

    Apply in this order: ``cleared`` or ``resync`` -> forget every hash of this node and model; then
    ``removed``, then ``stored`` (the net change over the range: a hash appears in one list at most). With
    ``resync``, ``stored`` is every hash the node holds now. Hashes are SHA-256 block hashes
    (compute/engine/prefix_hash.py) over ``extra`` and ``block_size``, as the node's engine computes them."""

    block_size: int
    extra: list[str]  # the engine's extra keys (model ref/weights, KV dtype, block size)
    enabled: bool = True  # False: the node runs without a prefix cache (no hash ever stored)
    cursor: CacheCursor  # the consumer's next ``since``
    stored: list[bytes] = []
    removed: list[bytes] = []
    cleared: bool = False
    resync: bool = False


class CacheReport(msgspec.Struct):
    """POST /internal/cache: per ready model."""

    models: dict[str, ModelCache] = {}


# ---- errors, by what the caller should do --------------------------------------------------------

ErrorKind = Literal["bad_request", "overloaded", "model_not_loaded", "transfer_failed", "internal"]
STATUS: dict[str, int] = {"bad_request": 400, "overloaded": 503, "model_not_loaded": 503, "transfer_failed": 503,
                          "internal": 500}  # fmt: skip
RETRY_ELSEWHERE = frozenset({"overloaded", "model_not_loaded", "transfer_failed", "internal"})


class NodeError(msgspec.Struct):
    """A refusal's body: ``kind`` says what to do (retry elsewhere unless bad_request), ``detail`` why."""

    detail: str
    kind: ErrorKind = "internal"


# ---- codecs (reused: msgspec's encoders and decoders are cheapest built once) ----------------------

encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}


def encode(msg) -> bytes:
    return encoder.encode(msg)


def encode_line(msg: StreamLine) -> bytes:
    """One NDJSON line."""
    return encoder.encode(msg) + b"\n"


def decode(buf: bytes | str, type_: type):
    """``buf`` as a ``type_``; msgspec.ValidationError / DecodeError (both ValueErrors) naming what is wrong."""
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    return dec.decode(buf)


def to_builtins(msg) -> Any:
    return msgspec.to_builtins(msg)

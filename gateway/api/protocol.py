"""The HTTP contract: OpenAI-compatible request bodies, response and error shapes (pydantic: only at
the HTTP boundary); gateway/api/openapi.py writes them into /openapi.json with what only run time knows.

Strict: a request field pdserve does not implement is a 400 naming it (``extra="forbid"``), never
dropped. Only fields that cannot change the result are accepted and ignored: ``IGNORED``. A field that
is implemented for some values only (``n``, ``response_format``, ``tools``...) refuses the others with
a 400 saying so.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from starlette.responses import Response

from gateway.api.formats import NonEmpty, ResponseFormat
from gateway.api.tools import MessageToolCall, Tool, ToolChoice
from gateway.routing.registry import NODE_URL, NODE_URL_MAX, node_url

# strict models (JSON types as the schema says: no 0 for false, no "1" for 1), except that 1.0 is an
# integer in JSON Schema: a whole float is taken as an int
_whole = BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)


def Int(**bounds) -> type:
    """int with `bounds` (ge/le: in the schema as minimum/maximum), taking a whole float as the int."""
    return Annotated[int, Field(**bounds), _whole]  # bounds before the validator, or the schema loses them



IGNORED = ("user", "metadata", "store", "service_tier")  # accepted; change nothing
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 16  # n and best_of at most (each choice is a request: admission bounds a batch of prompts)
MAX_SEQUENCES = 64  # prompts x choices generated in one request (64 x 16 would be 1,024 sequences: every slot)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): every chunk carries the usage so far


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # see Int; unknown fields: 400

    model: str
    max_tokens: Int(ge=1) | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: Int(ge=-1) = 0  # extension (vLLM): 0 or -1 disables
    seed: Int(ge=0) | None = None  # any size: the gateway passes it on modulo 2**63
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int(ge=1, le=MAX_CHOICES) = 1  # choices (gateway/api/choices.py): one prefill, forked on the node
    ignore_eos: bool = False  # extension (vLLM)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=10.0)  # extension (vLLM)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # extension (vLLM)
    min_tokens: Int(ge=0) = 0  # extension (vLLM)
    # token id (a decimal string) -> bias; an id outside the vocabulary cannot be drawn: its bias changes nothing
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")],
                     Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # fmt: skip
    stop_token_ids: list[Int(ge=0)] | None = None  # extension (vLLM)
    allowed_token_ids: Annotated[list[Int(ge=0)], Field(min_length=1)] | None = None  # extension (vLLM)
    # extension (vLLM): enters the first KV block's hash, so only requests with the same salt share cached KV
    cache_salt: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    response_format: ResponseFormat | None = None
    # accepted and ignored (IGNORED): they cannot change the result
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else (v or [])

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # see Int

    type: Literal["text"]  # the only content part supported
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # see Int

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=MAX_TOP_LOGPROBS) | None = None  # read only with logprobs: true
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # gateway/api/tools.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    max_tokens: Int(ge=0) | None = None  # 0: nothing generated (with echo + logprobs: score the prompt)
    # text, token ids, or a batch (OpenAI): a list of texts or of token-id lists, one choice each
    prompt: (NonEmpty | Annotated[list[Int(ge=0)], Field(min_length=1)]
             | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[Annotated[list[Int(ge=0)], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])  # fmt: skip
    echo: bool = False
    logprobs: Int(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    # choices generated per prompt, of which the n with the best mean logprob are returned; at most n counts as n
    best_of: Int(ge=1, le=MAX_CHOICES) | None = None
    suffix: None = None  # not supported: only null

    @model_validator(mode="after")
    def _choices(self):
        if self.generated() > self.n and self.stream:  # the schema says it too (``describe``)
            raise ValueError(f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed: the best are known at the end")
        many = len(self.prompts()) * self.generated()
        if many > MAX_SEQUENCES:
            raise ValueError(f"{len(self.prompts())} prompt(s) x {self.generated()} choice(s) = {many} sequences in one "
                             f"request; at most {MAX_SEQUENCES}: send fewer prompts or a smaller n / best_of")
        return self

    def generated(self) -> int:
        """Choices generated per prompt: best_of, never fewer than n."""
        return max(self.best_of or 1, self.n)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice: a text or token ids each."""
        v = self.prompt
        return v if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]

    def limit(self) -> int | None:
        return self.max_tokens


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:  # fmt: skip
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None) -> Response:  # fmt: skip
    """An error in OpenAI's shape (``code``: the status unless given, as ``app._err`` does), as ASCII JSON (a
    lone surrogate a message echoes stays an escape)."""
    return Response(json.dumps(error_body(message, type_, param, status if code is None else code)), status_code=status,
                    media_type="application/json")  # fmt: skip


# --- responses ----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error | authentication_error | not_found_error | rate_limit_error | server_error
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the node's prefix cache held (not computed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # when the node reported its prefix-cache hit


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: the answer is tool calls only
    tool_calls: list[MessageToolCall] | None = None  # the same shape a later request sends back


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None  # stop | length | tool_calls


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); null for a model
    root: str | None = None  # what it is made from: a model's own name, an adapter's version (NAME@vN)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    ready: bool  # a route to a node exists (200), or not (503)


class Load(BaseModel):
    queue_depth: int  # requests waiting for admission
    running: int  # requests admitted and in flight
    queue_wait_p99_s: float  # p99 wait for admission over the last minute
    drain_rate_per_s: float | None  # starts per second out of the queue, measured (None: not yet)


class NodeSpec(BaseModel):
    # checked by node_url (a 400 saying what is wrong), documented by its exact pattern
    url: Annotated[str, AfterValidator(node_url), Field(json_schema_extra={"pattern": NODE_URL, "maxLength": NODE_URL_MAX})]
    role: Literal["prefill", "decode", "both"]
    source: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = "admin"  # who registered it


class InternalNodeSpec(NodeSpec):  # POST /internal/nodes (gateway.routes.internal)
    source: str = "autoscaler"


class NodeList(BaseModel):
    nodes: list[dict]
    refused: dict[str, str] = {}  # URL -> why it failed the proof (never polled again)


class NodeAdded(BaseModel):
    added: str
    proven: bool  # answered the challenge (false: not reachable yet; challenged again at the next poll)


class NodeRemoved(BaseModel):
    removed: bool


class AdminStatus(BaseModel):
    model: str | None  # the first served model (older readers)
    served: list[str] = []  # every served model
    models: dict[str, dict] = {}  # per model: traffic as in /internal/status (queue_depth, held, running, p99s, idle_s)
    nodes: list[dict]
    refused: dict[str, str] = {}  # URL -> why it failed the proof
    queue_depth: int
    running: int
    autoscaler: dict
    supervisor: dict | None = None  # `pdserve up`: the local actuator's slots (restarts, crash loops, last log lines)


class Ok(BaseModel):
    ok: bool

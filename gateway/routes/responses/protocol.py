"""The Responses API's HTTP contract (``POST /v1/responses``): the request body, its input items, and the
response object and stream events as pdserve returns them (pydantic: only at the HTTP boundary).

Strict as the rest of the gateway (``gateway/api/protocol.py``): a field not declared here is a 400 naming it.
Stateless: ``store`` true and ``previous_response_id`` are 400s saying so (nothing is kept between
requests: gateways are replicas, and one that kept a response could not serve it from another).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from gateway.api.formats import NonEmpty
from gateway.api.protocol import Int
from gateway.api.tools import FunctionName

STATELESS = ("pdserve keeps no responses (its gateways are stateless replicas): send the whole conversation "
             "in input, with store false or left out")  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # unknown fields: 400 naming them


def text_or(items) -> type:
    """A string or a list of ``items``, told apart by the value's form (a 400 then names what is wrong with
    the form sent, not with both)."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[items, Tag("items")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "items")]  # fmt: skip


def _stateless(what: str):
    def check(v):
        if v is not None and v is not False:
            raise ValueError(f"{what} is not served: {STATELESS}")
        return v

    return BeforeValidator(check)


def _nothing_to_include(v):
    if isinstance(v, list) and v:
        raise ValueError(f"{v[0]!r} is not served: nothing beyond the output is returned (no logprobs, reasoning "
                         "or tool results); send [] or leave it out")
    return v


# --- input items ----------------------------------------------------------------------------------
class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):  # an earlier answer's text, sent back as input
    type: Literal["output_text"]
    text: str
    annotations: list[dict] | None = None  # none are made here; read as nothing
    logprobs: list[dict] | None = None  # read as nothing


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


# text only: input_image, input_file, input_audio are 400s naming the tag
ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]
Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(list[ContentPart])
    id: str | None = None  # an earlier output item's: read as nothing
    status: Status | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if p.type == "refusal" else p.text for p in self.content)


class FunctionCallItem(_Strict):  # an earlier answer's call, sent back with its output
    type: Literal["function_call"]
    call_id: NonEmpty
    name: FunctionName
    arguments: str  # JSON text, as the answer gave it
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: text_or(list[InputText])
    id: str | None = None
    status: Status | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(v: Any) -> str | None:
    """An item's tag: its type, "message" where it has none (OpenAI's easy input message)."""
    if isinstance(v, dict):
        return v.get("type", "message")
    return getattr(v, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                      Discriminator(_item_type, custom_error_type="item_type", custom_error_message=(
                          "only message, function_call and function_call_output items are served (no reasoning, "
                          "hosted tool or item_reference items)"))]  # fmt: skip


Input = text_or(Annotated[list[InputItem], Field(min_length=1)])


# --- tools and text format ------------------------------------------------------------------------
class FunctionTool(_Strict):
    type: Literal["function"]  # the only tool type served (no hosted tools: web search, files...)
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema (none: any object)
    strict: bool | None = None  # tool_choice required/named: always enforced; auto: the model's choice


class NamedFunction(_Strict):
    type: Literal["function"]
    name: FunctionName


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    type: Literal["json_schema"]
    name: str = "response"
    schema_: dict = Field(alias="schema")  # a JSON Schema; one llguidance cannot compile is a 400 saying why
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema (strict or not)


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None


# --- the request ----------------------------------------------------------------------------------
class ResponsesRequest(_Strict):
    model: str
    input: Input
    instructions: str | None = None  # a system message before the input
    max_output_tokens: Int(ge=1) | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    include: Annotated[Annotated[list[str], Field(max_length=0)] | None, BeforeValidator(_nothing_to_include)] = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop input to fit) is not served: a 400
    # stateless (module docstring): false / null only
    store: Annotated[Literal[False] | None, _stateless("true")] = None
    previous_response_id: Annotated[None, _stateless("a previous response")] = None
    # accepted and ignored: they cannot change the result
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


# --- the response (what /openapi.json says the gateway returns) -----------------------------------
class OutputTextPart(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Status
    role: Literal["assistant"]
    content: list[OutputTextPart]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Status


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: None
    store: bool
    temperature: float
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    metadata: dict[str, str]

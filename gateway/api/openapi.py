"""The OpenAPI document's run-time half: the error responses each route lists (``errors``, with their
Retry-After headers), the SSE event shape, and ``describe``, which writes into FastAPI's document what
only the running gateway knows (its models, limits, tool rules, bearer schemes)."""

from __future__ import annotations

from gateway.api.protocol import ErrorResponse

SSE = {"text/event-stream": {"schema": {  # one event (schemathesis and OpenAPI 3.2 validate each)
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk (chat.completion.chunk or text_completion) "
                            "or an error body as JSON; the last event is [DONE]"}}}}}  # fmt: skip
SSE_TYPED = {"text/event-stream": {"schema": {  # the Responses API's typed events
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string", "description": "the event's type: response.created ... "
                             "response.completed (or response.incomplete, response.failed)"},
                   "data": {"type": "string", "description": "the event as JSON: its type, sequence_number and "
                            "fields"}}}}}  # fmt: skip
RETRY_AFTER = {"Retry-After": {"required": True, "schema": {"type": "integer", "minimum": 1},
                               "description": "seconds: the queue now waiting drains in about this long"}}  # fmt: skip
RETRY_AFTER_HELD = {"Retry-After": {"required": False, "schema": {"type": "integer", "minimum": 1},
                                    "description": "set when the model was held while no node held it and was "
                                                   "not placed in time: seconds after which to retry"}}  # fmt: skip


def errors(*codes: int) -> dict:
    """FastAPI ``responses=`` for these error statuses, each with the error body (429 with Retry-After)."""
    what = {400: "invalid request (message and param say what)", 401: "missing or invalid key",
            403: "the node failed its proof: it does not hold the internal token or is not at this URL",
            404: "no such model (the message lists the served ones)",
            429: "cannot start in time: retry after Retry-After seconds",
            503: "no node could serve the request (or none held the model in time: Retry-After)"}  # fmt: skip
    out = {}
    for c in codes:
        out[c] = {"model": ErrorResponse, "description": what[c]}
        if c == 429:
            out[c]["headers"] = RETRY_AFTER
        if c == 503:
            out[c]["headers"] = RETRY_AFTER_HELD
    return out


def describe(schema: dict, models: list[str] | str, max_tokens: int, vocab: int, bearer: dict[str, list[str]],
             takes_tools: bool = True) -> dict:  # fmt: skip
    """What only the running gateway knows, written into its OpenAPI document: the models it serves
    (an enum; an open string when none is listed yet: they come from the store), the largest
    max_tokens and token id range over them (prompt, allowed_token_ids, detokenize; each model's own
    context and vocabulary bound it further: 400 with the message); whether tools can be offered (``takes_tools``: some model's
    template renders them; a tool_choice other than none needs tools either way); 400 (not FastAPI's
    422) for invalid bodies; and the bearer schemes (`bearer`: scheme name -> path prefixes it guards;
    empty: open)."""
    models = [models] if isinstance(models, str) else list(models)
    comp = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comp.pop(name, None)
    for req in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "TokenizeCompletionRequest",
                "TokenizeChatRequest", "DetokenizeRequest"):  # fmt: skip
        props = comp.get(req, {}).get("properties", {})
        if "model" in props:
            named = ({"type": "string", "enum": models, "title": "Model"} if models else
                     {"type": "string", "minLength": 1, "title": "Model"})  # fmt: skip
            required = "model" in comp[req].get("required", [])  # optional: /tokenize's (the first served model)
            props["model"] = named if required else {"anyOf": [named, {"type": "null"}], "title": "Model"}
        if req in ("ResponsesRequest", "TokenizeChatRequest") and not takes_tools and "tools" in props:
            props["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}], "title": "Tools",
                              "description": "no served model's chat template renders tools"}  # fmt: skip
        if req == "ResponsesRequest":
            _tool_rules(comp[req], takes_tools)
        if req == "DetokenizeRequest" and "tokens" in props:
            props["tokens"].setdefault("items", {})["maximum"] = vocab - 1
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            for alt in props.get(key, {}).get("anyOf", []):
                if alt.get("type") == "integer":
                    alt["maximum"] = max_tokens
        if req == "ChatCompletionRequest":
            _tool_rules(comp[req], takes_tools)
        if req == "CompletionRequest":  # best_of > 1 only unstreamed (n's value aside: JSON Schema cannot compare)
            schema_of = comp[req]
            schema_of["if"] = {"properties": {"stream": {"const": True}}, "required": ["stream"]}
            schema_of["then"] = {"properties": {"best_of": {"anyOf": [{"type": "null"}, {"const": 1}]}}}
        for alt in props.get("logit_bias", {}).get("anyOf", []):
            if alt.get("type") == "object":  # keys are token ids: nothing else (pydantic leaves this out)
                alt["additionalProperties"] = False
        for alt in props.get("allowed_token_ids", {}).get("anyOf", []):  # a node refuses an id past its vocab
            if alt.get("type") == "array":
                alt.setdefault("items", {})["maximum"] = vocab - 1
        for alt in props.get("prompt", {}).get("anyOf", []):
            items = alt.get("items", {}) if alt.get("type") == "array" else {}
            if items.get("type") == "integer":
                items["maximum"] = vocab - 1
            elif items.get("type") == "array" and items.get("items", {}).get("type") == "integer":
                items["items"]["maximum"] = vocab - 1
    if bearer:
        schema["components"]["securitySchemes"] = {n: {"type": "http", "scheme": "bearer"} for n in bearer}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
            for name, prefixes in bearer.items():
                if path.startswith(tuple(prefixes)):
                    op["security"] = [{name: []}]
    return schema


def _tool_rules(schema_of: dict, takes_tools: bool) -> None:
    """Chat's tool rules in its schema: a tool_choice other than none needs tools; none served takes them:
    tools empty or null."""
    props = schema_of.get("properties", {})
    if not takes_tools and "tools" in props:
        props["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}], "title": "Tools",
                          "description": "no served model's chat template renders tools"}  # fmt: skip
    schema_of["if"] = {"properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}, "required": ["tool_choice"]}
    schema_of["then"] = {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}

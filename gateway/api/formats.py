"""response_format: the structured output a request asks for, and the grammar spec the nodes enforce
(``compute.engine.grammar``): text, json_object, json_schema, or a regex (a pdserve extension)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = "response"
    schema_: dict = Field(alias="schema")  # a JSON Schema; one llguidance cannot compile is a 400 saying why
    strict: bool | None = None  # the output always follows the schema (strict or not)
    description: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(BaseModel):  # extension: the output matches a regular expression (whole)
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["regex"]
    pattern: NonEmpty


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat, Field(discriminator="type")]


def grammar_spec(fmt) -> dict | None:
    """The node's grammar spec (``compute.engine.grammar``) for a response_format (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        return {"type": "json_schema", "schema": fmt.json_schema.schema_}
    if fmt.type == "regex":
        return {"type": "regex", "pattern": fmt.pattern}
    return {"type": "json_object"}

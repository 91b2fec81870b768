"""The Responses API's wire format: the request body as validating pydantic models, the response
object and its output items as plain ones (openai.types.responses is the reference).

Unlike chat, a request field this server does not serve is never ignored: fields outside
SUPPORTED are refused by name (server/responses/conversion.py), unless null or at their default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, TypeAdapter, model_validator

# ------------------------------------------------------------------ request
# Fields that may carry their documented default (or null) although they are not otherwise served.
ACCEPTED_DEFAULTS = {"include": [], "truncation": "disabled", "background": False,
                     "service_tier": "auto", "top_logprobs": 0}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]  # output_text: an assistant's earlier reply
    text: str
    annotations: list | None = None  # output_text's, always empty here
    logprobs: list | None = None


def joined_text(value: str | list[InputText]) -> str:
    """A string, or the text of its parts one after another."""
    return value if isinstance(value, str) else "".join(part.text for part in value)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return joined_text(self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return joined_text(self.output)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem,
                      Field(discriminator="type")]
INPUT_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(_Strict):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = Field(default=None, min_length=1, max_length=64,
                                   pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a plain model has


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`. Unknown fields are kept (`model_extra`) to be refused by name."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    tools: list[dict] | None = None  # checked item by item: built-in tools are refused by type
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # extension (vLLM's)

    @model_validator(mode="before")
    @classmethod
    def _typed_messages(cls, data):
        """OpenAI's "easy" input messages may leave out `"type": "message"`."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [
                {**item, "type": "message"} if isinstance(item, dict) and "type" not in item
                and "role" in item else item for item in data["input"]]}
        return data


# ------------------------------------------------------------------ response
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # OpenAI's explicit cache writes: there are none here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int
    speculative: Any = None  # extension, as chat's usage.speculative


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"] | None = None


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    completed_at: float | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float = 1.0
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict] = Field(default_factory=list)
    top_p: float = 1.0
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

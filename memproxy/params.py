"""The chat request's scalar parameters, type-checked before anything is planned, stored or sent.

Whatever the provider, a `max_tokens` of "lots" or a `temperature` of "hot" is the client's mistake,
and it gets the answer OpenAI gives it (400 `invalid_request_error`, `param` naming the field)
before memproxy plans a turn around it or pays for an upstream call. Only types are checked, and
the bounds every provider shares (a token count or a choice count is positive): ranges differ by
provider (Anthropic's temperature stops at 1, OpenAI's at 2), so those are the provider's to say.
`null` is accepted wherever OpenAI accepts it (it means "the default"); parameters not listed here
pass through untouched.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .errors import BadRequest

_Count = Annotated[StrictInt, Field(ge=1)]
_Number = StrictFloat | StrictInt


class _Choice(BaseModel):
    """A `tool_choice` object: every form OpenAI takes names its `type` (`function`, `allowed_tools`,
    `custom`, ...); litellm refuses one without (`{}`) in its own code, which read as a 502."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr


class _Params(BaseModel):
    model_config = ConfigDict(extra="allow")  # the rest pass through unchecked

    max_tokens: _Count | None = None
    max_completion_tokens: _Count | None = None
    n: _Count | None = None
    temperature: _Number | None = None
    top_p: _Number | None = None
    presence_penalty: _Number | None = None
    frequency_penalty: _Number | None = None
    seed: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = None
    user: StrictStr | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: StrictStr | _Choice | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    reasoning_effort: StrictStr | None = None
    service_tier: StrictStr | None = None


_EXPECTED = {
    "max_tokens": "a positive integer", "max_completion_tokens": "a positive integer", "n": "a positive integer",
    "temperature": "a number", "top_p": "a number", "presence_penalty": "a number", "frequency_penalty": "a number",
    "seed": "an integer", "logprobs": "a boolean", "top_logprobs": "an integer of at least 0",
    "parallel_tool_calls": "a boolean", "store": "a boolean", "user": "a string",
    "stop": "a string or an array of strings", "stream": "a boolean", "tools": "an array", "functions": "an array",
    "tool_choice": "a string or an object with a 'type'", "function_call": "a string or an object",
    "response_format": "an object",
    "stream_options": "an object", "web_search_options": "an object", "metadata": "an object",
    "logit_bias": "an object", "audio": "an object", "prediction": "an object", "modalities": "an array of strings",
    "reasoning_effort": "a string", "service_tier": "a string",
}


# The `tool_choice` objects litellm takes without a `function` (any other it refuses in its own code,
# before a provider sees it, as a connection error: a 502 clients retry).
_LITELLM_BARE_CHOICES = ("auto", "none", "required")


def check_params(body: dict[str, Any], through_litellm: bool = False) -> None:
    """Raise `BadRequest` naming the first parameter of `body` of the wrong type, or, for a model
    reached through litellm (`through_litellm`), of a form litellm refuses."""
    try:
        _Params.model_validate(body)
    except ValidationError as exc:
        param = str(exc.errors()[0]["loc"][0])
        raise BadRequest(f"'{param}' must be {_EXPECTED[param]}, or null", param=param) from None
    choice = body.get("tool_choice")
    if through_litellm and isinstance(choice, dict) and choice.get("function") is None \
            and choice.get("type") not in _LITELLM_BARE_CHOICES:
        raise BadRequest("'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}} "
                         "on this model, which is reached through litellm (transport: openai relays any other form)",
                         param="tool_choice")

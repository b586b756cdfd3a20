"""A client's parameters are the request's, never litellm's settings.

litellm takes its own settings as keyword arguments beside the request's: where to send it
(`api_base`, `base_url`), with which key, which other models to try (`fallbacks`, `model_list`),
where to log (`langfuse_host`), a canned answer (`mock_response`), a provider's credentials and
endpoint (`aws_bedrock_runtime_endpoint`, `vertex_credentials`). A client that could set them could
send the operator's upstream key to a server of its own, or spend it on a model the config does not
offer. Every parameter still reaches the provider (OpenAI's answer to a field it does not know is
the provider's to give): those litellm does not name as a request parameter travel in the body, as
`extra_body`, where litellm reads nothing. Against two fake providers, the configured one and an
attacker's, through the openai SDK on every litellm endpoint memproxy serves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from conftest import Proxy
from fake_upstream import FakeUpstream, Reply
from memproxy.config import ModelConfig
from memproxy.provider import chat_parameters, litellm_kwargs, load_litellm

pytestmark = pytest.mark.both_transports


@pytest.fixture(scope="module")
def attacker() -> Iterator[FakeUpstream]:
    fake = FakeUpstream().start()
    yield fake
    fake.stop()


def settings(attacker: str) -> dict[str, Any]:
    """litellm's settings, each pointing at the attacker's server (its URL)."""
    elsewhere = f"{attacker}/v1"
    return {
        "api_base": elsewhere, "base_url": elsewhere, "api_key": "attacker-key",
        "fallbacks": [{"model": "openai/gpt-4o", "api_base": elsewhere}, "openai/gpt-4o"],
        "model_list": [{"model_name": "small", "litellm_params": {"model": "openai/x", "api_base": elsewhere}}],
        "context_window_fallback_dict": {"openai/small": "openai/gpt-4o"},
        "mock_response": "a canned answer", "custom_llm_provider": "anthropic",
        "aws_bedrock_runtime_endpoint": elsewhere, "langfuse_host": elsewhere, "num_retries": 3,
    }


async def test_a_clients_settings_for_litellm_go_to_the_provider_as_fields(
        proxy: Proxy, upstream: FakeUpstream, attacker: FakeUpstream) -> None:
    attacker.reset()
    upstream.enqueue(Reply(content="Hello."))
    extra = settings(attacker.url)
    answer = await proxy.client().chat.completions.create(
        model="small", messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    assert answer.choices[0].message.content == "Hello."  # the provider's, not the canned one
    assert attacker.received == []
    sent = upstream.chat_requests()[-1]
    assert sent.headers["Authorization"] == "Bearer upstream-secret"
    for name in ("fallbacks", "model_list", "mock_response", "aws_bedrock_runtime_endpoint", "langfuse_host"):
        assert sent.body[name] == extra[name], name  # as sent: the provider says what it makes of them


async def test_a_refused_request_falls_back_to_nothing(proxy: Proxy, upstream: FakeUpstream,
                                                       attacker: FakeUpstream) -> None:
    """litellm tries `fallbacks` when the model refuses, with the call's own key: a client that gets
    its request refused on purpose must not get the operator's key sent elsewhere."""
    attacker.reset()
    upstream.enqueue(Reply(status=400, error_message="temperature out of range"))
    with pytest.raises(openai.BadRequestError):
        await proxy.client().chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], temperature=99,
            extra_body={"fallbacks": settings(attacker.url)["fallbacks"]})
    assert attacker.received == []
    assert len(upstream.chat_requests()) == 1  # once: not retried either


async def test_the_other_endpoints_take_no_settings_either(proxy: Proxy, upstream: FakeUpstream,
                                                           attacker: FakeUpstream) -> None:
    attacker.reset()
    client = proxy.client(session=None)
    await client.embeddings.create(model="small", input="hello", extra_body=settings(attacker.url))
    await client.completions.create(model="small", prompt="hello", extra_body=settings(attacker.url))
    await client.moderations.create(model="small", input="hello", extra_body=settings(attacker.url))
    assert attacker.received == []
    assert {r.headers["Authorization"] for r in upstream.received} == {"Bearer upstream-secret"}


# Names litellm reads from a call's keyword arguments as its own (beyond its list of them,
# `all_litellm_params`): callbacks with the operator's credentials, TLS checks, batch calls to other
# models, internal switches.
UNLISTED = {"callbacks": ["langfuse"], "success_callback": ["langfuse"], "failure_callback": ["langfuse"],
            "ssl_verify": False, "batch_models": "openai/gpt-4o", "drop_params": True,
            "_litellm_internal_model_credentials": {"api_key": "x"}, "mock_tool_calls": [],
            "vertex_credentials": "{}", "aws_bedrock_runtime_endpoint": "http://elsewhere", "azure_ad_token": "t"}


@pytest.mark.parametrize("name", ["gemini/gemini-1.5-pro", "anthropic/claude-3-5-sonnet-20240620",
                                  "ollama_chat/llama3", "openai/gpt-4o-mini", "hosted_vllm/my-model"])
def test_only_request_parameters_are_litellm_arguments(name: str) -> None:
    litellm = load_litellm()
    model = ModelConfig(name="m", model=name, api_base="http://127.0.0.1:9/v1", api_key="upstream-secret")
    params = {**settings("http://elsewhere"), **UNLISTED, "temperature": 0.2, "max_tokens": 5, "tools": [],
              "reasoning_effort": "low", "top_k": 3, "model": "m"}
    kwargs = litellm_kwargs(model, params, chat_parameters(litellm, model))
    for key in ("temperature", "max_tokens", "tools", "reasoning_effort"):
        assert kwargs[key] == params[key], key
    assert kwargs["model"] == name and kwargs["api_base"] == "http://127.0.0.1:9/v1" and kwargs["api_key"] == "upstream-secret"
    for key in {**settings("http://elsewhere"), **UNLISTED}:
        assert kwargs["extra_body"][key] == params[key], key
        assert key not in kwargs or key in ("api_base", "api_key"), key  # those two are the model's own
    # The provider's own generation parameters stay litellm's to translate where it knows the
    # provider's (Gemini's top_k goes in generationConfig); elsewhere they travel as body fields.
    if name.startswith(("gemini/", "anthropic/", "ollama_chat/")):
        assert kwargs["top_k"] == 3 and "top_k" not in kwargs["extra_body"]
    else:
        assert kwargs["extra_body"]["top_k"] == 3 and "top_k" not in kwargs

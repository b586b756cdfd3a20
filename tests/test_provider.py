"""The litellm boundary: context windows, the counter chosen per provider, and start-up errors."""

from __future__ import annotations

import pytest

from memproxy.config import Config, ConfigError, ModelConfig
from memproxy.provider import LitellmCounter, Provider
from memproxy.tokens import TiktokenCounter

MESSAGE = {"role": "user", "content": "How many tokens is this sentence, roughly?"}


def provider_for(*models: ModelConfig) -> Provider:
    return Provider(Config(models=models))


def test_window_comes_from_config_else_from_litellm_model_info() -> None:
    configured = ModelConfig(name="a", model="openai/gpt-4o-mini", context_window=5000)
    known = ModelConfig(name="b", model="openai/gpt-4o-mini")
    provider = provider_for(configured, known)
    assert provider.window(configured) == 5000
    assert provider.window(known) == 128000


def test_unknown_window_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        provider_for(ModelConfig(name="a", model="openai/gpt-4o-mini"),
                     ModelConfig(name="b", model="openai/no-such-model"))
    assert caught.value.key == "models[1].context_window"


def test_counter_is_tiktoken_for_openai_style_providers_and_litellm_for_others() -> None:
    gpt = ModelConfig(name="gpt", model="openai/gpt-4o-mini", context_window=1000)
    local = ModelConfig(name="local", model="openai/small", context_window=1000)
    claude = ModelConfig(name="claude", model="anthropic/claude-3-5-sonnet-20240620", context_window=1000)
    forced = ModelConfig(name="forced", model="anthropic/x", context_window=1000, tokenizer="cl100k_base")
    provider = provider_for(gpt, local, claude, forced)
    assert isinstance(provider.counter(gpt), TiktokenCounter)
    assert provider.counter(gpt).encoding.name == "o200k_base"  # type: ignore[attr-defined]
    assert provider.counter(local).encoding.name == "o200k_base"  # type: ignore[attr-defined]
    assert isinstance(provider.counter(claude), LitellmCounter)
    assert provider.counter(forced).encoding.name == "cl100k_base"  # type: ignore[attr-defined]


def test_litellm_counter_counts_messages_and_tools() -> None:
    claude = ModelConfig(name="claude", model="anthropic/claude-3-5-sonnet-20240620", context_window=1000)
    counter = provider_for(claude).counter(claude)
    short = counter.message({"role": "user", "content": "hi"})
    long = counter.message(MESSAGE)
    assert 0 < short < long
    tool = {"type": "function", "function": {"name": "lookup", "description": "Find a thing by name.",
                                             "parameters": {"type": "object", "properties": {}}}}
    assert counter.tools([tool]) > 0
    assert counter.tools([]) == 0

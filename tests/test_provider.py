"""The litellm boundary: context windows, the counter chosen per provider, and start-up errors."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from memproxy.config import Config, ConfigError, ModelConfig, parse_config
from memproxy.provider import (_SLOW_TOKENIZER_SECONDS, LitellmCounter, Provider, load_litellm, provider_problems,
                               transport)
from memproxy.tokens import TiktokenCounter
from threaded_server import ThreadedServer

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


# The README's ready configs ("Providers"), kept here word for word so a change to litellm's model
# data (a window it no longer knows, a provider it routes elsewhere) fails here rather than for a user.
PROVIDER_EXAMPLES = """
models:
  # Anthropic: litellm translates to the Messages API; the window (200,000) is litellm's.
  - name: claude
    model: anthropic/claude-sonnet-4-5
    api_key: ${ANTHROPIC_API_KEY}
    max_output_tokens: 4096  # also the max_tokens Claude is asked for when a request sets none

  # Google Gemini (an AI Studio key). litellm knows the window (1,048,576); a smaller one caps
  # what one request may send, and cost.
  - name: gemini
    model: gemini/gemini-2.5-flash
    api_key: ${GEMINI_API_KEY}
    context_window: 200000

  # Azure OpenAI: the model is your deployment's name, which litellm cannot know: set the window.
  # The API version is AZURE_API_VERSION's (else litellm's default).
  - name: azure-gpt-4o
    model: azure/my-gpt-4o-deployment
    api_base: https://my-resource.openai.azure.com
    api_key: ${AZURE_API_KEY}
    context_window: 128000

  # Ollama's own API. The window must be the one Ollama runs the model with (its default is small:
  # start it with OLLAMA_CONTEXT_LENGTH=8192, or set num_ctx in a Modelfile).
  - name: llama
    model: ollama_chat/llama3.1:8b
    api_base: http://127.0.0.1:11434
    context_window: 8192

  # vLLM speaks the OpenAI API: memproxy's own client, no translation. The window is vLLM's
  # --max-model-len.
  - name: qwen
    model: openai/Qwen/Qwen2.5-7B-Instruct
    api_base: http://127.0.0.1:8000/v1
    api_key: ${VLLM_API_KEY:-none}
    context_window: 32768
"""


def test_the_readme_provider_configs_start_offline() -> None:
    config = parse_config(PROVIDER_EXAMPLES, {"ANTHROPIC_API_KEY": "sk-ant-x", "GEMINI_API_KEY": "g-x",
                                              "AZURE_API_KEY": "az-x"})
    assert provider_problems(config) == []
    provider = Provider(config)
    by_name = {m.name: m for m in config.models}
    assert {name: provider.window(m) for name, m in by_name.items()} == {
        "claude": 200_000, "gemini": 200_000, "azure-gpt-4o": 128_000, "llama": 8192, "qwen": 32768}
    assert {name: transport(m) for name, m in by_name.items()} == {
        "claude": "litellm", "gemini": "litellm", "azure-gpt-4o": "litellm", "llama": "litellm", "qwen": "litellm"}
    for model in config.models:
        assert provider.counter(model).message(MESSAGE) > 0
    # Only Claude's API requires max_tokens; it is asked for the reserve when a request sets none.
    asked = {name: provider._kwargs(m, [MESSAGE], {}).get("max_tokens") for name, m in by_name.items()
             if transport(m) == "litellm"}
    assert asked == {"claude": 4096, "gemini": None, "azure-gpt-4o": None, "llama": None, "qwen": None}


# The README's example of a model's own headers ("A model's own headers"), checked word for word.
HEADERS_EXAMPLE = """\
  - name: openrouter-claude
    model: openrouter/anthropic/claude-sonnet-4.5
    api_key: ${OPENROUTER_API_KEY}
    headers: {HTTP-Referer: "https://my.app", X-Title: My App}
"""


def test_the_readme_headers_example_starts_offline_and_sends_its_headers() -> None:
    assert HEADERS_EXAMPLE in (Path(__file__).resolve().parent.parent / "README.md").read_text()
    config = parse_config("models:\n" + HEADERS_EXAMPLE, {"OPENROUTER_API_KEY": "or-x"})
    assert provider_problems(config) == []
    [model] = config.models
    provider = Provider(config)
    assert provider.window(model) > 0
    assert provider._kwargs(model, [MESSAGE], {})["extra_headers"] == {"HTTP-Referer": "https://my.app",
                                                                        "X-Title": "My App"}


def test_a_tokenizer_litellm_downloads_is_loaded_before_the_first_request(tmp_path: Path) -> None:
    """litellm counts a Llama 3 model's tokens with a Hugging Face tokenizer it downloads on first
    use, blocking (with retries, ~25 s where there is no network): the provider asks for it as it
    starts, not in the first request. A fake Hugging Face Hub (HF_ENDPOINT) sees the download asked
    for while the provider is made, before anything is counted; it answers 404, so litellm falls
    back to tiktoken and the provider still starts. It answers slowly, as a network may: the
    provider says how long the tokenizer took and what skips it."""
    asked: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        asked.append(request.path)
        if len(asked) == 1:
            await asyncio.sleep(_SLOW_TOKENIZER_SECONDS)  # a slow network, not a wait for anything
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    hub = ThreadedServer("fake-hub")
    port = hub.start(app)
    try:
        made = subprocess.run(
            [sys.executable, "-c", "from memproxy.config import Config, ModelConfig\n"
             "from memproxy.provider import Provider\n"
             "Provider(Config(models=(ModelConfig(name='llama', model='hosted_vllm/meta-llama/Llama-3.1-8B-Instruct',"
             " api_base='http://127.0.0.1:9/v1', context_window=8192),)))\n"
             "print('made')\n"],
            env={**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
                 "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            capture_output=True, text=True, timeout=120)
    finally:
        hub.stop()
    assert made.returncode == 0 and made.stdout.strip() == "made", made.stderr
    assert any("llama-3-tokenizer" in path for path in asked), asked
    assert "to load the tokenizer for hosted_vllm/meta-llama/Llama-3.1-8B-Instruct" in made.stderr, made.stderr
    assert "HF_HUB_OFFLINE=1" in made.stderr


@pytest.mark.parametrize("observed", [False, True])
def test_litellm_skips_copying_messages_for_its_logs_only_when_nothing_reads_them(observed: bool) -> None:
    """After every call litellm copies every message into the logging payload it makes for its
    callbacks (shortening inline images). Loaded for a config without callbacks it is told not to
    (`MAX_BASE64_LENGTH_FOR_LOGGING` 0, read once at import); with callbacks, its default stays."""
    env = {k: v for k, v in os.environ.items() if k != "MAX_BASE64_LENGTH_FOR_LOGGING"}
    loaded = subprocess.run(
        [sys.executable, "-c", "from memproxy.provider import load_litellm\n"
         f"load_litellm(observed={observed})\n"
         "from litellm.litellm_core_utils import logging_utils\n"
         "print(logging_utils.MAX_BASE64_LENGTH_FOR_LOGGING)\n"],
        env={**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert (int(loaded.stdout.strip()) > 0) is observed


def test_an_error_litellm_met_in_its_own_code_does_not_show_its_traceback() -> None:
    provider = provider_for(ModelConfig(name="a", model="openai/gpt-4o-mini"))
    litellm = load_litellm()
    text = ("max_workers must be greater than 0\nTraceback (most recent call last):\n"
            '  File "/srv/memproxy/.venv/lib/python3.11/site-packages/litellm/main.py", line 5277, in completion\n'
            "ValueError: max_workers must be greater than 0\n")
    error = provider.upstream_error(litellm.APIConnectionError(message=text, llm_provider="openai", model="gpt-4o-mini"))
    assert error.status == 502 and error.code == "upstream_unreachable"
    assert "max_workers must be greater than 0" in error.message
    assert "Traceback" not in error.message and "site-packages" not in error.message


def test_a_model_litellm_does_not_know_is_registered_with_its_window_and_no_price() -> None:
    litellm = load_litellm()
    local = ModelConfig(name="local", model="openai/registered-by-memproxy", context_window=6000,
                        max_output_tokens=300)
    known = ModelConfig(name="known", model="openai/gpt-4o-mini", context_window=5000)
    mapped_before = litellm.get_model_info(known.model)
    provider = provider_for(local, known)
    info = litellm.get_model_info(local.model)  # it raised before: litellm's map had no such model
    assert (info["max_input_tokens"], info["max_output_tokens"]) == (6000, 300)
    assert provider.cost(local, {"prompt_tokens": 1000, "completion_tokens": 10}) is None  # unknown, not free
    assert litellm.get_model_info(known.model) == mapped_before  # a mapped model is left as it is
    assert provider.cost(known, {"prompt_tokens": 1000, "completion_tokens": 10}) > 0
    # Another config in the same process: registered again with its window; its window must be set.
    again = provider_for(ModelConfig(name="local", model=local.model, context_window=7000))
    assert litellm.get_model_info(local.model)["max_input_tokens"] == 7000
    assert again.cost(local, {"prompt_tokens": 1000, "completion_tokens": 10}) is None
    with pytest.raises(ConfigError):
        provider_for(ModelConfig(name="local", model=local.model))


CANCELLED_CALLS = """
import asyncio, gc, warnings
from memproxy.provider import load_litellm
litellm = load_litellm()

async def cancelled_call():
    call = asyncio.ensure_future(litellm.acompletion(
        model="openai/x", api_base="http://127.0.0.1:9/v1", api_key="k", messages=[{"role": "user", "content": "hi"}]))
    await asyncio.sleep(0)  # one step: the call's set-up is handed to the executor
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_default_executor()  # the set-up has returned its coroutine

def warned(filters_first):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", append=not filters_first)
        asyncio.run(cancelled_call())
        gc.collect()
    return [str(w.message) for w in caught if "never awaited" in str(w.message)]

print(len(warned(False)), len(warned(True)))
"""


def test_a_cancelled_litellm_call_leaves_no_unawaited_coroutine_warning() -> None:
    """litellm runs a call's set-up in an executor, which returns the coroutine that would send it;
    a call cancelled meanwhile leaves that coroutine unawaited, and Python warns as it collects it
    (seen in CI, as an error in whichever test ran then). memproxy silences that one warning: with
    its filter in place nothing is reported, and with every warning shown first, it is."""
    done = subprocess.run([sys.executable, "-c", CANCELLED_CALLS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"], done.stdout + done.stderr

"""The one boundary to providers: completions, streams, model windows, token counters, error mapping.

Each model has a transport: litellm by default, which translates the OpenAI request into the
provider's own API (its OpenAI-compatible providers through litellm's own HTTP handler, not the OpenAI
SDK: `load_litellm`), or memproxy's own OpenAI-compatible client (`memproxy.upstream`) for a model
configured `transport: openai` (or `auto` and written `openai/...`).

litellm is imported when a `Provider` is created (at server start, inside its cleanup context), never
when this module is imported: it costs seconds and hundreds of MB, and `/healthz` and the light CLI
commands never need it. `LITELLM_LOCAL_MODEL_COST_MAP` is set first so the import stays offline.
litellm keeps one HTTP client per provider configuration and reuses it; nothing is set up per request.

litellm's callbacks (observability), off unless configured, are installed here and removed on close
(`memproxy.observability`).

Every client parameter goes through, and none configures litellm. litellm takes its own settings as
keyword arguments beside the request's (where to send it, with which key, which other models to try
if it fails, a canned answer, a provider's credentials): a client able to set them could send the
operator's upstream key to a server of its own. So a parameter is a keyword argument only where
litellm names it as a request parameter (`request_parameters`: the call's signature and, for chat,
what litellm translates for the model's provider, `chat_parameters`), and is allowed even where litellm would refuse
it for an unknown model (for chat, only there: one litellm translates goes in the provider's form
alone, `translated_parameters`); every other one travels in `extra_body`, which litellm puts in the
provider's request as it is and never reads.
One is added: where the provider's API requires `max_tokens` (Anthropic's) and the client set none,
litellm would ask for the model's whole output, so memproxy asks for the output its budget reserved.
memproxy's own requests (summaries) always go through litellm, translated for the model
(`complete_own`).
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import io
import inspect
import json
import logging
import os
import re
import time
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp

from . import observability
from .calibration import Calibration
from .config import Config, ConfigError, ModelConfig
from .errors import ProxyError, UpstreamError
from .inline_setup import inline
from .messages import Message, assistant_message, detached
from .tokens import (TOKENS_PER_MESSAGE, TiktokenCounter, TokenCounter, answer_audio_tokens, attachment_tokens,
                     encoding_name_for, hoisted_image_words, schema_tokens, tool_call_tokens)
from .upstream import (PREFIX, OpenAIUpstream, broke_off, model_id, nothing_streamed, status_error, timed_out,
                       unreachable)

log = logging.getLogger("memproxy")
T = TypeVar("T")

# What a litellm call's signature names that configures the call rather than the request (beside
# litellm's own settings, `litellm.types.utils.all_litellm_params`): where it goes, with which key,
# client and headers, how long it may take. A client's parameter of these names goes in extra_body.
_CALL_SETTINGS = frozenset({"api_key", "api_base", "api_version", "api_type", "base_url", "organization", "project",
                            "default_headers", "extra_headers", "extra_query", "extra_body", "deployment_id",
                            "custom_llm_provider", "timeout", "request_timeout", "max_retries", "client",
                            "shared_session", "model", "args", "kwargs", "aspeech"})
_LITELLM_PREFIX = re.compile(r"^(?:litellm\.\w+: )+\w+Error - ")
_SDK_ERROR = re.compile(r"^Error code: \d{3} - (\{.*\})$", re.DOTALL)  # an error as the OpenAI SDK words it
_QUOTED_MESSAGES = "\nReceived Messages="  # where litellm's Anthropic translation quotes a request it refuses
_MOST_ERROR_TEXT = 65_536  # a longer error text is relayed as it is, not parsed
_LOGGING_FLUSH_SECONDS = 5.0  # at shutdown, litellm's callbacks finish what they were handed
_REGISTERED: set[str] = set()  # the models `register_unmapped` added to litellm's map, in this process
_OPENAI_LIKE = frozenset({"openai", "azure", "aiohttp_openai", "text-completion-openai", "azure_ai"})
# The providers whose call litellm sets up without I/O, so on the loop (`memproxy.inline_setup`):
# OpenAI-compatible ones with a static key, whose message parts go on as they are. Not Anthropic,
# Gemini, Ollama (litellm fetches an image URL to inline it), Vertex, Bedrock, SageMaker, Azure,
# watsonx (credentials or a token may be fetched).
_INLINE_SETUP = frozenset({"openai", "text-completion-openai", "custom_openai", "hosted_vllm", "lm_studio",
                           "openrouter", "deepseek", "groq", "xai", "together_ai", "fireworks_ai"})
Endpoint = Literal["embeddings", "completions", "moderations", "images", "image_edits", "transcriptions", "speech"]
JsonEndpoint = Literal["embeddings", "completions", "moderations", "images"]  # a JSON body both ways
# Each endpoint's path under the provider's base URL, and litellm's function for it.
PATHS: dict[Endpoint, str] = {"embeddings": "embeddings", "completions": "completions",
                              "moderations": "moderations", "images": "images/generations",
                              "image_edits": "images/edits", "transcriptions": "audio/transcriptions",
                              "speech": "audio/speech"}
_LITELLM_CALLS: dict[Endpoint, str] = {"embeddings": "aembedding", "completions": "atext_completion",
                                       "moderations": "amoderation", "images": "aimage_generation",
                                       "image_edits": "aimage_edit", "transcriptions": "atranscription",
                                       "speech": "aspeech"}
# Each call's synchronous twin, whose signature names its request parameters (the async ones take **kwargs).
_SIGNATURES: dict[Endpoint, str] = {"embeddings": "embedding", "completions": "text_completion",
                                    "moderations": "moderation", "images": "image_generation",
                                    "image_edits": "image_edit", "transcriptions": "transcription",
                                    "speech": "speech"}
# The calls that begin by handing their set-up to the executor (`memproxy.inline_setup`) and run in
# place: litellm's moderation call hands nothing off, and an image edit's set-up, which writes the
# uploaded images (megabytes, at times) into the request, stays on litellm's thread.
_HANDED_OFF: frozenset[Endpoint] = frozenset(_LITELLM_CALLS) - {"moderations", "image_edits"}
_SLOW_TOKENIZER_SECONDS = 2.0  # a tokenizer that took this long to load is said so (`LitellmCounter.load`)
TEXT_FORMATS = frozenset({"text", "srt", "vtt"})  # transcriptions answered as text, not JSON
# Form fields that are numbers (`_form_params`): a transcription's temperature, an image edit's counts.
_NUMBER_FIELDS = frozenset({"temperature"})
_INTEGER_FIELDS = frozenset({"n", "output_compression", "partial_images"})


@dataclass(frozen=True)
class UploadedFile:
    """A file part of a form (a transcription's audio, an image to edit), as the client sent it."""

    filename: str
    content: bytes
    content_type: str


# The warning for a litellm completion coroutine that a cancelled call left unawaited (`load_litellm`);
# pyproject.toml's test settings hold the same pattern.
LITELLM_UNAWAITED = r"coroutine '\w+\.a(sync_)?completion' was never awaited"


def load_litellm(observed: bool = True) -> Any:
    """litellm, imported and set up once per process. `observed`: whether callbacks
    (`litellm.callbacks` in the config) will read what litellm logs of each call."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    if not observed:
        # After every call litellm builds a logging payload for its callbacks, and in it a copy of
        # every message with long base64 strings (inline images) cut short: a walk over the whole
        # conversation, some 2 us a message, long after the answer is relayed but on the same event
        # loop as the next turns. With no callback to read it, the copy is skipped (0 turns the
        # cutting off); litellm reads the setting once, at import.
        os.environ.setdefault("MAX_BASE64_LENGTH_FOR_LOGGING", "0")
    # litellm's OpenAI-compatible chat providers through litellm's own HTTP handler (its provider
    # config and its pooled client) instead of the OpenAI SDK, whose request "transform" walks every
    # message against the SDK's type hints: ~0.3 ms a message on every call, the whole history
    # again on every turn. litellm reads the setting at each call; an operator may set it false.
    os.environ.setdefault("EXPERIMENTAL_OPENAI_BASE_LLM_HTTP_HANDLER", "true")
    litellm: Any = importlib.import_module("litellm")
    litellm.suppress_debug_info = True
    litellm.telemetry = False
    # `litellm.acompletion` runs its synchronous set-up in an executor, which hands back the coroutine
    # that makes the HTTP call. A call cancelled meanwhile (its client gone, memproxy stopping) leaves
    # that coroutine unawaited, and Python warns as it collects it, at whatever code runs then.
    # Nothing was sent; only the warning is silenced, for litellm's completion coroutines alone.
    warnings.filterwarnings("ignore", message=LITELLM_UNAWAITED, category=RuntimeWarning)
    # litellm reads a `max_retries` of 0 as unset and retries with its default (its OpenAI embedding
    # call, `max_retries or DEFAULT_MAX_RETRIES`): the client retries, and a proxy that retries too
    # multiplies the wait.
    litellm.DEFAULT_MAX_RETRIES = 0
    # litellm's loggers write a line per call at INFO (twice: their own handler and the root's),
    # request content at DEBUG, and at ERROR multi-line tracebacks whose text quotes the request (a
    # host named in a message's image URL); memproxy logs what matters itself, one line a request,
    # never message content. At memproxy's DEBUG, their warnings and errors are written too. So is
    # the OpenAI SDK's, which litellm calls for OpenAI-compatible providers: it warns with a client's
    # parameter as sent ("Unexpected audio response format: ..."), a new line and all.
    quiet = logging.WARNING if log.isEnabledFor(logging.DEBUG) else logging.CRITICAL
    for name in LITELLM_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
    return litellm


LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "openai")


class LitellmCounter:
    """litellm's counter, for providers whose tokenizer tiktoken does not know. Text parts are
    litellm's to count; media parts are counted as tiktoken's counter counts them
    (`attachment_tokens`): litellm's cannot count audio or files, and would fetch an image URL to
    size it, synchronously, on the event loop. Any other part (a file by id, a refusal, a
    Responses `input_text`), which litellm's counter refuses, is counted as its JSON: a valid
    request is never a 500 for want of a count."""

    sums_lines = False  # an unknown tokenizer: a recall block is counted whole

    def __init__(self, litellm: Any, model: str) -> None:
        self._litellm = litellm
        self._model = model
        self.name = f"litellm:{model}"

    def text(self, text: str) -> int:
        return int(self._litellm.token_counter(model=self._model, text=text))

    def message(self, message: Message) -> int:
        content = message.get("content")
        hoisted = hoisted_image_words(message)
        attached = 0 if hoisted is None else TOKENS_PER_MESSAGE + sum(self.text(word) for word in hoisted)
        if isinstance(content, list):  # only text parts go to litellm's counter
            kept = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    kept.append(part)
                    continue
                tokens = attachment_tokens(part, openai=False)  # another provider's model
                attached += tokens if tokens is not None else self.text(json.dumps(part, separators=(",", ":")))
            if len(kept) < len(content):
                message = {**message, "content": kept or ""}
        heard = answer_audio_tokens(message)
        if heard is not None:  # a spoken answer: its id goes back, and the model hears it again
            attached += heard + self.text(str(message["audio"].get("id") or ""))
            message = {k: v for k, v in message.items() if k != "audio"}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            # litellm's counter reads a function's arguments alone (not its id or name) and refuses
            # any other call (a custom tool's): counted as tiktoken's counter counts them.
            attached += sum(tool_call_tokens(call, self.text) for call in calls)
            message = {k: v for k, v in message.items() if k != "tool_calls"}
        blocks = message.get("thinking_blocks")
        if blocks:  # litellm's counter passes them over; sent back inside a tool exchange, they are read
            attached += self.text(json.dumps(blocks, separators=(",", ":"), ensure_ascii=False))
            message = {k: v for k, v in message.items() if k != "thinking_blocks"}
        return int(self._litellm.token_counter(model=self._model, messages=[message])) - 3 + attached

    def tools(self, tools: Sequence[Any]) -> int:
        """litellm's count of the schemas as OpenAI renders functions, at least their compact JSON
        (as `TiktokenCounter.tools` counts them): litellm renders a function's name, description and
        parameters alone, and passes over the rest, a JSON schema the answer must follow
        (`memory.plan.prompt_schemas`) or a custom tool's grammar, which a provider still reads."""
        if not tools:
            return 0
        with_tools = self._litellm.token_counter(model=self._model, messages=[], tools=list(tools))
        rendered = int(with_tools) - int(self._litellm.token_counter(model=self._model, messages=[]))
        return max(rendered, schema_tokens(tools, self.text))

    def load(self) -> None:
        """Count once, so that litellm picks its tokenizer now. For some model names (Llama 2 and
        3, Cohere's Command R) that is a Hugging Face tokenizer it downloads on first use, with
        retries (about 25 s where there is no network, then it falls back to tiktoken): blocking,
        so at start-up rather than in the first request, with every other one waiting behind it."""
        started = time.perf_counter()
        self.text("memproxy")
        took = time.perf_counter() - started
        if took >= _SLOW_TOKENIZER_SECONDS:
            log.warning("litellm took %.1f s to load the tokenizer for %s (a Hugging Face download, cached"
                        " once it succeeds; where there is no network, HF_HUB_OFFLINE=1 skips it, or set"
                        " the model's tokenizer)", took, self._model)


def resolve_window(litellm: Any, index: int, model: ModelConfig) -> int:
    """`models[index]`'s context window: as configured, else litellm's local model info."""
    if model.context_window is not None:
        return model.context_window
    try:  # not from a window memproxy registered itself (`register_unmapped`): that was another config's
        info = {} if model.model in _REGISTERED else litellm.get_model_info(model.model)
    except Exception:
        info = {}
    window = info.get("max_input_tokens") or info.get("max_tokens")
    if not window:
        raise ConfigError(f"models[{index}].context_window",
                          f"litellm knows no context window for {model.model!r}; set it")
    return int(window)


def provider_problems(config: Config) -> list[ConfigError]:
    """What `Provider` checks at start, without starting anything: every window known (one error per
    model whose window is not), every litellm callback found. litellm is imported only where a model
    sets no window or callbacks are listed (`memproxy check-config` stays light otherwise)."""
    unset = [(index, model) for index, model in enumerate(config.models) if model.context_window is None]
    if not unset and not config.litellm.callbacks:
        return []
    litellm = load_litellm()
    problems = []
    for index, model in unset:
        try:
            resolve_window(litellm, index, model)
        except ConfigError as exc:
            problems.append(exc)
    try:
        observability.resolve(litellm, config.litellm)
    except ConfigError as exc:
        problems.append(exc)
    return problems


class Provider:
    def __init__(self, config: Config, litellm: Any = None) -> None:
        self._litellm = litellm or load_litellm()
        self._openai = OpenAIUpstream()
        self._windows: dict[str, int] = {}
        self._counters: dict[str, TokenCounter] = {}
        self._native: dict[str, bool] = {}
        self._reasoning: dict[str, bool] = {}
        self._fills_max_tokens: dict[str, bool] = {}
        self._unpriced: set[str] = set()
        self._sdk_clients: dict[str, Any] = {}  # `_sdk_client`
        self._sdk_route: dict[str, bool] = {}  # litellm reaches the model through the OpenAI SDK
        self._inline: dict[str, bool] = {}  # litellm sets a call up on the loop (`memproxy.inline_setup`)
        self._chat_parameters: dict[str, frozenset[str]] = {}  # `chat_parameters`
        self._translated: dict[str, frozenset[str]] = {}  # `translated_parameters`
        # How each model's provider counts what memproxy counts (`memory.calibrate_tokens`).
        self.calibration = Calibration(config.memory.calibrate_tokens)
        # The content part types litellm takes in a user message: its own list, which it checks.
        self._user_parts = frozenset(importlib.import_module("litellm.types.llms.openai").ValidUserMessageContentTypes)
        for index, model in enumerate(config.models):
            self._windows[model.name] = resolve_window(self._litellm, index, model)
            self._counters[model.name] = counter = self._make_counter(model)
            if isinstance(counter, LitellmCounter):
                counter.load()
            self._native[model.name] = transport(model) == "openai"
            self._reasoning[model.name] = _provider_of(model) in _OPENAI_LIKE and _reasons(self._litellm, model.model)
            self._fills_max_tokens[model.name] = not self._native[model.name] and _fills_max_tokens(
                self._litellm, model.model)
            provider = _litellm_provider(self._litellm, model.model)
            self._sdk_route[model.name] = provider in ("openai", "text-completion-openai")
            self._inline[model.name] = provider in _INLINE_SETUP
            self._chat_parameters[model.name] = chat_parameters(self._litellm, model)
            self._translated[model.name] = translated_parameters(self._litellm, model)
            register_unmapped(self._litellm, model, self._windows[model.name])
        self._endpoint_parameters = {endpoint: request_parameters(self._litellm, getattr(self._litellm, name))
                                     for endpoint, name in _SIGNATURES.items()}
        self._responses_parameters = request_parameters(self._litellm, self._litellm.aresponses)
        native = [name for name, own in self._native.items() if own]
        self._callbacks = observability.Callbacks.install(self._litellm, config.litellm, unseen=native)

    async def close(self) -> None:
        """Close the HTTP clients (memproxy's and litellm's cached ones); they belong to this loop.
        The callbacks this provider installed leave litellm with it, once litellm's logging worker
        has run what they were handed (a few seconds at most) and stopped."""
        await _stop_logging_worker()
        self._callbacks.remove()
        await self._openai.close()
        for client in self._sdk_clients.values():
            await client.close()
        await self._litellm.close_litellm_async_clients()
        self._litellm.in_memory_llm_clients_cache.flush_cache()
        # Anthropic's streams go through a client litellm creates on first use and keeps module-wide,
        # outside its cache: it belongs to this loop too (a later loop would open a session beside it).
        streaming = vars(self._litellm).pop("module_level_aclient", None)
        if streaming is not None:
            await streaming.close()

    def window(self, model: ModelConfig) -> int:
        return self._windows[model.name]

    def user_part_types(self, model: ModelConfig) -> frozenset[str] | None:
        """The content part types a user message may hold on `model`: on one reached through
        litellm, those it takes (it refuses any other before a provider sees it, as a connection
        error: a 502 clients retry); None (any) on memproxy's own client, which passes every part
        on for the server to judge."""
        return self._user_parts if self.through_litellm(model) else None

    def through_litellm(self, model: ModelConfig) -> bool:
        """Whether a client's chat request to `model` goes through litellm (not memproxy's own client)."""
        return not self._native[model.name]

    def counter(self, model: ModelConfig) -> TokenCounter:
        return self._counters[model.name]

    def reasons(self, model: ModelConfig) -> bool:
        """Whether the model always thinks before it answers, within its output limit: OpenAI's
        reasoning models (o-series, GPT-5), as litellm knows them. Claude and Gemini think only
        when asked, and memproxy's own requests do not ask."""
        return self._reasoning[model.name]

    def cost(self, model: ModelConfig, usage: dict[str, Any] | None) -> float | None:
        """What a call cost upstream, where litellm knows the model's price."""
        prompt, completion = (usage or {}).get("prompt_tokens"), (usage or {}).get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int) or model.model in self._unpriced \
                or model.model in _REGISTERED:  # known to litellm by its window alone
            return None
        try:
            prompt_cost, completion_cost = self._litellm.cost_per_token(
                model=model.model, prompt_tokens=prompt, completion_tokens=completion)
        except Exception:  # an unpriced model (a local server, a custom name): not asked again
            self._unpriced.add(model.model)
            return None
        return float(prompt_cost + completion_cost)

    def _make_counter(self, model: ModelConfig) -> TokenCounter:
        tokenizer: str = model.tokenizer  # an encoding's name once `auto` is resolved
        if tokenizer == "auto":
            tokenizer = encoding_name_for(model.model) if _provider_of(model) in _OPENAI_LIKE else "litellm"
        if tokenizer == "litellm":
            return LitellmCounter(self._litellm, model.model)
        return TiktokenCounter(tokenizer)

    def _kwargs(self, model: ModelConfig, messages: list[Message], params: dict[str, Any]) -> dict[str, Any]:
        """A chat call's arguments for litellm (`litellm_kwargs`), its messages included."""
        kwargs = litellm_kwargs(model, params, self._chat_parameters[model.name])
        # Only what litellm would drop or refuse for the model is forced through
        # (`allowed_openai_params`): what it translates for the provider, or handles itself
        # (`stream_options`), forced too, went to the provider as it came beside litellm's
        # translation, and a provider whose API is not OpenAI's refuses it (Anthropic a `user` or a
        # `max_completion_tokens` beside the `metadata.user_id` and `max_tokens` litellm makes of
        # them; Anthropic and Mistral the `stream_options` memproxy asks a recorded stream's usage
        # by: every such streamed turn was a 400).
        kwargs["allowed_openai_params"] = [name for name in kwargs["allowed_openai_params"]
                                           if name not in self._translated[model.name]]
        kwargs["messages"] = [detached(m) for m in messages]  # litellm may rewrite them; they are shared
        if self._fills_max_tokens[model.name] and params.get("max_tokens") is None \
                and params.get("max_completion_tokens") is None:
            # litellm would ask for the model's whole output (64,000 tokens for a Claude), and
            # Anthropic refuses a request whose input and max_tokens together exceed the window:
            # ask for what the budget reserved instead (`memory.plan.output_reserve`'s default).
            kwargs["max_tokens"] = min(model.max_output_tokens, self._windows[model.name] - 1)
        return kwargs

    async def complete(self, model: ModelConfig, messages: list[Message], params: dict[str, Any]) -> dict[str, Any]:
        if self._native[model.name]:
            return await self._openai.complete(model, messages, params)
        try:
            response = await _whole_within(model.timeout_seconds,
                                           self._acompletion(model, self._kwargs(model, messages, params)))
        except Exception as exc:
            raise self.upstream_error(exc) from exc
        result: dict[str, Any] = response.model_dump(exclude_none=True)
        for choice in result.get("choices") or ():
            if isinstance(choice, dict):
                _as_openai_choice(choice)
        return result

    async def complete_own(self, model: ModelConfig, messages: list[Message], params: dict[str, Any]
                           ) -> dict[str, Any]:
        """A request of memproxy's own (a summary), whatever the model's transport: through litellm,
        which translates its parameters for the model (`max_tokens` becomes `max_completion_tokens`
        for OpenAI's reasoning models) and drops those the model refuses (a `temperature` other
        than 1 there). A client's keeps those for the provider to judge (`_kwargs`); this one is
        memproxy's to adapt."""
        kwargs = self._kwargs(model, messages, params)
        del kwargs["allowed_openai_params"]
        try:
            response = await self._acompletion(model, {**kwargs, "drop_params": True})
        except Exception as exc:
            raise self.upstream_error(exc) from exc
        result: dict[str, Any] = response.model_dump(exclude_none=True)
        return result

    async def stream(
        self, model: ModelConfig, messages: list[Message], params: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks as dicts; the first is awaited before this returns, so early errors raise here."""
        if self._native[model.name]:
            return await self._openai.stream(model, messages, params)
        kwargs = self._kwargs(model, messages, {**params, "stream": True})
        refusals = _Refusals()
        return refusals.restored(await self._first_chunk(refusals.tapped(self._acompletion(model, kwargs)),
                                                         _dumped_chunk))

    async def _first_chunk(self, call: Awaitable[Any], dump: Callable[[Any], dict[str, Any]]
                           ) -> AsyncGenerator[dict[str, Any], None]:
        """litellm's stream of `call` (chat chunks or Responses events), each as `dump` makes it a
        dict; its first item is awaited here, so that an early error raises before anything is
        sent to the client."""
        try:
            response = await call
            iterator = response.__aiter__()
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise nothing_streamed() from None
        except Exception as exc:
            if _caused_by(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):  # litellm: a 500
                raise UpstreamError("upstream stream broke off", code="upstream_incomplete") from exc
            raise self.upstream_error(exc) from exc
        # A first chunk that ends a stream its provider never began ([DONE] alone) raises here too.
        return _chunks(_finished_by_provider(first, dump(first), iterator), iterator, self, dump)

    # --- the other OpenAI endpoints, passed through: `params` is the client's body, whose `model`
    # the model's provider name replaces. memproxy's own client relays them to an OpenAI-compatible
    # provider as they are; litellm translates them for any other (and answers in its own types).

    async def call(self, endpoint: JsonEndpoint, model: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
        """The answer of an endpoint that answers one JSON object."""
        if self._native[model.name]:
            raw, _ = await self._openai.request(model, PATHS[endpoint], params)
            return _json_object(raw)
        response = await self._call_litellm(endpoint, model, params)
        result: dict[str, Any] = response.model_dump(exclude_none=True)
        return result

    async def text_stream(self, model: ModelConfig, params: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """A streamed legacy completion's chunks, as `stream`'s; the first is awaited here."""
        params = {**params, "stream": True}
        if self._native[model.name]:
            return await self._openai.stream_at(model, PATHS["completions"], params)
        return await self._first_chunk(self._call_litellm("completions", model, params), _dumped_chunk)

    async def transcribe(self, model: ModelConfig, fields: Sequence[tuple[str, str]], audio: UploadedFile
                         ) -> dict[str, Any] | str:
        """A transcription: a JSON object, or the text itself for the text formats (`text`, `srt`,
        `vtt`). `fields` are the form's other fields, `model` among them, as the client sent them."""
        text_format = dict(fields).get("response_format") in TEXT_FORMATS
        if self._native[model.name]:
            form = aiohttp.FormData(quote_fields=False)  # the file's name as the client wrote it
            for name, value in fields:
                form.add_field(name, model_id(model) if name == "model" else value)
            form.add_field("file", audio.content, filename=audio.filename, content_type=audio.content_type)
            raw, content_type = await self._openai.request(model, PATHS["transcriptions"], form)
            if text_format or content_type != "application/json":
                return raw.decode("utf-8", "replace")
            return _json_object(raw)
        params = {**_form_params(fields), "file": (audio.filename, audio.content, audio.content_type)}
        # OpenAI's default format, said outright: left unset, litellm asks for `verbose_json`.
        params.setdefault("response_format", "json")
        response = await self._call_litellm("transcriptions", model, params)
        if text_format:
            return str(response.text)
        result: dict[str, Any] = response.model_dump(exclude_none=True)
        return result

    async def edit_image(self, model: ModelConfig, fields: Sequence[tuple[str, str]],
                         files: Sequence[tuple[str, UploadedFile]]) -> dict[str, Any]:
        """An image edit: `fields` are the form's fields, `model` among them, and `files` its file
        parts by field name (`image`, or `image[]` for several, and `mask`), as the client sent them."""
        if self._native[model.name]:
            form = aiohttp.FormData(quote_fields=False)  # the files' names as the client wrote them
            for name, value in fields:
                form.add_field(name, model_id(model) if name == "model" else value)
            for name, upload in files:
                form.add_field(name, upload.content, filename=upload.filename, content_type=upload.content_type)
            raw, _ = await self._openai.request(model, PATHS["image_edits"], form)
            return _json_object(raw)
        params = _form_params(fields)
        # As files: litellm's HTTP client reads each part (a tuple it cannot send), and names them itself.
        images = [_readable(f) for name, f in files if name in ("image", "image[]")]
        params["image"] = images if len(images) > 1 or any(name == "image[]" for name, _ in files) else images[0]
        for name, upload in files:
            if name == "mask":
                params["mask"] = _readable(upload)
        response = await self._call_litellm("image_edits", model, params)
        result: dict[str, Any] = response.model_dump(exclude_none=True)
        return result

    async def speak(self, model: ModelConfig, params: dict[str, Any]) -> tuple[str, AsyncGenerator[bytes, None]]:
        """Speech: its content type and its bytes as they come (litellm's arrive whole)."""
        if self._native[model.name]:
            response = await self._openai.open(model, PATHS["speech"], params)
            return response.content_type, _bytes(response, model)
        answer = await self._call_litellm("speech", model, params)
        content_type = answer.response.headers.get("content-type", "application/octet-stream")
        return content_type.split(";")[0].strip(), _whole(answer.content)

    async def _call_litellm(self, endpoint: Endpoint, model: ModelConfig, params: dict[str, Any]) -> Any:
        # `max_retries: 0` as for chat; litellm's OpenAI image and moderation calls retry regardless.
        kwargs = litellm_kwargs(model, params, self._endpoint_parameters[endpoint])
        if endpoint != "images" and self._sdk_route[model.name]:
            # For an OpenAI-compatible provider litellm calls the OpenAI SDK, with a client of its
            # own that retries moderations whatever `max_retries` says, and for a plain legacy
            # completion a new client (and aiohttp session) every call, never closed: one client
            # per model instead, without retries, closed with the provider. Not for images: that
            # call sets the client's retries to 2 (so it retries a 5xx twice on this route), and
            # the client is shared.
            kwargs["client"] = self._sdk_client(model)
        try:
            call = getattr(self._litellm, _LITELLM_CALLS[endpoint])
            with inline(self._inline[model.name] and endpoint in _HANDED_OFF):
                return await _whole_within(model.timeout_seconds, call(**kwargs))
        except Exception as exc:
            raise self.upstream_error(exc) from exc

    def _sdk_client(self, model: ModelConfig) -> Any:
        client = self._sdk_clients.get(model.name)
        if client is None:
            # The OpenAI SDK's client, as litellm would make it, without its retries. A provider
            # that wants no key still gets one: the SDK refuses to start without. The model's own
            # headers are the client's: litellm's moderation call passes on no `extra_headers`.
            sdk: Any = importlib.import_module("openai")  # litellm's own dependency, loaded with it
            client = sdk.AsyncOpenAI(api_key=model.api_key or os.environ.get("OPENAI_API_KEY") or "none",
                                     base_url=model.api_base, max_retries=0, timeout=model.timeout_seconds,
                                     default_headers=dict(model.headers) or None)
            self._sdk_clients[model.name] = client
        return client

    async def _acompletion(self, model: ModelConfig, kwargs: dict[str, Any]) -> Any:
        try:
            with inline(self._inline[model.name] and not _fetches(kwargs["messages"])):
                return await self._litellm.acompletion(**kwargs)
        except Exception as exc:
            if not _caused_by(exc, UnicodeEncodeError):
                raise
        # The OpenAI SDK's client (which litellm still uses for Azure, and for OpenAI where
        # EXPERIMENTAL_OPENAI_BASE_LLM_HTTP_HANDLER is set false) encodes the body as UTF-8, which
        # refuses a lone surrogate (a provider's earlier answer, stored as it came and sent again);
        # the request never left, so it goes now with each one as U+FFFD.
        return await self._litellm.acompletion(**{**kwargs, "messages": _without_surrogates(kwargs["messages"])})

    # --- the Responses API (`memproxy.responses`): input items become chat messages by litellm's own
    # bridge, so memory keeps them like any chat message; a model with `responses_api: native` is
    # then called on its provider's Responses API through litellm, every other one as a chat
    # completion (on its transport, as chat is).

    def responses_messages(self, items: str | list[dict[str, Any]], instructions: str | None) -> list[Message]:
        """Responses input items (and `instructions`, a leading system message) as chat messages:
        consecutive function calls join the assistant message before them, reasoning items become
        that message's `reasoning_content`, function call outputs become tool messages. A custom
        tool's call, which the bridge makes a function's taking `{"content": input}`, is kept as
        chat's custom tool call (`{"type": "custom", "custom": {"name", "input"}}`), as it came."""
        bridge = _responses_bridge()
        raw = bridge.transform_responses_api_input_to_messages(
            input=items, responses_api_request={"instructions": instructions} if instructions else {},
            replay_reasoning=True)
        messages = _files_kept([_plain_message(m) for m in raw], items)
        custom = {item.get("call_id"): item for item in items if isinstance(item, dict)
                  and item.get("type") == "custom_tool_call"} if isinstance(items, list) else {}
        return [_custom_calls_kept(m, custom) for m in messages] if custom else messages

    def responses_chat_params(self, model: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
        """A Responses request's parameters (`tools`, `tool_choice`, `text`, `reasoning`,
        `max_output_tokens`, ...) as a chat completion's, translated by litellm's bridge, and those
        chat completions take too that the bridge leaves out (`_CHAT_TOO`, `text.verbosity`, the
        logprobs `include` asks for): dropped, they would be ignored without a word."""
        request = _responses_bridge().transform_responses_api_request_to_chat_completion_request(
            model=model.model, input=[], responses_api_request=params)
        chat = {k: v for k, v in request.items() if k not in ("messages", "model", "stream", "stream_options")}
        # Where the bridge falls short of what chat completions take: `reasoning` goes as it came
        # (`{"effort", "summary"}`), but `reasoning_effort` is a string there and a summary has no
        # chat form; `max_output_tokens` goes as `max_tokens`, which OpenAI's reasoning models refuse
        # (litellm renames it on its own path, not on memproxy's client); a JSON schema's
        # `description` is left out.
        effort = chat.get("reasoning_effort")
        if isinstance(effort, dict):
            if isinstance(effort.get("effort"), str):
                chat["reasoning_effort"] = effort["effort"]
            else:
                del chat["reasoning_effort"]
        if self._reasoning[model.name] and "max_tokens" in chat:
            chat["max_completion_tokens"] = chat.pop("max_tokens")
        text = params.get("text")
        wanted = text.get("format") if isinstance(text, dict) else None
        schema = (chat.get("response_format") or {}).get("json_schema")
        if isinstance(wanted, dict) and isinstance(wanted.get("description"), str) and isinstance(schema, dict):
            chat["response_format"] = {**chat["response_format"],
                                       "json_schema": {**schema, "description": wanted["description"]}}
        for name in _CHAT_TOO:
            if params.get(name) is not None:
                chat.setdefault(name, params[name])
        if isinstance(text, dict) and text.get("verbosity") is not None:
            chat.setdefault("verbosity", text["verbosity"])
        include = params.get("include")
        if params.get("top_logprobs") is not None or (isinstance(include, list)
                                                      and "message.output_text.logprobs" in include):
            chat.setdefault("logprobs", True)
        return chat

    async def respond(self, model: ModelConfig, items: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        """A Response from the provider's own Responses API (`litellm.aresponses`), as a dict."""
        try:
            response = await _whole_within(model.timeout_seconds,
                                           self._litellm.aresponses(**self._responses_kwargs(model, items, params)))
        except Exception as exc:
            raise self.upstream_error(exc) from exc
        result: dict[str, Any] = _dumped(response)
        return result

    async def respond_stream(self, model: ModelConfig, items: list[dict[str, Any]], params: dict[str, Any]
                             ) -> AsyncGenerator[dict[str, Any], None]:
        """The provider's Responses stream, its events as dicts; the first is awaited here."""
        kwargs = {**self._responses_kwargs(model, items, params), "stream": True}
        return await self._first_chunk(self._litellm.aresponses(**kwargs), _dumped)

    def _responses_kwargs(self, model: ModelConfig, items: list[dict[str, Any]], params: dict[str, Any]
                          ) -> dict[str, Any]:
        """`litellm.aresponses`'s arguments: the parameters it names, the others in `extra_body`;
        the model's provider name, endpoint, key and timeout."""
        named = self._responses_parameters
        kwargs: dict[str, Any] = {k: v for k, v in params.items()
                                  if k in named and k not in ("model", "input") and v is not None}
        extra = {k: v for k, v in params.items() if k not in named and k != "model"}
        if extra:
            kwargs["extra_body"] = extra
        return {**kwargs, **_target(model), "input": items}

    def upstream_error(self, exc: Exception) -> ProxyError:
        if isinstance(exc, ProxyError):
            return exc
        litellm = self._litellm
        # litellm prefixes the provider's words with its own class names; keep the provider's.
        message = str(getattr(exc, "message", None) or exc).split("Exception - ", 1)[-1].strip()
        message = _LITELLM_PREFIX.sub("", message)  # "litellm.ContextWindowExceededError: ... AnthropicError - "
        # An error litellm met in its own code carries the traceback in its text: the server's paths
        # and code are nobody's business but the operator's (who sees them at DEBUG).
        message = message.split("Traceback (most recent call last)", 1)[0].strip() or "upstream call failed"
        # A request litellm could not translate for Anthropic is refused with every message it was
        # to send quoted after the reason: the stored history, summary and recalled text among them.
        message = message.split(_QUOTED_MESSAGES, 1)[0].strip() or "upstream call failed"
        code, param = getattr(exc, "code", None), getattr(exc, "param", None)
        # litellm's own HTTP handler hands on the provider's error body as it came: its message.
        body_message, body_code, body_param = _error_body(message)
        if body_message is not None:
            message, code, param = body_message, body_code or code, body_param or param
        if isinstance(exc, litellm.ContextWindowExceededError):  # each provider says it its own way
            code = "context_length_exceeded"
        if isinstance(exc, litellm.Timeout) or _caused_by(exc, (asyncio.TimeoutError,)):
            # aiohttp's read timeout (no chunk for the timeout) is a connection error too: it is a timeout
            return UpstreamError(f"upstream timed out: {message}", status=504, code="upstream_timeout")
        if isinstance(exc, litellm.APIConnectionError) or "Connection error" in message \
                or _caused_by(exc, (ConnectionError, aiohttp.ClientConnectionError)):
            # litellm's words quote a connection error's, which name the operator's upstream host:
            # where one is the cause, it is told as memproxy's own client tells it.
            cause = _cause(exc, (ConnectionError, aiohttp.ClientError))
            if cause is not None:
                return unreachable(cause)
            return UpstreamError(f"upstream unreachable: {message}", status=502, code="upstream_unreachable")
        headers = getattr(exc, "litellm_response_headers", None) or getattr(getattr(exc, "response", None),
                                                                            "headers", None)
        return status_error(getattr(exc, "status_code", None), message, code, param,
                            headers if isinstance(headers, Mapping) else None)


async def _whole_within(seconds: float, call: Awaitable[T]) -> T:
    """A plain litellm call bounded whole by the model's `timeout_seconds`, as memproxy's own client
    bounds it: litellm's timeout bounds each read, so a provider sending a byte now and then held
    the request, and its session's lock, for as long as it liked."""
    try:
        async with asyncio.timeout(seconds):
            return await call
    except TimeoutError:
        raise timed_out(seconds) from None


async def _stop_logging_worker() -> None:
    """litellm runs its success and failure callbacks from a worker task it starts on the loop of
    its first call and keeps module-wide; left running, it outlives the loop, and Python reports
    "Event loop is closed" when it is collected. Its public `flush` and `stop`, where it runs on this
    loop (a worker of an earlier loop is that loop's to stop)."""
    worker = getattr(importlib.import_module("litellm.litellm_core_utils.logging_worker"),
                     "GLOBAL_LOGGING_WORKER", None)
    if worker is None:
        return
    try:
        await asyncio.wait_for(worker.flush(), _LOGGING_FLUSH_SECONDS)
    except (asyncio.TimeoutError, RuntimeError):  # callbacks that hang; a queue of another loop
        pass
    try:
        await worker.stop()
    except RuntimeError:  # tasks of another, closed loop
        pass


def _error_body(text: str) -> tuple[str | None, str | None, str | None]:
    """The message, code and parameter of an OpenAI-shaped error body, where `text` is one: as the
    provider sent it (JSON), or as the OpenAI SDK words it, where litellm calls through the SDK
    ("Error code: 400 - " and the body as a Python literal)."""
    sdk = _SDK_ERROR.match(text)
    try:
        if sdk is not None and len(text) <= _MOST_ERROR_TEXT:
            body = ast.literal_eval(sdk.group(1))  # literals only: nothing of the text is run
        elif text.startswith("{"):
            body = json.loads(text)
        else:
            return None, None, None
        error = body.get("error")
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, AttributeError):
        return None, None, None
    if isinstance(error, str):
        return error, None, None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None, None, None
    code, param = error.get("code"), error.get("param")
    return error["message"], code if isinstance(code, str) else None, param if isinstance(param, str) else None


def request_parameters(litellm: Any, call: Callable[..., Any], supported: Sequence[str] = ()) -> frozenset[str]:
    """The request parameters litellm takes as keyword arguments for `call` (whose signature names
    them) and `supported` (those it translates for a provider), less its own settings and the
    call's (`_CALL_SETTINGS`): the names a client's parameter may have to be passed as one."""
    own = importlib.import_module("litellm.types.utils").all_litellm_params
    named = set(inspect.signature(call).parameters) | set(supported)
    return frozenset(named - set(own) - _CALL_SETTINGS)


def chat_parameters(litellm: Any, model: ModelConfig) -> frozenset[str]:
    """A chat call's request parameters for `model`: OpenAI's, those litellm translates for the
    model's provider (`thinking`, `reasoning_effort`, ...), and the provider's own generation
    parameters that litellm's config for it names (`top_k`, Ollama's `num_ctx`, ...)."""
    try:
        supported = litellm.get_supported_openai_params(model=model.model) or []
    except Exception:  # a provider litellm has no list for: OpenAI's parameters
        supported = []
    translated = [*litellm.OPENAI_CHAT_COMPLETION_PARAMS, *supported, *_provider_parameters(litellm, model)]
    # `completion` reads a parameter it names in its signature, and passes on to the provider one it
    # does not count as OpenAI's; one it counts as OpenAI's without naming it is read by nothing and
    # dropped without a word (litellm 1.100: `prompt_cache_retention`, the Vercel AI SDK's
    # `promptCacheRetention`). Such a name goes in `extra_body`, as the client sent it.
    unread = set(litellm.OPENAI_CHAT_COMPLETION_PARAMS) - set(inspect.signature(litellm.completion).parameters)
    return request_parameters(litellm, litellm.completion, [name for name in translated if name not in unread])


def translated_parameters(litellm: Any, model: ModelConfig) -> frozenset[str]:
    """The OpenAI parameters litellm takes for `model` without being told to: those it translates
    for the model's provider, and `stream_options`, which it handles itself (its stream returns
    the usage asked for, counted where the provider sends none) and sends on only to a provider
    that takes it. Any other it drops or refuses unless a call allows it."""
    try:  # by the name and provider litellm checks a call's parameters by, as `chat_parameters` is not
        name, provider, _, _ = litellm.get_llm_provider(model.model)
        supported = litellm.get_supported_openai_params(model=name, custom_llm_provider=provider) or []
    except Exception:  # a provider litellm has no list for
        supported = []
    return frozenset(supported) | {"stream_options"}


def _provider_parameters(litellm: Any, model: ModelConfig) -> list[str]:
    """The parameters litellm's chat config for the model's provider declares (its fields)."""
    found = _chat_config(litellm, model.model)
    if found is None:
        return []
    fields: dict[str, Any] = {}
    for klass in type(found[1]).__mro__:
        fields.update(getattr(klass, "__annotations__", {}))
    return [name for name in fields if not name.startswith("_")]


def _chat_config(litellm: Any, model: str) -> tuple[str, Any] | None:
    """litellm's name for `model` without its provider, and its provider's chat config (None: a
    provider litellm has no chat config for)."""
    try:
        name, provider, _, _ = litellm.get_llm_provider(model)
        return name, litellm.utils.ProviderConfigManager.get_provider_chat_config(
            model=name, provider=litellm.LlmProviders(provider))
    except Exception:
        return None


def litellm_kwargs(model: ModelConfig, params: dict[str, Any], named: frozenset[str]) -> dict[str, Any]:
    """A call's arguments for litellm: the client's parameters (those litellm names as request
    parameters, `named`, as keyword arguments, each allowed, as litellm would refuse some for a model
    it does not know; every other one in `extra_body`), the model's provider name, endpoint, key and
    timeout, and no retries (the client retries; a proxy that retries too multiplies the wait). The
    body's own `model` is the client's name for it, replaced here. A parameter litellm names that
    is null is left out: null means the default, which for litellm is the parameter left unset
    (given `None`, it reads some as set: `web_search_options` made it raise, a 502)."""
    native = {k: v for k, v in params.items() if k in named and v is not None}
    extra = {k: v for k, v in params.items() if k not in named and k != "model"}
    kwargs: dict[str, Any] = {**native, **_target(model), "max_retries": 0, "allowed_openai_params": list(native)}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def _target(model: ModelConfig) -> dict[str, Any]:
    """Where and how litellm calls the model: its provider name, endpoint, key, timeout and the
    model's own headers (`models[].headers`; a client's `extra_headers` never reach here)."""
    target: dict[str, Any] = {"model": model.model, "timeout": model.timeout_seconds}
    if model.api_base:
        target["api_base"] = model.api_base
    if model.api_key:
        target["api_key"] = model.api_key
    if model.headers:
        target["extra_headers"] = dict(model.headers)
    return target


def _fetches(messages: list[Message]) -> bool:
    """Whether litellm's OpenAI set-up downloads something for `messages`: a user message's `file`
    part whose `file_id` is a URL (it sends the file's bytes instead, fetched with its SSRF checks
    and a timeout); such a call keeps the executor's thread."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and message.get("role") == "user":
            for part in content:
                file = part.get("file") if isinstance(part, dict) and part.get("type") == "file" else None
                file_id = file.get("file_id") if isinstance(file, dict) else None
                if isinstance(file_id, str) and file_id.startswith(("https://", "http://", "www.")):
                    return True
    return False


def _litellm_provider(litellm: Any, name: str) -> str | None:
    """The provider litellm calls `name` through (`gpt-4o`: openai, `claude-...`: anthropic)."""
    try:
        provider: str = litellm.get_llm_provider(name)[1]
    except Exception:
        return None
    return provider


def _provider_of(model: ModelConfig) -> str:
    """litellm's provider prefix of a model string (`openai` where there is none)."""
    return model.model.split("/", 1)[0] if "/" in model.model else "openai"


def register_unmapped(litellm: Any, model: ModelConfig, window: int) -> None:
    """Register a model litellm's model map lacks (a local server's, a custom name) with its window
    and output limit, and no price (`Provider.cost` still says it is unknown). litellm looks each
    call's model up in that map twice, for the call's cost and for its logging payload, and caches
    only a model it finds: one it lacks is searched for again each time, under every name and
    provider it might be mapped by (measured: 70 us a lookup, 0.5 us once registered). A mapped
    model is left as litellm has it; one registered before (by another provider in this process)
    is registered again, with this window."""
    if model.model not in _REGISTERED:
        try:
            litellm.get_model_info(model.model)
            return
        except Exception:
            pass
    try:
        provider = litellm.get_llm_provider(model.model)[1]
    except Exception:  # not a model litellm can call: nothing to look up either
        return
    litellm.register_model({model.model: {"max_input_tokens": window, "max_output_tokens": model.max_output_tokens,
                                          "litellm_provider": provider, "mode": "chat"}})
    _REGISTERED.add(model.model)


def _reasons(litellm: Any, name: str) -> bool:
    try:
        return bool(litellm.supports_reasoning(model=name))
    except Exception:  # a model litellm does not know: it is not told to think
        return False


def _readable(upload: UploadedFile) -> io.BytesIO:
    """An uploaded file as a file object, named as the client named it."""
    readable = io.BytesIO(upload.content)
    readable.name = upload.filename
    return readable


def _form_params(fields: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """A form's fields as litellm's keyword arguments: numbers as numbers, `name[]` as a list."""
    params: dict[str, Any] = {}
    for name, value in fields:
        if name.endswith("[]"):
            params.setdefault(name[:-2], []).append(value)
        elif name in _NUMBER_FIELDS or name in _INTEGER_FIELDS:
            try:
                params[name] = int(value) if name in _INTEGER_FIELDS else float(value)
            except ValueError:
                params[name] = value  # the provider says what is wrong with it
        else:
            params[name] = value
    return params


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        result = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise UpstreamError("upstream answered with invalid JSON") from None
    if not isinstance(result, dict):
        raise UpstreamError("upstream answered with JSON that is not an object")
    if isinstance(result.get("error"), dict):
        raise status_error(None, str(result["error"].get("message") or "upstream error"),
                           result["error"].get("code"))
    return result


async def _bytes(response: aiohttp.ClientResponse, model: ModelConfig) -> AsyncGenerator[bytes, None]:
    try:
        async for data in response.content.iter_any():
            yield data
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
        raise timed_out(model.timeout_seconds) from None
    except aiohttp.ClientError as exc:
        raise broke_off(exc) from exc
    finally:
        response.release()


async def _whole(content: bytes) -> AsyncGenerator[bytes, None]:
    yield content
def _fills_max_tokens(litellm: Any, model: str) -> bool:
    """Whether litellm sends `model` a `max_tokens` of its own when the request sets none: providers
    whose API requires one (Anthropic's, on its own API or Vertex) get the model's maximum output."""
    found = _chat_config(litellm, model)
    if found is None:  # a provider litellm has no chat config for: it adds nothing either
        return False
    name, config = found
    try:
        try:
            defaults = config.get_config(model=name)
        except TypeError:  # most providers' defaults do not depend on the model
            defaults = config.get_config()
    except Exception:
        return False
    return defaults.get("max_tokens") is not None


def _caused_by(exc: BaseException | None, kinds: type[BaseException] | tuple[type[BaseException], ...]) -> bool:
    """Whether an exception of `kinds` is what `exc` comes from (litellm wraps its causes twice or more)."""
    return _cause(exc, kinds) is not None


def _cause(exc: BaseException | None, kinds: type[BaseException] | tuple[type[BaseException], ...]
           ) -> BaseException | None:
    """The exception of `kinds` that `exc` comes from, if any (`_caused_by`)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, kinds):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _without_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_without_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_surrogates(v) for k, v in value.items()}
    return value


Route = Literal["openai", "litellm"]


def transport(model: ModelConfig) -> Route:
    """`litellm` (the default) or `openai` (memproxy's own client), as configured; `auto` picks the
    own client for litellm's `openai/` provider, which means the OpenAI API at `api_base`."""
    if model.transport != "auto":
        return model.transport
    return "openai" if model.model.startswith(PREFIX) else "litellm"


def _as_openai_choice(choice: dict[str, Any]) -> None:
    """A choice of litellm's answer as OpenAI's API gives it. litellm's model has no `refusal`: it
    puts a provider's refusal among the message's `provider_specific_fields`, where an OpenAI
    client (structured outputs' `message.refusal`) never looks. Its dump leaves out what is null,
    and OpenAI's answer says `content: null` beside tool calls and `logprobs: null`: a client may
    test for null, not for a missing key: a provider's `refusal: null` stays where it was."""
    if not choice.get("provider_specific_fields"):
        choice.pop("provider_specific_fields", None)  # litellm's, empty: no provider sent it
    choice.setdefault("finish_reason", None)
    _with_null_logprobs(choice)
    message = choice.get("message")
    if not isinstance(message, dict):
        return
    extra = message.get("provider_specific_fields")
    if isinstance(extra, dict):
        if "refusal" in extra and message.get("refusal") is None:
            message["refusal"] = extra.pop("refusal")
        if not extra:
            del message["provider_specific_fields"]
    message.setdefault("content", None)


def _with_null_logprobs(choice: dict[str, Any]) -> None:
    """A chat choice's `logprobs` as OpenAI's say them: null, or both `content` and `refusal`, null
    where they are (litellm's dump leaves a null one out: a client may test `refusal !== null`)."""
    logprobs = choice.setdefault("logprobs", None)
    if isinstance(logprobs, dict):
        logprobs.setdefault("content", None)
        logprobs.setdefault("refusal", None)


def _dumped_chunk(chunk: Any) -> dict[str, Any]:
    """A stream chunk as a dict, each choice with the null fields OpenAI's chunks carry (`finish_reason`
    and `logprobs`, a legacy completion's `text`). litellm gives the usage chunk
    (`stream_options.include_usage`) a choice with an empty delta; OpenAI's has no choice, and
    clients tell it by that."""
    result: dict[str, Any] = chunk.model_dump(exclude_none=True)
    choices = result.get("choices")
    if not isinstance(choices, list):
        return result
    if "usage" in result and all(
            isinstance(c, dict) and not c.get("delta") and not c.get("text") and c.get("finish_reason") is None
            and c.get("logprobs") is None for c in choices):
        result["choices"] = []
    text = result.get("object") == "text_completion"
    for choice in result["choices"]:
        if isinstance(choice, dict):
            choice.setdefault("finish_reason", None)
            if text:
                choice.setdefault("logprobs", None)
                choice.setdefault("text", "")
            else:
                _with_null_logprobs(choice)
    return result


class _Refusals:
    """A stream's refusal deltas, which litellm's stream wrapper drops. OpenAI streams a refusal
    (structured outputs, a model declining) in chunks whose delta holds `refusal` and no content,
    and the wrapper (1.100) passes a chunk on only if it holds content, calls, reasoning or the
    like: the client was sent an empty answer, and that was stored. So the provider's chunks are
    read as they reach the wrapper (`tapped`), each refusal noted with the chunk it came in, and
    put back in the stream before the chunk the wrapper passes on next, unless that chunk is the
    one that carried it (`restored`)."""

    def __init__(self) -> None:
        self._noted: list[dict[str, Any]] = []
        self._raw: Any = None  # the provider's stream, as litellm made it
        self._iterator: AsyncIterator[Any] | None = None

    async def tapped(self, call: Awaitable[Any]) -> Any:
        """litellm's stream, reading the provider's chunks through this first."""
        response = await call
        if getattr(response, "completion_stream", None) is not None:
            self._raw = response.completion_stream
            response.completion_stream = self
        return response

    def __aiter__(self) -> _Refusals:
        # The wrapper starts an `async for` over the provider's stream for each chunk it returns, as
        # the provider's stream allows (its `__aiter__` sets it up, each time).
        assert self._raw is not None
        self._iterator = self._raw.__aiter__()
        return self

    def __getattr__(self, name: str) -> Any:  # the wrapper closes the provider's stream (`aclose`) through this
        if name.startswith("__") or self.__dict__.get("_raw") is None:
            raise AttributeError(name)
        return getattr(self.__dict__["_raw"], name)

    async def __anext__(self) -> Any:
        assert self._iterator is not None
        chunk = await self._iterator.__anext__()
        for choice in getattr(chunk, "choices", None) or ():
            refusal = getattr(getattr(choice, "delta", None), "refusal", None)
            if isinstance(refusal, str) and refusal:
                self._noted.append({
                    **{k: getattr(chunk, k) for k in ("id", "object", "created", "model")
                       if getattr(chunk, k, None) is not None},
                    "choices": [{"index": getattr(choice, "index", 0), "delta": {"refusal": refusal},
                                 "finish_reason": None, "logprobs": None}]})
        return chunk

    async def restored(self, chunks: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async for chunk in chunks:
                carried = {(c.get("index"), (c.get("delta") or {}).get("refusal"))
                           for c in chunk.get("choices") or () if isinstance(c, dict)}
                for noted in self._noted:
                    choice = noted["choices"][0]
                    if (choice["index"], choice["delta"]["refusal"]) not in carried:
                        yield noted
                self._noted.clear()
                yield chunk
            for noted in self._noted:
                yield noted
            self._noted.clear()
        finally:
            await chunks.aclose()  # a client gone: the provider's stream is closed now, not when collected


async def _chunks(
    first: dict[str, Any], rest: AsyncIterator[Any], provider: Provider, dump: Callable[[Any], dict[str, Any]]
) -> AsyncGenerator[dict[str, Any], None]:
    yield first
    try:
        noted = getattr(rest, "received_finish_reason", None)  # as it stood once the chunk before came
        async for chunk in rest:
            yield _finished_by_provider(chunk, dump(chunk), rest, noted)
            noted = getattr(rest, "received_finish_reason", None)
    except UpstreamError:
        raise
    except Exception as exc:
        if _caused_by(exc, (aiohttp.ClientPayloadError, ConnectionError)):  # litellm calls it a 500
            raise UpstreamError("upstream stream broke off", code="upstream_incomplete") from exc
        raise provider.upstream_error(exc) from exc


def _finished_by_provider(raw: Any, chunk: dict[str, Any], stream: Any, noted_before: Any = None) -> dict[str, Any]:
    """`chunk` (`raw` as dumped), unless it ends a stream its provider never ended. A provider's
    stream that stops without a finish reason (the connection closed cleanly mid-answer) is ended
    by litellm's stream wrapper with a finish reason of its own, which would pass a cut answer off
    as whole and store it. The wrapper notes the finish reason the provider sent
    (`received_finish_reason`, None if it sent none). Its own HTTP handler for OpenAI-compatible
    providers (memproxy's default route to them, `load_litellm`) reads the closing `data: [DONE]`
    as a finish, noted too; but a chunk the provider sent carries its id (`received_model_id`
    among litellm's notes of the chunk), one litellm made of `[DONE]` none. Where the provider's
    last chunk held both text and its finish reason (vLLM, Ollama, llama.cpp), the wrapper relays
    the text and ends with a chunk of its own: the finish reason, noted already when that text came
    (`noted_before`), is the provider's. A stream that is not litellm's chat stream has no such
    notes and is taken as it comes."""
    choices = chunk.get("choices")
    if isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices):
        noted = getattr(stream, "received_finish_reason", "")
        hidden = getattr(raw, "_hidden_params", None)
        made_of_done = isinstance(hidden, dict) and hidden.get("custom_llm_provider") in _OPENAI_LIKE \
            and "received_model_id" not in hidden
        if noted is None or (noted and made_of_done and not noted_before):
            raise UpstreamError("upstream stream ended before its answer did", code="upstream_incomplete")
    return chunk


# Responses parameters that chat completions take under the same name, which litellm's bridge
# (1.100) does not carry over.
_CHAT_TOO = ("service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "top_logprobs")


def _custom_calls_kept(message: Message, custom: dict[Any, dict[str, Any]]) -> Message:
    """`message` with each tool call that is one of the `custom` tool call items (by call id) as
    chat says a custom tool's call."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not any(isinstance(c, dict) and c.get("id") in custom for c in calls):
        return message
    return {**message, "tool_calls": [
        {"id": call["id"], "type": "custom",
         "custom": {"name": custom[call["id"]].get("name"), "input": custom[call["id"]].get("input") or ""}}
        if isinstance(call, dict) and call.get("id") in custom else call for call in calls]}


def _responses_bridge() -> Any:
    """litellm's Responses <-> chat completions bridge (loaded with litellm, by `Provider`)."""
    module = importlib.import_module("litellm.responses.litellm_completion_transformation.transformation")
    return module.LiteLLMCompletionResponsesConfig


def _plain_message(message: Any) -> Message:
    """A message of litellm's bridge as memproxy keeps messages: a plain dict without null fields;
    an assistant's as `assistant_message` stores a reply (tool calls as id, type and function only)."""
    raw = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    plain = {k: v for k, v in raw.items() if v is not None}
    if plain.get("role") == "assistant":
        return assistant_message(plain)
    return plain


def _files_kept(messages: list[Message], items: str | list[dict[str, Any]]) -> list[Message]:
    """`messages` with each `file` part made again from the `input_file` part it came from, in order:
    litellm's bridge drops its `filename`, which OpenAI's chat API requires beside `file_data`."""
    files = iter([part for item in (items if isinstance(items, list) else ())
                  if isinstance(item, dict) and isinstance(item.get("content"), list)
                  for part in item["content"] if isinstance(part, dict) and part.get("type") == "input_file"])
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "file" for p in content):
            parts = []
            for part in content:
                source = next(files, None) if isinstance(part, dict) and part.get("type") == "file" else None
                if source is not None:
                    part = {"type": "file", "file": {k: source[k] for k in ("file_id", "file_data", "filename")
                                                     if isinstance(source.get(k), str)}}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out


def _dumped(value: Any) -> dict[str, Any]:
    """A litellm Responses object as a dict of JSON values: an event's `type` is an enum in litellm's
    models, whose text (`ResponsesAPIStreamEvents.OUTPUT_TEXT_DELTA`) would name the event on the
    wire. Its models hold some fields as plain dicts where a model is declared (an event's `part`,
    a response's `usage`), which pydantic warns about on every dump: the values are right, so the
    warning is not raised."""
    result: dict[str, Any] = value.model_dump(mode="json", exclude_none=True, warnings=False)
    return result

"""Configuration: YAML with `${ENV_VAR}` interpolation, validated once at start.

Every section is a frozen pydantic dataclass (`extra="forbid"`): a real dataclass, so the rest of the
code and the tests read attributes and use `dataclasses.replace` as before, and one declaration gives
each key its type, default and range. `load_config` interpolates the environment, lets pydantic check
every value, then checks what relates two values (a duplicate name, a pool's bounds, an output
limit against its window, the summariser's model); any problem raises `ConfigError` naming the key
path (`models[0].context_window`) and why, in memproxy's words rather than pydantic's. Reading a
config never imports litellm or touches the network, so `memproxy check-config` stays light. Every
key is documented in `config.example.yaml`, and a test fails when one is not.

Values read from YAML keep their lenient forms (environment variables are strings): a string of
digits is an integer, `true`/`false` in any case a boolean, a number a string where text is asked.
Anything else of the wrong type is refused; pydantic's wider coercions (`yes`, `1.0` as an integer)
are not taken. An absent key, an empty value (`key:`) and an empty string where a choice or a
default is expected all mean the default.
"""

from __future__ import annotations

import os
import re
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
Tokenizer = Literal["auto", "cl100k_base", "o200k_base", "litellm"]
TOKENIZERS: tuple[Tokenizer, ...] = ("auto", "cl100k_base", "o200k_base", "litellm")
StoreFailurePolicy = Literal["error", "passthrough"]
STORE_FAILURE_POLICIES: tuple[StoreFailurePolicy, ...] = ("error", "passthrough")
Transport = Literal["litellm", "openai", "auto"]  # `auto`: memproxy's own client for `openai/` models
# How `POST /v1/responses` reaches the model: `bridge` sends a chat completion (any provider, on the
# model's transport) and answers in the Responses shape; `native` calls the provider's own Responses
# API through litellm (`litellm.aresponses`).
ResponsesApi = Literal["bridge", "native"]
RecallScope = Literal["session", "user"]  # where recall looks: the session, or all of its end user's
Overflow = Literal["summarize", "marker", "drop"]  # what happens to history that no longer fits
OVERFLOW_POLICIES: tuple[Overflow, ...] = ("summarize", "marker", "drop")
LogFormat = Literal["text", "json"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
LOG_LEVELS: tuple[LogLevel, ...] = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConfigError(ValueError):
    """A bad key (`key`: its path) and why; `source` is the file it was read from, when there was one."""

    def __init__(self, key: str, why: str, source: str | None = None) -> None:
        super().__init__(f"{source}: {key}: {why}" if source else f"{key}: {why}")
        self.key = key
        self.why = why
        self.source = source


# --- value types: today's lenient YAML forms, then pydantic's strict check ----------------------

def _integer(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _boolean(value: Any) -> Any:
    return value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


def _text(value: Any) -> Any:
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


Int = Annotated[int, BeforeValidator(_integer), Field(strict=True)]
Count = Annotated[int, BeforeValidator(_integer), Field(strict=True, ge=0)]
Positive = Annotated[float, BeforeValidator(_number), Field(strict=True, gt=0)]
Flag = Annotated[bool, BeforeValidator(_boolean), Field(strict=True)]
Text = Annotated[str, BeforeValidator(_text), Field(strict=True)]
Required = Annotated[str, BeforeValidator(_text), Field(strict=True, min_length=1)]
Secret = Annotated[str, BeforeValidator(_text), Field(strict=True, min_length=8)]  # an API key

_SECTION = ConfigDict(extra="forbid")


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


# A web origin as browsers send it (scheme, host and port, nothing after), or "*" for any.
_ORIGIN = r"^(\*|[a-z][a-z0-9+.-]*://[^/\s?#@]+)$"
Origin = Annotated[str, BeforeValidator(_lower), Field(strict=True, pattern=_ORIGIN)]
# A host name a request may name in its Host header (no port).
_HOST_NAME = r"^[^\s/:@]+$"
HostName = Annotated[str, BeforeValidator(_lower), Field(strict=True, pattern=_HOST_NAME)]
# An HTTP header's name (a token, RFC 9110) and a value a header can carry (no line break or
# other control character but tab).
_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
_HEADER_VALUE = r"^[^\x00-\x08\x0a-\x1f\x7f]*$"
HeaderName = Annotated[str, Field(strict=True, pattern=_HEADER_NAME)]
HeaderValue = Annotated[str, BeforeValidator(_text), Field(strict=True, pattern=_HEADER_VALUE)]
_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]{0,62}$"
# What a value that does not match each pattern must be, in the error.
_PATTERNS = {
    _ORIGIN: 'must be an origin (scheme://host[:port], nothing after) or "*"',
    _HOST_NAME: "must be a host name (no scheme, port or path)",
    _HEADER_NAME: "must be an HTTP header name (letters, digits and !#$%&'*+.^_`|~-)",
    _HEADER_VALUE: "must hold no line break or other control character",
    _IDENTIFIER: "must be a plain identifier (letters, digits, _)",
}
# Headers memproxy or HTTP itself sets on a provider request: not for `models[].headers`.
MANAGED_HEADERS = frozenset({"authorization", "content-type", "content-length", "host", "transfer-encoding",
                             "connection"})


@dataclass(frozen=True, config=_SECTION)
class ServerConfig:
    host: Text = "127.0.0.1"
    port: Annotated[Int, Field(ge=0, le=65535)] = 8080
    max_body_bytes: Annotated[Int, Field(ge=1024)] = 10 * 1024 * 1024
    # Request bodies a process holds at once, in bytes (`bodies.BodyBudget`); 0: no limit.
    max_body_bytes_in_flight: Count = 128 * 1024 * 1024
    allow_unauthenticated: Flag = False
    access_log: Flag = False
    header_timeout_seconds: Positive = 10.0  # first byte of a request to the end of its headers
    body_timeout_seconds: Positive = 60.0  # end of the headers to the end of the body
    keepalive_timeout_seconds: Positive = 75.0  # an idle connection (also: before its first request)
    send_timeout_seconds: Positive = 60.0  # an answer its client takes nothing of (`deadlines.send_deadline`)
    workers: Annotated[Int, Field(ge=1, le=256)] = 1  # server processes sharing the port (`memproxy.workers`)
    cors_origins: tuple[Origin, ...] = ()  # web pages that may call memproxy from a browser (`memproxy.origins`)
    allowed_hosts: tuple[HostName, ...] = ()  # with no auth.keys: Host names beyond IPs and localhost

    @property
    def is_loopback(self) -> bool:
        return self.host in _LOOPBACK or self.host.startswith("127.")


@dataclass(frozen=True, config=_SECTION)
class StorageConfig:
    url: Text = "sqlite:///./memproxy.db"
    busy_timeout_ms: Count = 5000  # SQLite
    pool_min_size: Annotated[Int, Field(ge=1)] = 1  # PostgreSQL
    pool_max_size: Annotated[Int, Field(ge=1)] = 10
    # PostgreSQL, so that a stalled server or a row another client keeps locked is a 503 in bounded
    # time, not a request (and a pool connection) held forever; 0: no limit of memproxy's.
    pool_timeout_ms: Count = 5000  # waiting for a pooled connection (or a new one to open)
    # one statement: cancelled, and a server not answering given up on (long enough for bulk deletes:
    # the retention sweep's is one statement per 500 sessions)
    statement_timeout_ms: Count = 30000
    lock_timeout_ms: Count = 2000  # a write waiting for a row another connection has locked
    idle_in_transaction_timeout_ms: Count = 10000  # the server ends a write transaction left idle this long
    # PostgreSQL: tables live in this schema (created if missing)
    schema: Annotated[Text, Field(pattern=_IDENTIFIER)] | None = None
    # A chat turn the store fails to plan: 503 store_unavailable, or forwarded without memory.
    on_failure: StoreFailurePolicy = "error"
    # Recently served sessions' decoded histories kept between turns, at most this many MiB (0: off).
    history_cache_mb: Count = 64
    # Recently recalled sessions' full-text index kept in memory between turns, at most this many MiB (0: off).
    recall_cache_mb: Count = 64

    @property
    def is_postgres(self) -> bool:
        return self.url.startswith(("postgresql://", "postgres://"))


@dataclass(frozen=True, config=_SECTION)
class ModelConfig:
    name: Required
    model: Required
    api_base: Text | None = None
    api_key: Text | None = None
    context_window: Annotated[Int, Field(ge=1)] | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] = 1024
    tokenizer: Tokenizer = "auto"
    timeout_seconds: Positive = 600.0
    transport: Transport = "litellm"
    responses_api: ResponsesApi = "bridge"
    # Sent with every request to the provider for this model, on either transport (a gateway's own
    # key or route, OpenRouter's HTTP-Referer); never logged.
    headers: dict[HeaderName, HeaderValue] = field(default_factory=dict)

    @field_validator("headers", mode="before")
    @classmethod
    def _none_is_none(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("headers")
    @classmethod
    def _unmanaged(cls, value: dict[str, str]) -> dict[str, str]:
        seen: set[str] = set()
        for name in value:
            lower = name.lower()
            if lower == "authorization":
                raise ValueError("Authorization is memproxy's to set: put the provider key in api_key")
            if lower in MANAGED_HEADERS:
                raise ValueError(f"{name} is set by memproxy and HTTP, not by configuration")
            if lower in seen:
                raise ValueError(f"{name} is listed twice (header names are case-insensitive)")
            seen.add(lower)
        return value


@dataclass(frozen=True, config=_SECTION)
class MemoryConfig:
    """Budget and summary settings. The `None` defaults scale with the model's context window."""

    summarizer_model: Text | None = None
    safety_margin_tokens: Count | None = None
    calibrate_tokens: Flag = True
    summaries: Flag = True
    chunk_threshold_tokens: Annotated[Int, Field(ge=1)] | None = None
    tail_turns: Annotated[Int, Field(ge=1)] = 3
    tail_tokens: Annotated[Int, Field(ge=1)] | None = None
    summary_max_tokens: Annotated[Int, Field(ge=16)] | None = None
    overflow: Overflow = "summarize"
    sync_summary_timeout_seconds: Positive = 30.0
    failure_backoff_seconds: Positive = 60.0
    background_summaries: Annotated[Int, Field(ge=1)] = 8  # folds a process runs at once on its own
    tool_output_max_tokens: Count = 1000
    dedupe_min_tokens: Count = 200
    recall_tokens: Count | None = None
    recall_min_tokens: Count = 4096
    recall_context: Annotated[Int, Field(ge=0, le=5)] = 3
    recall_scope: RecallScope = "session"
    head_turns: Count = 0

    @field_validator("tool_output_max_tokens")
    @classmethod
    def _off_or_useful(cls, value: int) -> int:
        if 0 < value < 64:
            raise ValueError("must be 0 (off) or at least 64")
        return value

    def safety_margin(self, context_window: int) -> int:
        if self.safety_margin_tokens is not None:
            return self.safety_margin_tokens
        return max(16, context_window // 100)

    def chunk_threshold(self, context_window: int) -> int:
        return self.chunk_threshold_tokens or context_window // 2

    def tail_token_limit(self, context_window: int) -> int:
        return self.tail_tokens or context_window * 3 // 10

    def recall_room(self, context_window: int) -> int:
        """The most tokens the recall block may take (0: off); by default the whole window (what
        the request leaves, after the newest exchanges, bounds it)."""
        return self.recall_tokens if self.recall_tokens is not None else context_window

    def recall_floor(self, context_window: int) -> int:
        """The room recall is sure of: where the request leaves less beside the kept turns, older
        kept turns give way to it up to this many tokens in all (`memproxy.memory.plan`)."""
        return min(self.recall_room(context_window), self.recall_min_tokens)

    def summary_cap(self, context_window: int) -> int:
        return self.summary_max_tokens or min(max(context_window // 16, 256), 4096)


@dataclass(frozen=True, config=_SECTION)
class ApiKey:
    key: Secret
    tenant: Required


@dataclass(frozen=True, config=_SECTION)
class AuthConfig:
    keys: tuple[ApiKey, ...] = ()
    # the session admin API across every tenant
    admin_keys: tuple[Annotated[str, Field(strict=True, min_length=8)], ...] = ()


@dataclass(frozen=True, config=_SECTION)
class RetentionConfig:
    """All off by default: memproxy keeps every conversation until told otherwise."""

    idle_ttl_seconds: Positive | None = None
    sweep_interval_seconds: Positive = 300.0
    max_messages_per_session: Annotated[Int, Field(ge=2)] | None = None


def _callback_name(value: str) -> str:
    if not _CALLBACK.fullmatch(value):
        raise ValueError(f"must be a litellm callback name (langfuse, otel, ...) or a Python path "
                         f"module.attribute, got {value!r}")
    return value


_CALLBACK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:[.:][A-Za-z_][A-Za-z0-9_]*)*")
CallbackName = Annotated[str, BeforeValidator(_text), Field(strict=True), AfterValidator(_callback_name)]


@dataclass(frozen=True, config=_SECTION)
class LitellmConfig:
    """litellm's process-wide settings. Its callbacks (observability) receive the content of every
    message sent through litellm: none unless listed (memproxy.observability)."""

    callbacks: tuple[CallbackName, ...] = ()
    turn_off_message_logging: Flag = False


@dataclass(frozen=True, config=_SECTION)
class LoggingConfig:
    level: Annotated[LogLevel, BeforeValidator(_upper)] = "INFO"  # `serve --log-level` overrides it
    format: LogFormat = "text"  # json: one JSON object per line (memproxy.logs)


@dataclass(frozen=True, config=_SECTION)
class MetricsConfig:
    """`GET /metrics` (memproxy.metrics)."""

    public: Flag = False  # else only an admin key may read it (or anyone, with no keys configured)
    tenant_label: Flag = False  # a `tenant` label on the per-tenant counters: one series per tenant


@dataclass(frozen=True, config=_SECTION)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    models: tuple[ModelConfig, ...] = ()
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    litellm: LitellmConfig = field(default_factory=LitellmConfig)

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


_CONFIG = TypeAdapter(Config)
# Keys whose empty string means the default, as an absent key does (`${VAR:-}` left empty).
_EMPTY_IS_DEFAULT = frozenset({"host", "url", "tokenizer", "transport", "overflow", "on_failure", "api_base",
                               "level", "format"})


def load_config(path: str | Path, environ: dict[str, str] | None = None) -> Config:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read config file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text (byte {exc.start})") from exc
    try:
        return parse_config(text, environ)
    except ConfigError as exc:
        raise ConfigError(exc.key, exc.why, source=str(path)) from None


def parse_config(text: str, environ: dict[str, str] | None = None) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"not valid YAML: {exc}") from exc
    env = dict(os.environ) if environ is None else environ
    data = _interpolate(raw if raw is not None else {}, env, "<root>")
    if not isinstance(data, dict):
        raise ConfigError("<root>", "must be a mapping")
    try:
        config = _CONFIG.validate_python(data)
    except ValidationError as exc:
        raise _config_error(exc) from None
    _cross_check(config)
    return config


def _interpolate(value: Any, env: dict[str, str], key: str) -> Any:
    """`value` with `${VAR}` and `${VAR:-default}` replaced; keys whose value is empty (null, or an
    empty string where `_EMPTY_IS_DEFAULT` says so) left out, so they take their defaults."""
    if isinstance(value, dict):
        items = ((k, _interpolate(v, env, _join(key, str(k)))) for k, v in value.items())
        return {k: v for k, v in items if v is not None and not (v == "" and k in _EMPTY_IS_DEFAULT)}
    if isinstance(value, list):
        return [_interpolate(v, env, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name, default = match.group(1), match.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            raise ConfigError(key, f"environment variable {name} is not set")

        return _ENV_REF.sub(substitute, value)
    return value


def _join(prefix: str, key: str) -> str:
    return key if prefix in ("", "<root>") else f"{prefix}.{key}"


def _config_error(exc: ValidationError) -> ConfigError:
    """The first of pydantic's errors, as the key path and why in memproxy's words."""
    error = exc.errors(include_url=False)[0]
    key = ""
    for part in error["loc"]:
        key = f"{key}[{part}]" if isinstance(part, int) else _join(key, str(part))
    return ConfigError(key or "<root>", _why(error["type"], error["input"], error.get("ctx") or {}))


def _why(kind: str, value: Any, ctx: dict[str, Any]) -> str:
    if kind == "missing":
        return "is required"
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return "unknown key"
    if kind in ("dataclass_type", "dataclass_exact_type", "dict_type", "model_type"):
        return "must be a mapping"
    if kind in ("tuple_type", "list_type"):
        return "must be a list"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer, got {value!r}"
    if kind in ("float_type", "float_parsing") or kind == "greater_than" and ctx.get("gt") == 0:
        return f"must be a positive number, got {value!r}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {value!r}"
    if kind == "string_type":
        return "must be a string"
    if kind in ("string_too_short", "too_short"):
        return "is required" if ctx.get("min_length") == 1 else f"must be at least {ctx['min_length']} characters"
    if kind == "string_pattern_mismatch":
        return _PATTERNS.get(ctx.get("pattern", ""), "is not valid")
    if kind == "literal_error":
        return f"must be one of {str(ctx['expected']).replace(chr(39), '').replace(' or ', ', ')}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}, got {value!r}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}, got {value!r}"
    if kind == "value_error":
        return str(ctx.get("error", "is not valid"))
    return f"is not valid ({kind})"


def _cross_check(config: Config) -> None:
    """What pydantic checks value by value cannot: the store's kind, and values that must agree."""
    url = config.storage.url
    if not url.startswith(("sqlite:///", "postgresql://", "postgres://")):
        raise ConfigError("storage.url", f"unsupported store {url!r}: use sqlite:///path/to/file.db "
                                         "or postgresql://user@host:port/database")
    server, storage = config.server, config.storage
    if 0 < server.max_body_bytes_in_flight < server.max_body_bytes:  # the largest request would never be taken
        raise ConfigError("server.max_body_bytes_in_flight",
                          f"must be 0 (no limit) or >= max_body_bytes ({server.max_body_bytes})")
    if storage.pool_max_size < storage.pool_min_size:
        raise ConfigError("storage.pool_max_size", f"must be >= pool_min_size ({storage.pool_min_size})")
    names: set[str] = set()
    for i, model in enumerate(config.models):
        if model.name in names:
            raise ConfigError(f"models[{i}].name", f"duplicate model name {model.name!r}")
        names.add(model.name)
        window = model.context_window
        if window is not None and model.max_output_tokens >= window:
            raise ConfigError(f"models[{i}].max_output_tokens", f"must be smaller than context_window ({window})")
        margin = config.memory.safety_margin(window) if window is not None else 0
        if window is not None and model.max_output_tokens + margin >= window:
            # Every request would be refused as too long: no token of input fits.
            raise ConfigError(f"models[{i}].max_output_tokens",
                              f"leaves no room for input: with the safety margin ({margin} tokens,"
                              f" memory.safety_margin_tokens) it must be smaller than context_window ({window})")
    every = [k.key for k in config.auth.keys] + list(config.auth.admin_keys)
    if len(set(every)) != len(every):
        raise ConfigError("auth.keys", "the same key is listed twice")
    if "*" in config.server.cors_origins and not every:
        raise ConfigError("server.cors_origins", "'*' with no auth.keys would let any web page read and change "
                                                 "every conversation: list the origins, or configure keys")
    summarizer = config.memory.summarizer_model
    if summarizer is not None and config.model(summarizer) is None:
        raise ConfigError("memory.summarizer_model", f"{summarizer!r} is not a name in models")

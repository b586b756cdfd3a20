"""Configuration: YAML with `${ENV_VAR}` interpolation, validated once at start.

`load_config` returns frozen dataclasses; any problem raises `ConfigError` naming the key path
(`models[0].context_window`) and why. Reading a config never imports litellm or touches the network,
so `memproxy check-config` stays light. Every key is documented in `config.example.yaml`, and a test
fails when one is not.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TOKENIZERS = ("auto", "cl100k_base", "o200k_base", "litellm")
StoreFailurePolicy = Literal["error", "passthrough"]
STORE_FAILURE_POLICIES: tuple[StoreFailurePolicy, ...] = ("error", "passthrough")


class ConfigError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 10 * 1024 * 1024
    allow_unauthenticated: bool = False
    access_log: bool = False
    header_timeout_seconds: float = 10.0  # first byte of a request to the end of its headers
    body_timeout_seconds: float = 60.0  # end of the headers to the end of the body
    keepalive_timeout_seconds: float = 75.0  # an idle connection (also: before its first request)

    @property
    def is_loopback(self) -> bool:
        return self.host in _LOOPBACK or self.host.startswith("127.")


@dataclass(frozen=True)
class StorageConfig:
    url: str = "sqlite:///./memproxy.db"
    busy_timeout_ms: int = 5000  # SQLite
    pool_min_size: int = 1  # PostgreSQL
    pool_max_size: int = 10
    schema: str | None = None  # PostgreSQL: tables live in this schema (created if missing)
    # A chat turn the store fails to plan: 503 store_unavailable, or forwarded without memory.
    on_failure: StoreFailurePolicy = "error"

    @property
    def is_postgres(self) -> bool:
        return self.url.startswith(("postgresql://", "postgres://"))


@dataclass(frozen=True)
class ModelConfig:
    name: str
    model: str
    api_base: str | None = None
    api_key: str | None = None
    context_window: int | None = None
    max_output_tokens: int = 1024
    tokenizer: str = "auto"
    timeout_seconds: float = 600.0
    transport: str = "auto"


TRANSPORTS = ("auto", "openai", "litellm")
OVERFLOW_POLICIES = ("summarize", "marker", "drop")


@dataclass(frozen=True)
class MemoryConfig:
    """Budget and summary settings. The `None` defaults scale with the model's context window."""

    summarizer_model: str | None = None
    safety_margin_tokens: int | None = None
    summaries: bool = True
    chunk_threshold_tokens: int | None = None
    tail_turns: int = 3
    tail_tokens: int | None = None
    summary_max_tokens: int | None = None
    overflow: str = "summarize"
    sync_summary_timeout_seconds: float = 30.0
    failure_backoff_seconds: float = 60.0
    tool_output_max_tokens: int = 1000
    dedupe_min_tokens: int = 200

    def safety_margin(self, context_window: int) -> int:
        if self.safety_margin_tokens is not None:
            return self.safety_margin_tokens
        return max(16, context_window // 100)

    def chunk_threshold(self, context_window: int) -> int:
        return self.chunk_threshold_tokens or context_window // 2

    def tail_token_limit(self, context_window: int) -> int:
        return self.tail_tokens or context_window * 3 // 10

    def summary_cap(self, context_window: int) -> int:
        return self.summary_max_tokens or min(max(context_window // 16, 256), 4096)


@dataclass(frozen=True)
class ApiKey:
    key: str
    tenant: str


@dataclass(frozen=True)
class AuthConfig:
    keys: tuple[ApiKey, ...] = ()
    admin_keys: tuple[str, ...] = ()  # the session admin API across every tenant


@dataclass(frozen=True)
class RetentionConfig:
    """All off by default: memproxy keeps every conversation until told otherwise."""

    idle_ttl_seconds: float | None = None
    sweep_interval_seconds: float = 300.0
    max_messages_per_session: int | None = None


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    models: tuple[ModelConfig, ...] = ()
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


def load_config(path: str | Path, environ: dict[str, str] | None = None) -> Config:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read config file: {exc.strerror}") from exc
    return parse_config(text, environ)


def parse_config(text: str, environ: dict[str, str] | None = None) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"not valid YAML: {exc}") from exc
    env = dict(os.environ) if environ is None else environ
    data = _Section(_interpolate(raw if raw is not None else {}, env, "<root>"), "")
    config = Config(
        server=_server(data.section("server")),
        storage=_storage(data.section("storage")),
        models=_models(data),
        memory=_memory(data.section("memory")),
        auth=_auth(data),
        retention=_retention(data.section("retention")),
    )
    data.finish()
    _cross_check(config)
    return config


def _interpolate(value: Any, env: dict[str, str], key: str) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, env, _join(key, str(k))) for k, v in value.items()}
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


class _Section:
    """A mapping being read; remembers which keys were used so unknown ones are reported."""

    def __init__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise ConfigError(path or "<root>", "must be a mapping")
        self.values: dict[str, Any] = value
        self.path = path
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return _join(self.path, name)

    def get(self, name: str, default: Any = None) -> Any:
        self.used.add(name)
        value = self.values.get(name)
        return default if value is None else value

    def section(self, name: str) -> _Section:
        return _Section(self.get(name, {}), self.key(name))

    def string(self, name: str, default: str | None = None) -> str | None:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(self.key(name), "must be a string")
        return str(value)

    def required_string(self, name: str) -> str:
        value = self.string(name)
        if not value:
            raise ConfigError(self.key(name), "is required")
        return value

    def integer(self, name: str, default: int | None, minimum: int = 0) -> int | None:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(self.key(name), f"must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(self.key(name), f"must be >= {minimum}, got {value}")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.get(name, default)
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(self.key(name), f"must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(self.key(name), f"must be true or false, got {value!r}")
        return value

    def finish(self) -> None:
        unknown = sorted(set(self.values) - self.used)
        if unknown:
            raise ConfigError(self.key(str(unknown[0])), "unknown key")


def _server(s: _Section) -> ServerConfig:
    d = ServerConfig()
    port = s.integer("port", d.port)
    assert port is not None
    if port > 65535:
        raise ConfigError(s.key("port"), f"must be <= 65535, got {port}")
    max_body = s.integer("max_body_bytes", d.max_body_bytes, minimum=1024)
    assert max_body is not None
    config = ServerConfig(
        host=s.string("host", d.host) or d.host,
        port=port,
        max_body_bytes=max_body,
        allow_unauthenticated=s.boolean("allow_unauthenticated", d.allow_unauthenticated),
        access_log=s.boolean("access_log", d.access_log),
        header_timeout_seconds=s.number("header_timeout_seconds", d.header_timeout_seconds),
        body_timeout_seconds=s.number("body_timeout_seconds", d.body_timeout_seconds),
        keepalive_timeout_seconds=s.number("keepalive_timeout_seconds", d.keepalive_timeout_seconds),
    )
    s.finish()
    return config


def _storage(s: _Section) -> StorageConfig:
    d = StorageConfig()
    url = s.string("url", d.url) or d.url
    if not url.startswith(("sqlite:///", "postgresql://", "postgres://")):
        raise ConfigError(s.key("url"), f"unsupported store {url!r}: use sqlite:///path/to/file.db "
                                        "or postgresql://user@host:port/database")
    busy = s.integer("busy_timeout_ms", d.busy_timeout_ms)
    pool_min = s.integer("pool_min_size", d.pool_min_size, minimum=1)
    pool_max = s.integer("pool_max_size", d.pool_max_size, minimum=1)
    assert busy is not None and pool_min is not None and pool_max is not None
    if pool_max < pool_min:
        raise ConfigError(s.key("pool_max_size"), f"must be >= pool_min_size ({pool_min})")
    schema = s.string("schema")
    if schema is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
        raise ConfigError(s.key("schema"), "must be a plain identifier (letters, digits, _)")
    on_failure = s.string("on_failure", d.on_failure)
    if on_failure == "error" or on_failure is None:
        policy: StoreFailurePolicy = "error"
    elif on_failure == "passthrough":
        policy = "passthrough"
    else:
        raise ConfigError(s.key("on_failure"), f"must be one of {', '.join(STORE_FAILURE_POLICIES)}")
    s.finish()
    return StorageConfig(url=url, busy_timeout_ms=busy, pool_min_size=pool_min, pool_max_size=pool_max,
                         schema=schema, on_failure=policy)


def _models(data: _Section) -> tuple[ModelConfig, ...]:
    raw = data.get("models", [])
    if not isinstance(raw, list):
        raise ConfigError("models", "must be a list")
    models: list[ModelConfig] = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        s = _Section(item, f"models[{i}]")
        d = ModelConfig(name="", model="")
        name = s.required_string("name")
        if name in names:
            raise ConfigError(s.key("name"), f"duplicate model name {name!r}")
        names.add(name)
        tokenizer = s.string("tokenizer", d.tokenizer) or d.tokenizer
        if tokenizer not in TOKENIZERS:
            raise ConfigError(s.key("tokenizer"), f"must be one of {', '.join(TOKENIZERS)}")
        transport = s.string("transport", d.transport) or d.transport
        if transport not in TRANSPORTS:
            raise ConfigError(s.key("transport"), f"must be one of {', '.join(TRANSPORTS)}")
        max_output = s.integer("max_output_tokens", d.max_output_tokens, minimum=1)
        assert max_output is not None
        window = s.integer("context_window", None, minimum=1)
        if window is not None and max_output >= window:
            raise ConfigError(
                s.key("max_output_tokens"), f"must be smaller than context_window ({window})"
            )
        models.append(
            ModelConfig(
                name=name,
                model=s.required_string("model"),
                api_base=s.string("api_base"),
                api_key=s.string("api_key"),
                context_window=window,
                max_output_tokens=max_output,
                tokenizer=tokenizer,
                timeout_seconds=s.number("timeout_seconds", d.timeout_seconds),
                transport=transport,
            )
        )
        s.finish()
    return tuple(models)


def _memory(s: _Section) -> MemoryConfig:
    d = MemoryConfig()
    overflow = s.string("overflow", d.overflow) or d.overflow
    if overflow not in OVERFLOW_POLICIES:
        raise ConfigError(s.key("overflow"), f"must be one of {', '.join(OVERFLOW_POLICIES)}")
    tail_turns = s.integer("tail_turns", d.tail_turns, minimum=1)
    tool_output = s.integer("tool_output_max_tokens", d.tool_output_max_tokens)
    dedupe = s.integer("dedupe_min_tokens", d.dedupe_min_tokens)
    assert tail_turns is not None and tool_output is not None and dedupe is not None
    if 0 < tool_output < 64:
        raise ConfigError(s.key("tool_output_max_tokens"), "must be 0 (off) or at least 64")
    config = MemoryConfig(
        summarizer_model=s.string("summarizer_model"),
        safety_margin_tokens=s.integer("safety_margin_tokens", None),
        summaries=s.boolean("summaries", d.summaries),
        chunk_threshold_tokens=s.integer("chunk_threshold_tokens", None, minimum=1),
        tail_turns=tail_turns,
        tail_tokens=s.integer("tail_tokens", None, minimum=1),
        summary_max_tokens=s.integer("summary_max_tokens", None, minimum=16),
        overflow=overflow,
        sync_summary_timeout_seconds=s.number("sync_summary_timeout_seconds", d.sync_summary_timeout_seconds),
        failure_backoff_seconds=s.number("failure_backoff_seconds", d.failure_backoff_seconds),
        tool_output_max_tokens=tool_output,
        dedupe_min_tokens=dedupe,
    )
    s.finish()
    return config


def _auth(data: _Section) -> AuthConfig:
    s = data.section("auth")
    raw = s.get("keys", [])
    if not isinstance(raw, list):
        raise ConfigError(s.key("keys"), "must be a list")
    keys: list[ApiKey] = []
    for i, item in enumerate(raw):
        k = _Section(item, f"auth.keys[{i}]")
        key = k.required_string("key")
        if len(key) < 8:
            raise ConfigError(k.key("key"), "must be at least 8 characters")
        keys.append(ApiKey(key=key, tenant=k.required_string("tenant")))
        k.finish()
    raw_admin = s.get("admin_keys", [])
    if not isinstance(raw_admin, list):
        raise ConfigError(s.key("admin_keys"), "must be a list")
    admin_keys = []
    for i, value in enumerate(raw_admin):
        if not isinstance(value, str) or len(value) < 8:
            raise ConfigError(f"auth.admin_keys[{i}]", "must be a string of at least 8 characters")
        admin_keys.append(value)
    every = [k.key for k in keys] + admin_keys
    if len(set(every)) != len(every):
        raise ConfigError(s.key("keys"), "the same key is listed twice")
    s.finish()
    return AuthConfig(keys=tuple(keys), admin_keys=tuple(admin_keys))


def _retention(s: _Section) -> RetentionConfig:
    d = RetentionConfig()
    ttl = s.get("idle_ttl_seconds")
    config = RetentionConfig(
        idle_ttl_seconds=None if ttl is None else s.number("idle_ttl_seconds", 1.0),
        sweep_interval_seconds=s.number("sweep_interval_seconds", d.sweep_interval_seconds),
        max_messages_per_session=s.integer("max_messages_per_session", None, minimum=2),
    )
    s.finish()
    return config


def _cross_check(config: Config) -> None:
    summarizer = config.memory.summarizer_model
    if summarizer is not None and config.model(summarizer) is None:
        raise ConfigError("memory.summarizer_model", f"{summarizer!r} is not a name in models")

"""Config loading: interpolation, defaults, and errors that name the bad key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from memproxy.config import (
    ApiKey,
    AuthConfig,
    Config,
    ConfigError,
    LoggingConfig,
    MemoryConfig,
    MetricsConfig,
    ModelConfig,
    ServerConfig,
    StorageConfig,
    load_config,
    parse_config,
)

ROOT = Path(__file__).resolve().parent.parent

MINIMAL = """
models:
  - {name: small, model: openai/small, api_key: "${SMALL_KEY}", context_window: 2000}
auth:
  keys:
    - {key: "${KEY_A}", tenant: a}
"""


def test_interpolates_environment_variables() -> None:
    config = parse_config(MINIMAL, {"SMALL_KEY": "sk-1", "KEY_A": "proxy-key-a"})
    assert config.models[0].api_key == "sk-1"
    assert config.auth.keys[0].key == "proxy-key-a" and config.auth.keys[0].tenant == "a"
    assert config.server.host == "127.0.0.1" and config.server.port == 8080
    assert config.storage.url == "sqlite:///./memproxy.db"


def test_default_after_colon_dash() -> None:
    config = parse_config("server: {port: '${PORT:-9000}'}", {})
    assert config.server.port == 9000


@pytest.mark.parametrize(
    ("text", "env", "key", "why"),
    [
        (MINIMAL, {"KEY_A": "proxy-key-a"}, "models[0].api_key", "SMALL_KEY is not set"),
        ("server: {port: eighty}", {}, "server.port", "must be an integer"),
        ("server: {port: 70000}", {}, "server.port", "must be <= 65535"),
        ("server: {colour: blue}", {}, "server.colour", "unknown key"),
        ("surprise: 1", {}, "surprise", "unknown key"),
        ("models: [{name: a}]", {}, "models[0].model", "is required"),
        ("models: [{name: a, model: m, context_window: -5}]", {}, "models[0].context_window", ">= 1"),
        ("models: [{name: a, model: m, context_window: 100, max_output_tokens: 100}]", {},
         "models[0].max_output_tokens", "smaller than context_window"),
        ("models: [{name: a, model: m, context_window: 1000, max_output_tokens: 900}]\n"
         "memory: {safety_margin_tokens: 100}", {}, "models[0].max_output_tokens", "leaves no room for input"),
        ("models: [{name: a, model: m, tokenizer: bpe}]", {}, "models[0].tokenizer", "must be one of"),
        ("models: [{name: a, model: m, transport: httpx}]", {}, "models[0].transport", "must be one of"),
        ("models: [{name: a, model: m}, {name: a, model: n}]", {}, "models[1].name", "duplicate"),
        ("storage: {url: 'mysql://x'}", {}, "storage.url", "unsupported store"),
        ("memory: {summarizer_model: nope}", {}, "memory.summarizer_model", "not a name in models"),
        ("auth: {keys: [{key: short, tenant: a}]}", {}, "auth.keys[0].key", "at least 8"),
        ("auth: {keys: [{key: longenough}]}", {}, "auth.keys[0].tenant", "is required"),
        ("server: [1, 2]", {}, "server", "must be a mapping"),
        ("server: {allow_unauthenticated: maybe}", {}, "server.allow_unauthenticated", "true or false"),
        ("models: {name: a}", {}, "models", "must be a list"),
        ("litellm: {callbacks: [langfuse, 'my logger']}", {}, "litellm.callbacks[1]", "must be a litellm callback name"),
        ("litellm: {callbacks: langfuse}", {}, "litellm.callbacks", "must be a list"),
        ("litellm: {turn_off_message_logging: sometimes}", {}, "litellm.turn_off_message_logging", "true or false"),
    ],
)
def test_errors_name_the_key_and_why(text: str, env: dict[str, str], key: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, env)
    assert caught.value.key == key
    assert why in caught.value.why


def test_invalid_yaml_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config("server: {port: [", {})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")


def test_example_config_loads_without_any_environment() -> None:
    config = load_config(ROOT / "config.example.yaml", environ={})
    assert [m.name for m in config.models] == ["gpt-4o-mini", "small"]
    assert config.memory.summarizer_model is None  # the session's model: works with only OPENAI_API_KEY set


def test_the_example_config_reaches_openai_where_the_openai_environment_says() -> None:
    def base(environ: dict[str, str]) -> str | None:
        return load_config(ROOT / "config.example.yaml", environ=environ).models[0].api_base

    assert base({}) is None  # the transport's default: OPENAI_BASE_URL, else OPENAI_API_BASE, else OpenAI's
    assert base({"OPENAI_BASE_URL": "http://127.0.0.1:8000/v1"}) == "http://127.0.0.1:8000/v1"
    assert base({"OPENAI_API_BASE": "http://127.0.0.1:8001/v1"}) is None  # read by the transport itself


def test_every_config_key_is_documented_in_the_example() -> None:
    example = (ROOT / "config.example.yaml").read_text()
    documented = set(re.findall(r"\b([a-z_]+):", example))
    sections = (Config, ServerConfig, StorageConfig, ModelConfig, MemoryConfig, AuthConfig, ApiKey, LoggingConfig,
                MetricsConfig)
    keys = {f.name for cls in sections for f in dataclasses.fields(cls)}
    missing = sorted(keys - documented)
    assert not missing, f"config keys not documented in config.example.yaml: {missing}"


@pytest.mark.parametrize(("text", "key", "why"), [
    ("memory: {overflow: compress}", "memory.overflow", "must be one of summarize, marker, drop"),
    ("storage: {on_failure: ignore}", "storage.on_failure", "must be one of error, passthrough"),
    ("storage: {pool_min_size: 5, pool_max_size: 2}", "storage.pool_max_size", ">= pool_min_size (5)"),
    ("server: {max_body_bytes: 4096, max_body_bytes_in_flight: 2048}", "server.max_body_bytes_in_flight",
     "0 (no limit) or >= max_body_bytes (4096)"),
    ("storage: {schema: 'a b'}", "storage.schema", "plain identifier"),
    ("memory: {tool_output_max_tokens: 10}", "memory.tool_output_max_tokens", "0 (off) or at least 64"),
    ("auth: {admin_keys: [short]}", "auth.admin_keys[0]", "at least 8"),
    ("auth: {keys: [{key: abcdefgh, tenant: a}], admin_keys: [abcdefgh]}", "auth.keys", "listed twice"),
    ("retention: {idle_ttl_seconds: 0}", "retention.idle_ttl_seconds", "positive number"),
    # pydantic's wider coercions are not taken: only today's lenient forms
    ("server: {access_log: 'yes'}", "server.access_log", "true or false"),
    ("server: {port: 8080.0}", "server.port", "must be an integer"),
    ("server: {port: true}", "server.port", "must be an integer"),
    ("models: [{name: [a], model: m}]", "models[0].name", "must be a string"),
    ("[1, 2]", "<root>", "must be a mapping"),
    ("server: {cors_origins: ['https://a.example/path']}", "server.cors_origins[0]", "must be an origin"),
    ("server: {allowed_hosts: ['a.example:80']}", "server.allowed_hosts[0]", "must be a host name"),
    ("models: [{name: a, model: m, headers: [X-A]}]", "models[0].headers", "must be a mapping"),
    ("models: [{name: a, model: m, headers: {'X A': b}}]", "models[0].headers.X A.[key]", "HTTP header name"),
    ("models: [{name: a, model: m, headers: {X-A: \"s3cr3t\\r\\nX-B: v\"}}]", "models[0].headers.X-A",
     "no line break"),
    ("models: [{name: a, model: m, headers: {authorization: Bearer x}}]", "models[0].headers", "in api_key"),
    ("models: [{name: a, model: m, headers: {Content-Length: '9'}}]", "models[0].headers", "set by memproxy"),
    ("models: [{name: a, model: m, headers: {X-A: b, x-a: c}}]", "models[0].headers", "listed twice"),
])
def test_every_check_names_its_key(text: str, key: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, {})
    assert (caught.value.key, why in caught.value.why) == (key, True), str(caught.value)
    assert "s3cr3t" not in str(caught.value) and "Bearer" not in str(caught.value)  # a header's value is never quoted


def test_lenient_yaml_forms_and_empty_values_take_defaults() -> None:
    config = parse_config("server: {port: '9000', access_log: 'TRUE', host: '', header_timeout_seconds: '2.5'}\n"
                          "storage:\nmemory: {overflow: '${OVERFLOW:-}', summaries: 'false'}\n"
                          "models: [{name: 7, model: m, api_key: ''}]", {})
    assert (config.server.port, config.server.access_log, config.server.host) == (9000, True, "127.0.0.1")
    assert config.server.header_timeout_seconds == 2.5 and config.storage == StorageConfig()
    assert (config.memory.overflow, config.memory.summaries) == ("summarize", False)
    assert (config.models[0].name, config.models[0].api_key) == ("7", "")  # an empty key is a key


def test_a_file_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "memproxy.yaml"
    path.write_text("memory: {overflow: compress}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: memory.overflow: must be one of summarize, marker, drop"
    assert caught.value.key == "memory.overflow"


def test_sections_stay_frozen_dataclasses_that_revalidate_on_replace() -> None:
    config = parse_config(MINIMAL, {"SMALL_KEY": "k", "KEY_A": "proxy-key-a"})
    model = dataclasses.replace(config.models[0], max_output_tokens=100)
    assert model.max_output_tokens == 100 and model.api_key == "k"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.models[0].name = "other"  # type: ignore[misc]
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        dataclasses.replace(config.models[0], max_output_tokens=0)

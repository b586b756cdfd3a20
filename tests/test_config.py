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
    MemoryConfig,
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
    assert config.memory.summarizer_model == "small"


def test_every_config_key_is_documented_in_the_example() -> None:
    example = (ROOT / "config.example.yaml").read_text()
    documented = set(re.findall(r"\b([a-z_]+):", example))
    sections = (Config, ServerConfig, StorageConfig, ModelConfig, MemoryConfig, AuthConfig, ApiKey)
    keys = {f.name for cls in sections for f in dataclasses.fields(cls)}
    missing = sorted(keys - documented)
    assert not missing, f"config keys not documented in config.example.yaml: {missing}"

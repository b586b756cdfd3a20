"""`memproxy init`: a commented starting config for one provider.

Each provider's file names one model with what it needs: the litellm model string, the endpoint, the
key from the environment, and a context window where litellm's model info has none (a model served
locally). Everything else is left to its default, as `config.example.yaml` documents it. The local
servers (Ollama, vLLM) are reached through their OpenAI-compatible APIs, by litellm as every model
is by default (`transport: openai` is memproxy's own client, byte for byte); their key and endpoint
are set, so that OPENAI_API_KEY and OPENAI_BASE_URL, meant for OpenAI, are never sent to them. A test holds every file valid (`memproxy check-config`).
"""

from __future__ import annotations

from typing import Literal

ProviderKind = Literal["openai", "anthropic", "ollama", "vllm"]
PROVIDERS: tuple[ProviderKind, ...] = ("openai", "anthropic", "ollama", "vllm")

_TITLES: dict[ProviderKind, str] = {
    "openai": "OpenAI",
    "anthropic": "Anthropic",
    "ollama": "Ollama (its OpenAI-compatible API)",
    "vllm": "vLLM (its OpenAI-compatible server)",
}

_MODELS: dict[ProviderKind, str] = {
    "openai": """\
  - name: gpt-4o-mini                 # the model name clients send
    model: openai/gpt-4o-mini         # litellm model string: provider/model
    api_base: ${OPENAI_BASE_URL:-}    # OPENAI_BASE_URL if set; empty: https://api.openai.com/v1
    api_key: ${OPENAI_API_KEY}        # the provider key; clients' proxy keys are never forwarded
    max_output_tokens: 1024           # output reserve when a request sets no max_tokens
    # context_window: 128000          # max input tokens; left out, litellm's model info gives it
""",
    "anthropic": """\
  - name: claude-haiku-4-5            # the model name clients send
    model: anthropic/claude-haiku-4-5 # litellm model string: litellm translates each request into
                                      # Anthropic's Messages API
    api_base: ${ANTHROPIC_API_BASE:-} # empty: https://api.anthropic.com
    api_key: ${ANTHROPIC_API_KEY}     # the provider key; clients' proxy keys are never forwarded
    max_output_tokens: 1024           # output reserve when a request sets no max_tokens
    # context_window: 200000          # max input tokens; left out, litellm's model info gives it
""",
    "ollama": """\
  - name: llama3.2                    # the model name clients send
    model: openai/llama3.2            # openai/ + the name Ollama knows (`ollama pull llama3.2`): its
                                      # OpenAI-compatible API, through litellm (the default
                                      # transport; `transport: openai` for memproxy's own client)
    api_base: http://127.0.0.1:11434/v1 # Ollama's address (from a container: host.docker.internal)
    api_key: ${OLLAMA_API_KEY:-ollama} # Ollama checks none; set so OPENAI_API_KEY is never sent here
    context_window: 8192              # litellm knows no window for a local model. Ollama runs each
                                      # with its own context length (as little as 2048 by default)
                                      # and cuts longer prompts silently: start it with
                                      # OLLAMA_CONTEXT_LENGTH=8192 ollama serve, and keep the two equal
    max_output_tokens: 1024           # output reserve when a request sets no max_tokens
""",
    "vllm": """\
  - name: llama-3.1-8b                # the model name clients send
    model: openai/meta-llama/Llama-3.1-8B-Instruct # openai/ + the name vLLM serves (its
                                      # --served-model-name, else the model's path)
    api_base: http://127.0.0.1:8000/v1 # `vllm serve`'s OpenAI-compatible API
    api_key: ${VLLM_API_KEY:-none}    # vLLM's --api-key, if it was started with one
    context_window: 8192              # litellm knows no window for a served model: vLLM's
                                      # --max-model-len (it refuses longer prompts)
    max_output_tokens: 1024           # output reserve when a request sets no max_tokens
""",
}

# Tokens are counted with tiktoken's o200k_base for a model it does not know, close to a local
# model's own tokenizer but not equal: a wider margin keeps a full request inside the window.
_LOCAL_MARGIN = """\
  safety_margin_tokens: 400    # tokens kept free beyond the output reserve (default 1% of the
                               # window): counts are tiktoken's, near the local model's own
"""


def starter_config(provider: ProviderKind) -> str:
    margin = _LOCAL_MARGIN if provider in ("ollama", "vllm") else ""
    return f"""\
# memproxy configuration for {_TITLES[provider]}, written by `memproxy init --provider {provider}`.
# Check it with `memproxy check-config -c FILE`, then start with `memproxy serve -c FILE`; clients
# then use http://127.0.0.1:8080/v1 as their OpenAI base URL, with an X-Session-Id header.
# Every key, with its default and what it does, is in config.example.yaml. Any string value may use
# ${{ENV_VAR}} or ${{ENV_VAR:-default}}; an unset variable without a default is a start-up error that
# names the key.

server:
  host: 127.0.0.1              # address to bind; a non-loopback one (0.0.0.0) needs auth.keys
  port: 8080                   # port to bind; 0 picks a free one (printed at start)

storage:
  url: "sqlite:///./memproxy.db" # one SQLite file (relative to where memproxy runs), created on
                                 # start; or postgresql://user@host:5432/db for many replicas

# The models clients may name. A request for any other name gets 404 model_not_found.
models:
{_MODELS[provider]}
memory:
{margin}  summarizer_model: null       # model that writes the rolling summaries (a name in models);
                               # null: the session's own model. A cheaper one saves money

auth:
  # Proxy API keys (Authorization: Bearer <key>), each naming the tenant its sessions belong to.
  # With no keys every caller is tenant "default" and only a loopback address may be bound.
  keys: []
  # keys:
  #   - {{key: "${{MEMPROXY_KEY_A}}", tenant: a}}   # key: at least 8 characters; tenant: any name
"""

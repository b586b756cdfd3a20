"""litellm's callbacks (Langfuse, OpenTelemetry, a CustomLogger of one's own), as the config lists them.

Off unless `litellm.callbacks` names some: a callback receives the content of every message sent to a
model through litellm and of every answer, summariser calls included, and memproxy's own logs never
hold content. So the proxy says so in a WARNING at start, naming the callbacks (never a key), and
names the models whose calls they will not see: those on memproxy's own OpenAI client.

A name is one of litellm's integrations (`langfuse`, `otel`, `datadog`, ...: checked against the ones
litellm knows, so a misspelt name fails at start rather than logging nothing), or a Python path
`module.attribute` (or `module:attribute`) to a `CustomLogger` instance or subclass, which is
instantiated with no arguments, as litellm's own proxy loads custom callbacks.

litellm keeps callbacks in module-wide lists, and copies each one into several of them on its first
call. `Callbacks.install` remembers those lists as they were and `remove` puts them back, so a proxy
that stops (or a test's) leaves none of its callbacks to the next one in the process.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from .config import ConfigError, LitellmConfig

log = logging.getLogger("memproxy.observability")

# Every list litellm copies a callback into (litellm.utils.function_setup, logging_callback_manager).
_LISTS = ("callbacks", "input_callback", "success_callback", "failure_callback", "service_callback",
          "_async_input_callback", "_async_success_callback", "_async_failure_callback")
DOCS = "https://docs.litellm.ai/docs/observability/callbacks"


def resolve(litellm: Any, settings: LitellmConfig) -> list[Any]:
    """What each configured name stands for: an integration's name as it is, a path as the
    CustomLogger class or instance it names (nothing is instantiated here: `memproxy check-config`
    calls this too). A name litellm does not know, or a path to no CustomLogger: a `ConfigError`."""
    custom_logger: type = importlib.import_module("litellm.integrations.custom_logger").CustomLogger
    known = set(litellm._known_custom_logger_compatible_callbacks)
    found: list[Any] = []
    for i, name in enumerate(settings.callbacks):
        key = f"litellm.callbacks[{i}]"
        if "." not in name and ":" not in name:
            if name not in known:
                raise ConfigError(key, f"litellm has no callback {name!r} (its integrations: {DOCS}), "
                                       "and it is not a module.attribute path")
            found.append(name)
            continue
        module_name, _, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(key, f"cannot import {module_name!r}: {exc}") from None
        target = getattr(module, attribute, None)
        if not (isinstance(target, custom_logger) or isinstance(target, type) and issubclass(target, custom_logger)):
            raise ConfigError(key, f"{name!r} is not a litellm CustomLogger (a subclass or an instance)")
        found.append(target)
    return found


class Callbacks:
    """The callbacks one provider installed into litellm, and litellm's lists as they were before."""

    def __init__(self, litellm: Any, saved: dict[str, Any] | None = None) -> None:
        self._litellm = litellm
        self._saved = saved

    @classmethod
    def install(cls, litellm: Any, settings: LitellmConfig, unseen: Sequence[str]) -> Callbacks:
        """Add the configured callbacks to litellm's; with none configured litellm is not touched.
        `unseen`: the models on memproxy's own OpenAI client, whose calls never pass through litellm."""
        if not settings.callbacks:
            return cls(litellm)
        resolved = [target() if isinstance(target, type) else target for target in resolve(litellm, settings)]
        saved: dict[str, Any] = {name: list(getattr(litellm, name)) for name in _LISTS}
        saved["turn_off_message_logging"] = litellm.turn_off_message_logging
        litellm.callbacks = [*litellm.callbacks, *resolved]
        litellm.turn_off_message_logging = settings.turn_off_message_logging
        names = ", ".join(settings.callbacks)
        if settings.turn_off_message_logging:
            log.warning("litellm callbacks on (%s), with turn_off_message_logging: litellm's integrations get no "
                        "message content, but a CustomLogger's arguments still hold every message sent through "
                        "litellm and the provider's API key", names)
        else:
            log.warning("litellm callbacks on (%s): they receive the content of every message sent to a model "
                        "through litellm and of every answer, summaries included (turn_off_message_logging "
                        "keeps it out of litellm's integrations); a CustomLogger's arguments also hold the "
                        "provider's API key", names)
        if unseen:
            log.warning("litellm callbacks do not see models %s: they use memproxy's own OpenAI client "
                        "(transport: openai on them; the default, litellm, sends their calls through litellm)", ", ".join(unseen))
        return cls(litellm, saved)

    def remove(self) -> None:
        """litellm's callback lists and redaction setting as they were before `install`."""
        for name, value in (self._saved or {}).items():
            setattr(self._litellm, name, value)
        self._saved = None

"""Log lines as text or JSON (`logging.format`), and what `memproxy serve` says when it starts.

Lines are the standard library's: a module logs a short message and, where it has fields, passes them
with `extra=`; the formatter writes them after the message (`key=value`, text) or beside it (one JSON
object per line). Fields are identifiers, counts, times and codes: never message content, metadata
values or keys (`memproxy.redact`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

from . import __version__
from .config import Config, LogFormat, LogLevel
from .provider import transport

log = logging.getLogger("memproxy")

_PLAIN = re.compile(r'[^\s"=]+')  # a value written as it is; any other is quoted, so a line stays one line
# What every LogRecord carries: anything else on a record came in through `extra=`.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was given with `extra=`."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class TextFormatter(logging.Formatter):
    """`2026-01-01 12:00:00,000 INFO memproxy.http request method=POST route=/v1/chat/completions ...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = fields(record)
        if not extra:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below the line
        pairs = " ".join(f"{key}={_text(value)}" for key, value in extra.items())
        return f"{head} {pairs}{newline}{rest}"


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    if isinstance(value, (bool, int)) or value is None:
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)  # quoted: one line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `time` (UTC, ISO 8601), `level`, `logger`, `message`, the fields,
    and `exception` where there is a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        created = time.gmtime(record.created)
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", created) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in fields(record).items():
            entry[key] = round(value, 2) if isinstance(value, float) else value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(level: LogLevel, format: LogFormat, stream: TextIO | None = None) -> None:
    """The process's logging: `level`, lines in `format`, to standard error."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if format == "json" else TextFormatter())
    logging.basicConfig(level=level, handlers=[handler])


def log_start(config: Config, windows: dict[str, int]) -> None:
    """The start-up line (version, models, store kind, auth) and a warning for each setting that is
    likely a mistake. `windows`: each model's context window, as the provider resolved it."""
    auth = config.auth
    models = [{"name": m.name, "provider": m.model.split("/", 1)[0] if "/" in m.model else "openai",
               "window": windows.get(m.name), "transport": transport(m)} for m in config.models]
    log.info("memproxy starting", extra={
        "version": __version__,
        "models": models,
        "store": "postgresql" if config.storage.is_postgres else "sqlite",
        "auth": "keys" if auth.keys or auth.admin_keys else "none",
        "tenant_keys": len(auth.keys),
        "admin_keys": len(auth.admin_keys),
        # Who may read `/metrics`: anyone where it is public or no key of any kind is configured.
        "metrics": "public" if config.metrics.public or not (auth.keys or auth.admin_keys) else "admin",
    })
    if not config.models:
        log.warning("no models configured: every chat request will be answered 404 model_not_found")
    for index, model in enumerate(config.models):
        if model.api_key == "":
            log.warning("a model's api_key is empty (an unset environment variable?): the provider will "
                        "likely refuse its requests", extra={"model": model.name, "setting": f"models[{index}].api_key"})

"""A litellm CustomLogger for the tests of `litellm.callbacks` (tests/test_observability.py): it keeps
what litellm hands it, so a test can read what an observability integration would have received.

The config names it by path, `callback_recorder.RecordingLogger` (a class, which memproxy instantiates)
or `callback_recorder:RECORDER` (an instance). Every instance records into the one class-wide list.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from litellm.integrations.custom_logger import CustomLogger


@dataclass(frozen=True)
class Event:
    kind: str  # "success" or "failure"
    kwargs: dict[str, Any]


class RecordingLogger(CustomLogger):  # type: ignore[misc]  # litellm's class is untyped
    events: list[Event] = []
    set_up_on: list[str] = []  # the thread each call's synchronous set-up ran on (`log_pre_api_call`)
    _lock = threading.Lock()

    @classmethod
    def seen(cls) -> list[Event]:
        with cls._lock:
            return list(cls.events)

    @classmethod
    def clear(cls) -> None:
        with cls._lock:
            cls.events.clear()
            cls.set_up_on.clear()

    def log_pre_api_call(self, model: Any, messages: Any, kwargs: Any) -> None:
        with self._lock:
            self.set_up_on.append(threading.current_thread().name)

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        with self._lock:
            self.events.append(Event("success", dict(kwargs)))

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        with self._lock:
            self.events.append(Event("failure", dict(kwargs)))


RECORDER = RecordingLogger()

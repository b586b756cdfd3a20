"""Prometheus metrics: what `GET /metrics` serves, and the small calls that feed it.

Each app holds its own `Metrics` (a `CollectorRegistry` behind `typedefs.METRICS`), so several apps in
one process (the tests) never share a series. The handlers feed it through a few methods, one per
event (a request answered, a chat turn recorded, a summary tried, a store failure), each a few
dictionary look-ups and additions: about 13 µs of CPU for everything a chat turn records (10,000 in
a loop; some 75 µs measured inside a busy server, caches cold), next to the 1.9 ms of CPU a
memory-on turn costs memproxy (docs/benchmarks.md).

Several worker processes: with `PROMETHEUS_MULTIPROC_DIR` set in the environment before the process
starts (prometheus-client reads it once, when it is imported), every process writes its values to
files in that directory, and a scrape of any one of them reads all the files through
`MultiProcessCollector` into a registry made for that scrape; counters and histograms are summed
across processes. The directory must be emptied before the workers start. The process collector
(CPU, memory, open files) describes one process only, so it is left out in that mode.

What the store holds (sessions, messages) is read from the store at each scrape, by a collector of
the scrape's own: the same answer whichever process is asked, and never kept between scrapes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from . import __version__
from .config import MetricsConfig
from .timing import PARTS

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
StoreErrorPlace = Literal["request", "passthrough", "record", "summary", "sweep", "metrics"]
TokenKind = Literal["prompt", "completion"]
NO_TENANT = ""  # the label of a request no key named
ADMIN_TENANT = "(admin)"  # the label of an admin key's request

# Memory work: well under a millisecond to a few seconds (a summary folded before the request).
_MEMORY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A provider's answer, or a whole request: tens of milliseconds to the 600 s default timeout.
_Metric = TypeVar("_Metric", Counter, Histogram)
_SLOW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                 600.0)


class Metrics:
    """One app's metrics. With `tenant_label`, the per-tenant counters (requests, tokens) carry a
    `tenant` label: one series per tenant, so it is off unless asked for."""

    def __init__(self, config: MetricsConfig) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess = bool(os.environ.get(MULTIPROCESS_ENV))
        self._tenant = config.tenant_label
        tenant = ("tenant",) if config.tenant_label else ()
        registry = self.registry
        self.requests = Counter(
            "memproxy_requests", "HTTP requests answered, by route pattern, method, status, model and "
            "reconcile kind (model and kind empty where they do not apply)",
            ("endpoint", "method", "status", "model", "reconcile", *tenant), registry=registry)
        self.request_seconds = Histogram(
            "memproxy_request_duration_seconds", "Time to answer an HTTP request (a stream: to its end)",
            ("endpoint", "method"), buckets=_SLOW_BUCKETS, registry=registry)
        self.memory_seconds = Histogram(
            "memproxy_memory_seconds", "A chat request's time outside the upstream call, by part "
            "(Server-Timing's parts; `memory` is their sum)", ("part",), buckets=_MEMORY_BUCKETS,
            registry=registry)
        self.upstream_seconds = Histogram(
            "memproxy_upstream_seconds", "The upstream call of a chat request (a stream: until its last chunk)",
            ("model",), buckets=_SLOW_BUCKETS, registry=registry)
        self.tokens_sent = Counter(
            "memproxy_tokens_sent", "Input tokens memproxy sent upstream for recorded turns (its own count)",
            ("model", *tenant), registry=registry)
        self.tokens_saved = Counter(
            "memproxy_tokens_saved", "Input tokens recorded turns did not send that resending the whole "
            "history would have", ("model", *tenant), registry=registry)
        self.upstream_tokens = Counter(
            "memproxy_upstream_tokens", "Tokens the provider reported, for recorded turns and summariser calls",
            ("model", "type", "purpose", *tenant), registry=registry)
        self.tokens_summarised = Counter(
            "memproxy_tokens_summarised", "Tokens of stored messages folded into summaries",
            ("model",), registry=registry)
        self.summaries = Counter(
            "memproxy_summaries", "Summary folds tried, by outcome", ("outcome",), registry=registry)
        self.store_errors = Counter(
            "memproxy_store_errors", "Store failures, by where they were met", ("where",), registry=registry)
        self.refusals_for_length = Counter(
            "memproxy_refused_for_length", "Planned requests the provider refused as too long, each then "
            "planned again for its count (`memory.calibrate_tokens`)", ("model",), registry=registry)
        if not self.multiprocess:
            ProcessCollector(registry=registry)
        # A series is looked up once (`labels` costs 0.9 µs, a dictionary 0.05): every label value is
        # one of a few (a route pattern, a status, a configured model, a configured tenant).
        self._series: dict[tuple[int, tuple[str, ...]], Counter | Histogram] = {}
        self._parts = {part: self.memory_seconds.labels(part) for part in (*PARTS, "memory")}

    # --- events ------------------------------------------------------------------------------------

    def request(self, endpoint: str, method: str, status: int, seconds: float, model: str = "",
                reconcile: str = "", tenant: str = NO_TENANT) -> None:
        labels = (endpoint, method, str(status), model, reconcile, tenant) if self._tenant else \
            (endpoint, method, str(status), model, reconcile)
        self._get(self.requests, labels).inc()
        self._get(self.request_seconds, (endpoint, method)).observe(seconds)

    def chat_timings(self, model: str, split_ms: Mapping[str, float], upstream_ms: float) -> None:
        """A chat request's `Server-Timing` split (`memproxy.timing`), in ms."""
        for part, ms in split_ms.items():
            self._parts[part].observe(ms / 1000)
        self._get(self.upstream_seconds, (model,)).observe(upstream_ms / 1000)

    def turn(self, model: str, tenant: str, sent: int, full: int, prompt: int | None,
             completion: int | None) -> None:
        """A recorded turn: what it sent, what resending everything (`full`) would have, its usage."""
        labels = (model, tenant) if self._tenant else (model,)
        self._get(self.tokens_sent, labels).inc(sent)
        self._get(self.tokens_saved, labels).inc(max(full - sent, 0))  # a counter: never less
        self.usage(model, prompt, completion, "chat", tenant)

    def usage(self, model: str, prompt: int | None, completion: int | None, purpose: Literal["chat", "summary"],
              tenant: str = NO_TENANT) -> None:
        extra = (tenant,) if self._tenant else ()
        if prompt:
            self._get(self.upstream_tokens, (model, "prompt", purpose, *extra)).inc(prompt)
        if completion:
            self._get(self.upstream_tokens, (model, "completion", purpose, *extra)).inc(completion)

    def summary(self, outcome: str, model: str, tokens_folded: int) -> None:
        self.summaries.labels(outcome).inc()
        if tokens_folded:
            self.tokens_summarised.labels(model).inc(tokens_folded)

    def store_error(self, where: StoreErrorPlace) -> None:
        self.store_errors.labels(where).inc()

    def refused_for_length(self, model: str) -> None:
        self.refusals_for_length.labels(model).inc()

    def _get(self, metric: _Metric, labels: tuple[str, ...]) -> _Metric:
        key = (id(metric), labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*labels)
        return cast(_Metric, series)  # a series of `metric`: of its type

    # --- the scrape --------------------------------------------------------------------------------

    def exposition(self, stored: tuple[int, int] | None, accept: str | None) -> tuple[bytes, str]:
        """The body and its content type for a scrape (the text format, or OpenMetrics where the
        scraper's `Accept` asks for it); `stored`: the store's sessions and messages, or None
        where the store could not say."""
        scrape = CollectorRegistry()  # this scrape's own: the app's metrics, and what is read now
        if self.multiprocess:
            # every process's files, this one's included (the library leaves this one untyped)
            MultiProcessCollector(scrape)  # type: ignore[no-untyped-call]
        else:
            scrape.register(self.registry)
        scrape.register(_Scrape(stored))
        encoder, content_type = _encoder(accept or "")
        return encoder(scrape), content_type


# The version a scrape's Content-Type names: numbers, as a scraper's `Accept` asks for them.
_NUMBERED = re.compile(r"; version=[0-9]+(?:\.[0-9]+)*;")


def _encoder(accept: str) -> tuple[Callable[[CollectorRegistry], bytes], str]:
    """prometheus-client's encoder and content type for a scraper's `Accept`, or the text format
    where that asks for a version that is not numbers: the library compares it as numbers and
    raises (a 500), or, where its first number decides ("2.x"), echoes it into the answer's
    Content-Type as sent, whatever characters follow."""
    try:
        encoder, content_type = choose_encoder(accept)
    except TypeError:
        return choose_encoder("")
    if not (content_type.isascii() and _NUMBERED.search(content_type)):
        return choose_encoder("")
    return encoder, content_type


class _Scrape:
    """What is read at scrape time: the build, and what the store holds."""

    def __init__(self, stored: tuple[int, int] | None) -> None:
        self._stored = stored

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("memproxy_build_info", "The running memproxy's version", labels=("version",))
        info.add_metric((__version__,), 1)
        yield info
        if self._stored is None:
            return
        sessions, messages = self._stored
        yield GaugeMetricFamily("memproxy_sessions_stored", "Sessions in the store (PostgreSQL: the "
                                "planner's estimate past 100,000)", value=sessions)
        yield GaugeMetricFamily("memproxy_messages_stored", "Messages in the store, superseded ones included "
                                "(PostgreSQL: the planner's estimate past 100,000)", value=messages)

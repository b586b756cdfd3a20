"""Results to `benchmarks.md`, `bench-results.json` and PNG plots.

Every figure is the median over rounds of a per-round statistic; "added" latency is, round by
round, a path's percentile minus the direct path's at the same settings, so drift between rounds
cancels out. Targets are ratios, so they carry over from this machine to another better than the
milliseconds do.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from memproxy.timing import PARTS as TIMING_PARTS  # noqa: E402

DIRECT, MEMORY, PASS, LITELLM = "direct", "memproxy-memory", "memproxy-pass", "litellm-proxy"
OWN = "memproxy-own"
LABELS = {DIRECT: "direct", MEMORY: "memproxy, memory on", PASS: "memproxy, pass-through",
          OWN: "memproxy, memory on, own client", LITELLM: "LiteLLM proxy",
          "memproxy-litellm": "memproxy, memory on, via litellm"}  # results saved before litellm was the default
COLORS = {DIRECT: "#888888", MEMORY: "#1f77b4", PASS: "#6baed6", OWN: "#9ecae1", "memproxy-litellm": "#9ecae1", LITELLM: "#d62728"}
SECTIONS = ("## Targets", "## Machine, versions and settings", "## 1. Added latency",
            "## 2. Throughput", "## 3. Streams", "## 4. History sweep",
            "## 4b. Long sessions sent whole", "## 5. Resident memory",
            "## 6. Where the time goes", "## 7. Token-cost replay", "## 8. Recall quality", "## 9. Recall speed",
            "## How it was measured")
PLOTS = ("bench-latency.png", "bench-throughput.png", "bench-ttft.png", "bench-history.png", "bench-rss.png",
         "bench-timing.png", "bench-tokens.png", "bench-recall.png")
# Issue 14's targets for the recall replay: window -> least evidence recall, overall and multi-hop.
RECALL_TARGETS = {"4000": 0.90, "2000": 0.85}
MULTI_HOP_TARGET = ("4000", "1", 0.75)
MODE_LABELS = {"off": "recall off", "bm25": "plain BM25", "recall": "recall"}
LONG_TRANSPORTS = {"openai": "own client", "litellm": "via litellm"}
CATEGORY_NAMES = {"1": "multi-hop", "2": "temporal", "3": "open-domain", "4": "single-hop", "5": "adversarial"}


def median(values: list[float]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def stat(rounds: list[dict[str, Any]], key: str) -> float:
    return median([r.get(key, math.nan) for r in rounds])


def added_per_round(rounds: list[dict[str, Any]], direct: list[dict[str, Any]], key: str) -> list[float]:
    return [r.get(key, math.nan) - d.get(key, math.nan) for r, d in zip(rounds, direct)]


def added(rounds: list[dict[str, Any]], direct: list[dict[str, Any]], key: str) -> float:
    return median(added_per_round(rounds, direct, key))


def quotients(mine: list[float], theirs: list[float]) -> list[float]:
    """Round by round, `mine / theirs`."""
    return [m / t if t else math.inf for m, t in zip(mine, theirs)]


def spread(values: list[float], digits: int = 2) -> str:
    """`min–max` over rounds, the range a target's median comes from."""
    clean = [v for v in values if v is not None and not math.isnan(v) and not math.isinf(v)]
    if not clean:
        return "-"
    low, high = min(clean), max(clean)
    return f"{low:.{digits}f}–{high:.{digits}f}" if len(clean) > 1 else f"{low:.{digits}f} (one round)"


def ms(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def ratio(value: float) -> str:
    return "-" if value is None or math.isnan(value) or math.isinf(value) else f"{value:.2f}"


Target = tuple[str, str, str, str, bool | None]


def verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("**pass**" if ok else "**FAIL**")


# What each `run.py --only` reruns, as the page says it: alone, and beside a saved run.
_ONLY_SECTIONS = {"recall": "sections 8 and 9", "recall-quality": "section 8"}
_ONLY_FROM = {"recall": "Sections 8 and 9 (and their targets) are", "recall-quality": "Section 8 (and its targets) is"}


class Report:
    def __init__(self, results: dict[str, Any], out: Path, small: bool) -> None:
        self.r = results
        self.out = out
        self.small = small
        self.paths: list[str] = results.get("paths", [])
        self.lines: list[str] = []

    # --- figures ---------------------------------------------------------------------------

    def figure(self, width: float = 8, height: float = 4) -> tuple[Any, Any]:
        size = (width * 0.6, height * 0.6) if self.small else (width, height)
        return plt.subplots(1, 1, figsize=size)

    def save(self, fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=50 if self.small else 110, bbox_inches="tight")  # legends below the axes too
        plt.close(fig)

    # --- computed figures ------------------------------------------------------------------

    def added_table(self) -> dict[str, dict[str, tuple[float, float]]]:
        """concurrency -> path -> (added p50, added p99), at the upstream delay."""
        table: dict[str, dict[str, tuple[float, float]]] = {}
        for c, by_path in self.r["concurrency"].items():
            direct = by_path[DIRECT]
            table[c] = {p: (added(rows, direct, "p50"), added(rows, direct, "p99"))
                        for p, rows in by_path.items() if p != DIRECT}
        return table

    def throughput(self) -> dict[str, tuple[dict[str, Any], list[float]]]:
        """path -> (its median round of the ladder, every round's highest rate). With an odd number of
        rounds the median round is one that was run: its rate is a step of the ladder, and its
        requests per CPU-second were measured at that step."""
        out = {}
        for path, rounds in self.r["throughput"].items():
            ordered = sorted(rounds, key=lambda x: x["max_rate"])
            out[path] = (ordered[len(ordered) // 2], [x["max_rate"] for x in rounds])
        return out

    def history(self) -> list[tuple[int, float, float, float, float]]:
        rows = []
        for size, rounds in sorted(self.r["history"].items(), key=lambda kv: int(kv[0])):
            rows.append((int(size), stat(rounds, "p50"), stat(rounds, "p99"), stat(rounds, "memory_p50"),
                         stat(rounds, "context_tokens_p50")))
        return rows

    def targets(self) -> list[Target]:
        """Each target as (name, measured, ratio of the medians, ratio per round min–max, verdict)."""
        return (self.path_targets() + self.litellm_targets() if "concurrency" in self.r else []) \
            + self.recall_targets()

    def litellm_targets(self) -> list[Target]:
        """Issue 15's: memproxy on its default path (memory on, through litellm) against LiteLLM's
        proxy, and its `upstream` part against litellm in a bare loop (`bare.py`)."""
        rows: list[Target] = []
        if LITELLM in self.paths:
            for c, by_path in self.r["concurrency"].items():
                direct = by_path[DIRECT]
                mine, theirs = (added_per_round(by_path[p], direct, "p50") for p in (MEMORY, LITELLM))
                m, t = median(mine), median(theirs)
                rows.append((f"added p50 at {c} client{'s' if c != '1' else ''} at most 0.5x LiteLLM proxy's",
                             f"{ms(m)} ms vs {ms(t)} ms", ratio(m / t if t > 0 else math.inf),
                             spread(quotients(mine, theirs)), m <= 0.5 * t))
            busiest = self.r["concurrency"][self.busiest()]
            mine_cpu, theirs_cpu = ([r.get("requests_per_cpu_s") or math.nan for r in busiest[p]]
                                    for p in (MEMORY, LITELLM))
            m, t = median(mine_cpu), median(theirs_cpu)
            rows.append((f"requests per server CPU-second at least 2x LiteLLM proxy's ({self.busiest()} clients)",
                         f"{ms(m, 0)} vs {ms(t, 0)}", ratio(m / t if t else math.nan),
                         spread(quotients(mine_cpu, theirs_cpu)), m >= 2 * t))
        bare = self.r.get("bare")
        if bare:
            upstream = [r.get("upstream_p50", math.nan) for r in self.r["cpu"][MEMORY]]
            loop = [r["p50"] for r in bare]
            u, b = median(upstream), median(loop)
            rows.append(("`upstream` (Server-Timing, 1 client, 0 ms upstream) within 1 ms of a bare "
                         "litellm.acompletion loop (p50)", f"{ms(u, 2)} ms vs {ms(b, 2)} ms",
                         ratio(u / b if b else math.nan), spread(quotients(upstream, loop)), u - b <= 1.0))
        return rows

    def recall_scores(self) -> dict[str, dict[str, Any]]:
        """mode -> window -> scores, from the recall replay (empty if it did not run)."""
        rec = self.r.get("recall") or {}
        return {} if "skipped" in rec else rec.get("modes", {})

    def recall_overflows(self) -> int | None:
        rec = self.r.get("recall") or {}
        if "replay" not in rec:
            return None
        return (sum(w["overflows"] for w in rec["replay"].values())
                + sum(w["overflows"] for mode in rec["modes"].values() for w in mode.values()))

    def recall_speed(self) -> dict[str, list[float]]:
        """`small-on`, `big-off`, ... -> memory work p50 per round."""
        speed = self.r.get("recall_speed") or {}
        return {name: [r.get("memory_p50", math.nan) for r in rounds]
                for name, rounds in speed.get("results", {}).items()}

    def recall_targets(self) -> list[Target]:
        """Issue 14's: evidence recall on the replay (ratio = measured / target: at least 1 passes),
        no overflow, and what recall adds to a turn's memory work."""
        rows: list[Target] = []
        if "recall" in self.r:  # a run saved before the recall phases has neither
            rows += self.recall_quality_targets()
        if "recall_speed" in self.r:
            rows += self.recall_speed_targets()
        return rows

    def recall_quality_targets(self) -> list[Target]:
        rows: list[Target] = []
        scores = self.recall_scores().get("recall")
        others = self.recall_scores()

        def pct(value: float | None) -> str:
            return "-" if value is None else f"{value:.1%}"

        for window, least in RECALL_TARGETS.items():
            name = f"recall replay: evidence recall at {int(window):,} tokens at least {least:.0%}"
            got = scores[window]["overall"] if scores else None
            beside = ", ".join(f"{MODE_LABELS[m]} {pct(others[m][window]['overall'])}" for m in others if m != "recall")
            rows.append((name, f"{pct(got)}" + (f" ({beside})" if beside else ""),
                         ratio(got / least) if got is not None else "-", "-", None if got is None else got >= least))
        window, category, least = MULTI_HOP_TARGET
        got = scores[window]["by_category"].get(category, {}).get("recall") if scores else None
        rows.append((f"recall replay: multi-hop (category {category}) at {int(window):,} tokens at least {least:.0%}",
                     pct(got), ratio(got / least) if got is not None else "-", "-",
                     None if got is None else got >= least))
        overflows = self.recall_overflows()
        rows.append(("recall replay: no overflow (400 `context_length_exceeded`) in the replay or the questions",
                     "-" if overflows is None else str(overflows), "-", "-", None if overflows is None else overflows == 0))
        return rows

    def recall_speed_targets(self) -> list[Target]:
        rows: list[Target] = []
        speed = self.recall_speed()
        size = (self.r.get("recall_speed") or {}).get("session_size", 0)
        stores = (self.r.get("recall_speed") or {}).get("store_sizes", {})
        name = f"recall adds at most 1 ms to memory work at p50 ({size:,} messages in the session)"
        if "small-on" in speed and "small-off" in speed:
            extra = [on - off for on, off in zip(speed["small-on"], speed["small-off"])]
            rows.append((name, f"{ms(median(extra), 2)} ms ({ms(median(speed['small-on']), 2)} vs "
                         f"{ms(median(speed['small-off']), 2)} ms)", ratio(median(extra) / 1.0), spread(extra),
                         median(extra) <= 1.0))
        else:
            rows.append((name, "-", "-", "-", None))
        name = (f"memory work with {stores.get('big', 0):,} messages in the store within 1.2x of "
                f"{stores.get('small', 0):,} (p50, recall on)")
        if "big-on" in speed:
            big, small = speed["big-on"], speed["small-on"]
            r = median(big) / median(small)
            rows.append((name, f"{ms(median(big), 2)} ms vs {ms(median(small), 2)} ms", ratio(r),
                         spread(quotients(big, small)), r <= 1.2))
        elif "big-off" in speed:
            big, small = speed["big-off"], speed["small-off"]
            rows.append((name, f"recall off: {ms(median(big), 2)} ms vs {ms(median(small), 2)} ms",
                         ratio(median(big) / median(small)), spread(quotients(big, small)), None))
        else:
            rows.append((name, "-", "-", "-", None))
        return rows

    def path_targets(self) -> list[Target]:
        rows: list[Target] = []
        have_litellm = LITELLM in self.paths
        for c, by_path in self.r["concurrency"].items():
            direct = by_path[DIRECT]
            for key in ("p50", "p99"):
                name = f"added {key} at {c} client{'s' if c != '1' else ''} below LiteLLM proxy's"
                mine = added_per_round(by_path[MEMORY], direct, key)
                if not have_litellm:
                    rows.append((name, f"{ms(median(mine))} ms vs -", "-", "-", None))
                    continue
                theirs = added_per_round(by_path[LITELLM], direct, key)
                m, t = median(mine), median(theirs)
                rows.append((name, f"{ms(m)} ms vs {ms(t)} ms", ratio(m / t if t > 0 else math.inf),
                             spread(quotients(mine, theirs)), m < t))
        memory = [r.get("memory_p50", math.nan) for r in self.r["cpu"][MEMORY]]
        rows.append(("memory work under 1 ms at p50 (Server-Timing `memory`: all but the upstream call, 1 client, "
                     "0 ms upstream)", f"{ms(median(memory), 2)} ms", ratio(median(memory) / 1.0), spread(memory),
                     median(memory) < 1.0))
        sizes = sorted(self.r["history"], key=int)
        if len(sizes) >= 2:
            small, big = (self.r["history"][size] for size in (sizes[0], sizes[-1]))
            per_round = quotients([r["p50"] for r in big], [r["p50"] for r in small])
            r = stat(big, "p50") / stat(small, "p50")
            rows.append((f"latency at {int(sizes[-1]):,} stored messages within 1.2x of {int(sizes[0]):,} (p50)",
                         f"{ms(stat(big, 'p50'), 2)} ms vs {ms(stat(small, 'p50'), 2)} ms", ratio(r),
                         spread(per_round), r <= 1.2))
        rows.extend(self.long_targets())
        busiest = self.r["concurrency"][self.busiest()]
        name = (f"throughput per core at least LiteLLM proxy's (requests per server CPU-second, "
                f"{self.busiest()} clients)")
        mine_per_cpu = [r.get("requests_per_cpu_s") or math.nan for r in busiest[MEMORY]]
        if have_litellm:
            theirs_per_cpu = [r.get("requests_per_cpu_s") or math.nan for r in busiest[LITELLM]]
            m, t = median(mine_per_cpu), median(theirs_per_cpu)
            r = m / t if t else math.nan
            rows.append((name, f"{ms(m, 0)} vs {ms(t, 0)}", ratio(r), spread(quotients(mine_per_cpu, theirs_per_cpu)),
                         r >= 1.0))
        else:
            rows.append((name, f"{ms(median(mine_per_cpu), 0)} vs -", "-", "-", None))
        return rows

    def long_sizes(self) -> tuple[str, str] | None:
        """The long-session sweep's sizes the 1.5x target compares: those nearest 100 and 500 turns."""
        turns = [int(t) for t in self.r.get("long", {}).get("turns", [])]
        if len(turns) < 2:
            return None
        small, big = (min(turns, key=lambda t: abs(t - want)) for want in (100, 500))
        return (str(small), str(big)) if small != big else (str(turns[-2]), str(turns[-1]))

    def long_targets(self) -> list[Target]:
        sizes = self.long_sizes()
        if sizes is None:
            return []
        small, big = sizes
        rows: list[Target] = []
        for store, by_transport in self.r["long"]["stores"].items():
            for transport, by_size in by_transport.items():
                at_small, at_big = by_size[small], by_size[big]
                m_small, m_big = stat(at_small, "memory_p50"), stat(at_big, "memory_p50")
                tokens_small, tokens_big = stat(at_small, "context_tokens_p50"), stat(at_big, "context_tokens_p50")
                r = m_big / m_small
                rows.append((f"long sessions sent whole, {store}, {LONG_TRANSPORTS[transport]}: memory work at "
                             f"{tokens_big:,.0f} tokens sent within 1.5x of {tokens_small:,.0f} (p50)",
                             f"{ms(m_big, 2)} ms vs {ms(m_small, 2)} ms", ratio(r),
                             spread(quotients([x.get("memory_p50", math.nan) for x in at_big],
                                              [x.get("memory_p50", math.nan) for x in at_small])), r <= 1.5))
        return rows

    def sweep_window(self) -> str:
        window = self.r["meta"]["settings"]["memproxy"].get("sweep_window")
        return f"{window:,}" if window else "small"

    def plan(self) -> dict[str, Any]:
        plan: dict[str, Any] = self.r["meta"]["settings"]["plan"]
        return {"p99_limit_ms": 100.0, **plan}  # results saved before the limit was a setting

    def busiest(self) -> str:
        return str(max(self.r["concurrency"], key=int))

    def saturation(self) -> dict[str, tuple[float, float, float]]:
        """path -> (req/s, cores its server used, requests per server CPU-second) at the most clients."""
        out = {}
        for path, rows in self.r["concurrency"][self.busiest()].items():
            cores = median([r["server_cpu_s"] / r["wall_s"] for r in rows if r["wall_s"]])
            out[path] = (stat(rows, "throughput_rps"), cores, stat(rows, "requests_per_cpu_s"))
        return out

    # --- sections --------------------------------------------------------------------------

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def header(self) -> None:
        meta = self.r["meta"]
        self.add("# Benchmarks", "",
                 f"Generated by `python bench/run.py{' --quick' if meta['quick'] else ''}` on {meta['started']} "
                 f"in {meta['duration_s']:.0f} s; rerun it to refresh this page (do not edit it by hand). "
                 "How each figure is measured is in `bench/README.md` and at the end of this page.", "")
        if meta["quick"]:
            self.add("> **Quick run**: one round of a handful of requests each, for the CI smoke test. "
                     "These numbers are not meaningful; run `python bench/run.py` for real ones.", "")
        if meta.get("only") in ("recall", "recall-quality"):
            self.add(f"> **Recall phases only** (`--only {meta['only']}`): {_ONLY_SECTIONS[meta['only']]}; no saved "
                     "run of the same kind was beside this page to complete it.", "")
        if "recall_run" in meta:
            run = meta["recall_run"]
            only = run.get("only", "recall")
            self.add(f"> {_ONLY_FROM[only]} from `python bench/run.py --only {only}"
                     f"{' --quick' if meta['quick'] else ''}` on {run['started']} in "
                     f"{run['duration_s']:.0f} s at "
                     f"commit {run['commit']} (1-minute load average {run['load_at_start']} at its start, "
                     f"{run['load_at_end']} at its end); the rest from the run above.", "")
            for note in run["notes"]:
                self.add(f"> **Note** (recall run): {note}", "")
        for note in meta["notes"]:
            self.add(f"> **Note**: {note}", "")

    def section_targets(self) -> None:
        workers = (f"Throughput per core is requests per CPU-second of each server's own processes when saturated: "
                   f"memproxy and LiteLLM's proxy run {self.workers_text()} (section 2). "
                   if "settings" in self.r["meta"] else "")  # else a recall-only run: no throughput measured
        self.add("## Targets", "",
                 "From issues 6, 14, 15 and 17, all measured in this one run. Ratio = memproxy / reference (below 1 is "
                 "better, except throughput per core, where at least 1 passes; for evidence recall it is "
                 "measured / target, at least 1 passes). \"Memory on\" is memproxy "
                 "with a session header on the default transport (litellm): the product; its pass-through "
                 f"and own-client figures are in section 1. {workers}The verdict is on the "
                 "medians over rounds; beside it, the range the ratio took round by round.", "",
                 "| target | measured | ratio | ratio per round (min–max) | result |", "|---|---|---|---|---|")
        for name, measured, r, per_round, ok in self.targets():
            self.add(f"| {name} | {measured} | {r} | {per_round} | {verdict(ok)} |")
        self.add("")

    def workers_text(self) -> str:
        """How many processes the measured servers ran (older saved runs: memproxy in one)."""
        s = self.r["meta"]["settings"]
        workers = s["memproxy"].get("workers", 1)
        if workers == s["litellm_proxy"]["workers"]:
            return f"{workers} workers each, one per core"
        return f"{workers} and {s['litellm_proxy']['workers']} workers"

    def section_machine(self) -> None:
        meta = self.r["meta"]
        m, v, s = meta["machine"], meta["versions"], meta["settings"]
        plan = s["plan"]
        self.add("## Machine, versions and settings", "",
                 f"- machine: {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {m['os']}; the load "
                 "generator, the fake upstream and the proxy under test all share these cores; 1-minute load "
                 f"average {m['load_at_start']} at the start, {m.get('load_at_end', '-')} at the end (above 0 "
                 "means other work shared the machine)",
                 f"- versions: Python {v['python']}, memproxy {v['memproxy']}, litellm {v['litellm']}, "
                 f"aiohttp {v['aiohttp']}, matplotlib {v['matplotlib']}; LiteLLM proxy: {v['litellm_proxy']}",
                 f"- memproxy: {s['memproxy']['process']}; {s['memproxy']['model']}; memory settings "
                 f"{json.dumps(s['memproxy']['memory'])} (everything else default); {s['memproxy']['auth']}",
                 f"- LiteLLM proxy: `--num_workers {s['litellm_proxy']['workers']}` (one per core, as its "
                 f"production guide says); {s['litellm_proxy']['config']}; env "
                 + ", ".join(f"`{k}={val}`" for k, val in s["litellm_proxy"]["env"].items()),
                 f"- client: {s['client']}",
                 f"- upstream: {s['upstream']}",
                 f"- rounds: {plan['rounds']} (streams: {max(1, min(plan['rounds'], plan.get('stream_rounds', 3)))}, "
                 "throughput ladder: "
                 f"{plan['throughput_rounds']}); requests per path and round: {plan['cpu_requests']} at 0 ms, "
                 + ", ".join(f"{n} at {c} client(s)" for c, n in plan["concurrency"].items())
                 + f" at {plan['upstream_delay_ms']:g} ms; streams "
                 + ", ".join(f"{n} at {c} client(s)" for c, n in plan["streams"].items())
                 + f" ({plan['stream_chunks']} chunks, {plan['stream_pace_ms']:g} ms apart); ladder "
                 + ", ".join(f"{r:g}" for r in plan["rates"]) + f" req/s, {plan['step_seconds']:g} s a step; "
                 f"soak {plan['soak_seconds']:g} s per server at {plan['soak_clients']} clients", "")

    def section_latency(self) -> None:
        cpu = self.r["cpu"]
        direct = cpu[DIRECT]
        self.add("## 1. Added latency", "",
                 "Client-observed latency minus the direct path's, per round, median of rounds (ms).", "",
                 "**0 ms upstream, 1 client** (what each path costs in CPU; server CPU is the proxy's own "
                 "processes, for direct the fake upstream's):", "",
                 "| path | p50 | p99 | added p50 | added p99 | server CPU per request |",
                 "|---|---|---|---|---|---|")
        for path in self.paths:
            rows = cpu[path]
            add50 = "-" if path == DIRECT else ms(added(rows, direct, "p50"), 2)
            add99 = "-" if path == DIRECT else ms(added(rows, direct, "p99"), 2)
            self.add(f"| {LABELS[path]} | {ms(stat(rows, 'p50'), 2)} | {ms(stat(rows, 'p99'), 2)} | {add50} | "
                     f"{add99} | {ms(stat(rows, 'server_cpu_ms_per_request'), 2)} ms |")
        if self.r.get("bare"):
            bare = self.r["bare"]
            self.add("", "The default path's reference: `litellm.acompletion` in a plain asyncio loop "
                     "(`bench/bare.py`, its own process, the same arguments and a conversation of the same "
                     f"shape) takes {ms(median([r['p50'] for r in bare]), 2)} ms a call at p50 "
                     f"({ms(median([r['cpu_ms'] for r in bare]), 2)} ms of its CPU), fake upstream included; "
                     "memproxy's `upstream` part on that path is in section 6.")
        table = self.added_table()
        conc = list(table)
        delay = self.plan()["upstream_delay_ms"]
        self.add("", f"**{delay:g} ms upstream**, added "
                 "p50 / p99 (and raw p50 / p99) by number of concurrent clients:", "",
                 "| path | " + " | ".join(f"{c} client{'s' if c != '1' else ''}" for c in conc) + " |",
                 "|---|" + "---|" * len(conc))
        for path in self.paths:
            cells = []
            for c in conc:
                rows = self.r["concurrency"][c][path]
                raw = f"({ms(stat(rows, 'p50'))} / {ms(stat(rows, 'p99'))})"
                if path == DIRECT:
                    cells.append(f"- {raw}")
                else:
                    a50, a99 = table[c][path]
                    cells.append(f"+{ms(a50)} / +{ms(a99)} {raw}")
            self.add(f"| {LABELS[path]} | " + " | ".join(cells) + " |")
        self.add("", "Requests per second these closed loops reached (median of rounds):", "",
                 "| path | " + " | ".join(f"{c} client{'s' if c != '1' else ''}" for c in conc) + " |",
                 "|---|" + "---|" * len(conc))
        for path in self.paths:
            self.add(f"| {LABELS[path]} | " + " | ".join(
                ms(stat(self.r["concurrency"][c][path], "throughput_rps"), 0) for c in conc) + " |")
        self.add("", "![added latency](bench-latency.png)", "")
        fig, axes = plt.subplots(1, 2, figsize=(5.4, 2.7) if self.small else (10, 4.2))
        proxies = [p for p in self.paths if p != DIRECT]
        width = 0.8 / max(1, len(proxies))
        for i, (ax, name) in enumerate(zip(axes, ("p50", "p99"))):
            for j, path in enumerate(proxies):
                values = [max(table[c][path][i], 0.01) for c in conc]
                ax.bar([k + j * width for k in range(len(conc))], values, width, label=LABELS[path],
                       color=COLORS[path])
            ax.set_xticks([k + width * (len(proxies) - 1) / 2 for k in range(len(conc))])
            ax.set_xticklabels([f"{c} client{'s' if c != '1' else ''}" for c in conc])
            ax.set_yscale("log")
            ax.set_ylabel(f"added {name} latency (ms, log)")
            ax.set_title(f"added {name}, {delay:g} ms upstream")
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize="small")
        self.save(fig, "bench-latency.png")

    def section_throughput(self) -> None:
        plan = self.plan()
        rounds = len(next(iter(self.r["throughput"].values()), []))
        self.add("## 2. Throughput", "",
                 f"Open loop at {plan['upstream_delay_ms']:g} ms upstream: requests are due at a fixed rate and "
                 "timed from when they were due, so a queue shows. The highest rate of the ladder at which p99 "
                 f"stayed under {plan['p99_limit_ms']:g} ms with no error (a path stops climbing after two failed "
                 "steps in a row), and the requests served per CPU-second of the path's own server processes at "
                 f"that rate: the median round of {rounds}, with every round's highest rate beside it.", "",
                 f"| path | highest rate with p99 < {plan['p99_limit_ms']:g} ms | per round | requests per server "
                 "CPU-second |", "|---|---|---|---|")
        for path, (best, rates) in self.throughput().items():
            note = ""
            if best["ceiling"]:
                note = " (the ladder's top: the harness's limit)"
            elif best["steps"] and all(step["ok"] for step in best["steps"]):
                note = " (every step it ran passed: the ladder ended with the proxies)"
            self.add(f"| {LABELS[path]} | {best['max_rate']:g} req/s{note} | "
                     f"{', '.join(f'{rate:g}' for rate in rates)} | {ms(best['requests_per_cpu_s'] or math.nan, 0)} |")
        busiest = self.busiest()
        self.add("", f"Saturated: {busiest} clients back to back at {plan['upstream_delay_ms']:g} ms upstream "
                 "(section 1), where each server "
                 "runs as fast as the CPU it gets allows; requests per CPU-second of the server's own processes "
                 "is the throughput one core gives (the per-core target):", "",
                 "| path | req/s | server CPU used (cores) | requests per server CPU-second |", "|---|---|---|---|")
        for path, (rps, cores, per_cpu) in self.saturation().items():
            self.add(f"| {LABELS[path]} | {ms(rps, 0)} | {ms(cores, 2)} | {ms(per_cpu, 0)} |")
        self.add("", "![p99 against offered rate](bench-throughput.png)", "")
        fig, ax = self.figure(8, 4)
        for path in self.paths:
            steps = self.r["throughput"][path][0]["steps"]
            ax.plot([s["rate"] for s in steps], [s.get("p99", math.nan) for s in steps], "o-",
                    label=LABELS[path], color=COLORS[path])
        ax.axhline(plan["p99_limit_ms"], color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered rate (requests/s, log)")
        ax.set_ylabel("p99 latency (ms, log)")
        ax.set_title(f"p99 against offered rate, {plan['upstream_delay_ms']:g} ms upstream (first round)")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        self.save(fig, "bench-throughput.png")

    def section_streams(self) -> None:
        plan = self.plan()
        streams = self.r["streams"]
        conc = list(streams)
        self.add("## 3. Streams", "",
                 f"Time to the first content chunk of a paced SSE stream (first content at {plan['upstream_delay_ms']:g}"
                 f" ms, then {plan['stream_chunks'] - 1} more {plan['stream_pace_ms']:g} ms apart), added to the "
                 "direct path's; median of rounds (ms).", "",
                 "| path | " + " | ".join(f"{c} client{'s' if c != '1' else ''}: TTFT p50, added p50 / p99"
                                          for c in conc) + " |",
                 "|---|" + "---|" * len(conc))
        for path in self.paths:
            cells = []
            for c in conc:
                rows, direct = streams[c][path], streams[c][DIRECT]
                base = ms(stat(rows, "ttft_p50"))
                if path == DIRECT:
                    cells.append(f"{base}, -")
                else:
                    cells.append(f"{base}, +{ms(added(rows, direct, 'ttft_p50'))} / "
                                 f"+{ms(added(rows, direct, 'ttft_p99'))}")
            self.add(f"| {LABELS[path]} | " + " | ".join(cells) + " |")
        self.add("", "![added time to first token](bench-ttft.png)", "")
        fig, ax = self.figure(7, 3.6)
        proxies = [p for p in self.paths if p != DIRECT]
        width = 0.8 / max(1, len(proxies))
        for j, path in enumerate(proxies):
            values = [added(streams[c][path], streams[c][DIRECT], "ttft_p50") for c in conc]
            ax.bar([k + j * width for k in range(len(conc))], values, width, label=LABELS[path], color=COLORS[path])
        ax.set_xticks([k + width * (len(proxies) - 1) / 2 for k in range(len(conc))])
        ax.set_xticklabels([f"{c} client{'s' if c != '1' else ''}" for c in conc])
        ax.set_ylabel("added TTFT p50 (ms)")
        ax.set_title("added time to first token, paced stream")
        ax.legend(fontsize="small")
        ax.grid(axis="y", alpha=0.3)
        self.save(fig, "bench-ttft.png")

    def section_history(self) -> None:
        rows = self.history()
        base = rows[0][1] if rows else math.nan
        seeded = self.r.get("history_seed_s", {})
        self.add("## 4. History sweep", "",
                 "One client, 0 ms upstream, memory on, on sessions seeded through the Store API "
                 "(`record_turn`) with the given number of messages of ~400 tokens each, so that even the "
                 f"smallest fills the sweep model's {self.sweep_window()}-token window: every request sends the same amount "
                 "upstream and only the stored history differs. The sessions take the same requests in turn "
                 "(a new ~400-token user message each), so each also gains the sweep's own turns (2 messages "
                 "per request). Median of rounds.", "",
                 "| stored messages | p50 (ms) | p99 (ms) | memory work p50 (ms) | tokens sent p50 | p50 / p50 at "
                 f"{rows[0][0] if rows else '-'} | seeded in |", "|---|---|---|---|---|---|---|")
        for size, p50, p99, memory, tokens in rows:
            took = seeded.get(str(size), seeded.get(size))
            self.add(f"| {size:,} | {ms(p50, 2)} | {ms(p99, 2)} | {ms(memory, 2)} | {ms(tokens, 0)} | "
                     f"{ratio(p50 / base)} | {ms(took, 1) if took is not None else '-'} s |")
        self.add("", "![latency against stored history](bench-history.png)", "")
        fig, ax = self.figure(7, 3.8)
        sizes = [r[0] for r in rows]
        ax.plot(sizes, [r[1] for r in rows], "o-", label="latency p50", color=COLORS[MEMORY])
        ax.plot(sizes, [r[2] for r in rows], "s--", label="latency p99", color=COLORS[PASS])
        ax.plot(sizes, [r[3] for r in rows], "^-", label="memory work p50 (Server-Timing)", color="#2ca02c")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("messages stored in the session (log)")
        ax.set_ylabel("ms")
        ax.set_title("per-request latency against history length")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        self.save(fig, "bench-history.png")

    def section_long(self) -> None:
        long = self.r.get("long")
        if not long or not long.get("stores"):
            return
        turns = [str(t) for t in long["turns"]]
        self.add("## 4b. Long sessions sent whole", "",
                 f"One client, 0 ms upstream, memory on, on sessions of the given number of turns (~{long['words']} "
                 f"words a message, seeded through the Store API) that all fit a {long['window']:,}-token window, so "
                 "every turn sends the whole history upstream. Each round has sessions of its own (a session gains "
                 "at most a round's requests while measured); each request goes to every transport and size in "
                 "turn. Memory work is Server-Timing's `memory` (all but the upstream call); `upstream` is the "
                 "upstream call as memproxy timed it, serialising the request included. Median of rounds.", "",
                 "| store | transport | " + " | ".join(f"{int(t):,} turns" for t in turns) + " |",
                 "|---|---|" + "---|" * len(turns))
        for store, by_transport in long["stores"].items():
            for transport, by_size in by_transport.items():
                cells = [f"{ms(stat(by_size[t], 'memory_p50'), 2)} ms ({stat(by_size[t], 'context_tokens_p50'):,.0f}"
                         " tokens)" for t in turns]
                self.add(f"| {store} | {LONG_TRANSPORTS[transport]} | " + " | ".join(cells) + " |")
        self.add("", "What still grows with the size sent is the request itself. The upstream call as memproxy "
                 "times it (SQLite; on its own client, and through litellm, which also walks every message: "
                 "its provider transformation, its logging) beside the same body, as the upstream received "
                 "it, sent straight to the upstream by the load generator (already serialised: the "
                 "difference is serialising it and the HTTP client):", "",
                 "| turns | request body | `upstream` p50, own client | `upstream` p50, via litellm "
                 "| direct, same body, p50 |", "|---|---|---|---|---|")
        sqlite = long["stores"].get("sqlite", {})
        own, via = sqlite.get("openai", {}), sqlite.get("litellm", {})
        for t in turns:
            direct = long["direct"].get(t)
            if direct and t in own:
                litellm = f"{ms(stat(via[t], 'upstream_p50'), 2)} ms" if t in via else "-"
                self.add(f"| {int(t):,} | {direct['bytes'] / 1024:,.0f} KiB | {ms(stat(own[t], 'upstream_p50'), 2)} ms "
                         f"| {litellm} | {ms(direct['p50'], 2)} ms |")
        seeded = ", ".join(f"{store} {took} s" for store, took in long.get("seed_s", {}).items())
        self.add("", f"Seeding took {seeded}.", "")

    def section_rss(self) -> None:
        rss, soak = self.r["rss"], self.r["soak"]
        warmed = rss["marks"][1][0] if len(rss["marks"]) > 1 else 0.0  # the first phase after the warm-up
        self.add("## 5. Resident memory", "",
                 "RSS sampled twice a second through the whole run (a server's workers summed). Over the run: "
                 "the median of its last 5 s minus that of the 5 s after the warm-up. Over the soak (a steady "
                 "load on that server alone): steady is the median over its last third, growth the median of "
                 "its last fifth minus its first fifth.", "",
                 "| server | after start | after warm-up | end of run | growth over the run | peak | steady in the soak "
                 "| growth over the soak | soak requests |", "|---|---|---|---|---|---|---|---|---|")
        for path, info in soak.items():
            series = rss["series"].get(info["server"], [])
            if not series:
                continue
            values = [v for _, v in series]
            warm = median([v for t, v in series if warmed <= t <= warmed + 5]) if warmed else values[0]
            end = median([v for t, v in series if t >= series[-1][0] - 5])
            window = [v for t, v in series if info["start_s"] <= t <= info["end_s"]]
            steady = median(window[-max(1, len(window) // 3):]) if window else math.nan
            fifth = max(1, len(window) // 5)
            growth = median(window[-fifth:]) - median(window[:fifth]) if window else math.nan
            per = f" ({growth / info['requests'] * 10000:+.1f} MiB per 10k requests)" if info["requests"] else ""
            self.add(f"| {LABELS[path].split(',')[0]} | {values[0]:.0f} MiB | {ms(warm, 0)} MiB | {ms(end, 0)} MiB | "
                     f"{end - warm:+.1f} MiB | {max(values):.0f} MiB | {ms(steady, 0)} MiB | {growth:+.1f} MiB{per} | "
                     f"{info['requests']:,} |")
        self.add("", "![resident memory over the run](bench-rss.png)", "")
        fig, ax = self.figure(9, 4)
        for name, series in rss["series"].items():
            if series:
                ax.plot([t for t, _ in series], [v for _, v in series], label=name,
                        color={"memproxy": COLORS[MEMORY], "litellm-proxy": COLORS[LITELLM]}.get(name, "#888888"))
        for t, label in rss["marks"]:
            ax.axvline(t, color="black", alpha=0.2, linewidth=1)
            ax.text(t, ax.get_ylim()[1], " " + label, rotation=90, va="top", fontsize=6, alpha=0.6)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("resident memory")
        ax.legend(fontsize="small", loc="center right")
        ax.grid(alpha=0.3)
        self.save(fig, "bench-rss.png")

    def section_timing(self) -> None:
        cpu, conc = self.r["cpu"], self.r["concurrency"]
        self.add("## 6. Where the time goes", "",
                 "memproxy's `Server-Timing` header splits each request (README, \"What each response tells "
                 "you\"): `memory` is everything but the upstream call, from reading the body to the response, "
                 "in parts that do not overlap: `parse` (the body), `reconcile` (the session's lock and lookup, "
                 "matching the client's messages), `budget` (counting the new messages, building the context), "
                 "`store` (the store's reads and the turn's write) and `record` (describing the turn after the "
                 "call). `upstream` is the call (memproxy's OpenAI client, or litellm on the \"via litellm\" "
                 "path, plus the fake upstream's answer). The direct path's latency is the fake upstream and the "
                 "load generator alone, so `upstream - direct` is roughly the share of memproxy's client, and "
                 "`total - memory - upstream` the HTTP server's own work and the load generator's. Medians of "
                 "per-round p50s (ms); the p50s of the parts need not add up to that of `memory`.", "",
                 "| setting | path | total | memory | " + " | ".join(TIMING_PARTS) + " | upstream | of which direct "
                 "| rest |", "|---|---|---|---|" + "---|" * len(TIMING_PARTS) + "---|---|---|")
        bars = []
        delay = self.plan()["upstream_delay_ms"]
        settings = [("0 ms upstream, 1 client", cpu)]
        for c in conc:
            settings.append((f"{delay:g} ms upstream, {c} client{'s' if c != '1' else ''}", conc[c]))
        for label, by_path in settings:
            direct = stat(by_path[DIRECT], "p50")
            for path in (p for p in (MEMORY, PASS, OWN) if p in by_path):
                rows = by_path[path]
                total, memory, upstream = stat(rows, "p50"), stat(rows, "memory_p50"), stat(rows, "upstream_p50")
                parts = [stat(rows, f"{part}_p50") for part in TIMING_PARTS]
                rest = total - memory - upstream
                self.add(f"| {label} | {LABELS[path]} | {ms(total, 2)} | {ms(memory, 2)} | "
                         + " | ".join(ms(part, 2) for part in parts)
                         + f" | {ms(upstream, 2)} | {ms(direct, 2)} | {ms(rest, 2)} |")
                if by_path is cpu:
                    bars.append((LABELS[path], *parts, upstream - direct, direct, rest))
        self.add("", "![Server-Timing split](bench-timing.png)", "")
        fig, ax = self.figure(8, 3.4)
        names = (*(f"memory: {part}" for part in TIMING_PARTS), "upstream client (upstream - direct)",
                 "fake upstream + load generator (direct)", "HTTP servers (rest)")
        colors = ("#98df8a", "#2ca02c", "#17becf", "#e377c2", "#1f77b4", "#bcbd22", "#ff7f0e", "#bbbbbb", "#9467bd")
        for i, (name, *values) in enumerate(bars):
            left = 0.0
            for k, value in enumerate(values):
                value = 0.0 if math.isnan(value) else max(0.0, value)
                ax.barh(i, value, left=left, color=colors[k], label=names[k] if i == 0 else None)
                left += value
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels([b[0] for b in bars])
        ax.set_xlabel("ms at p50, 0 ms upstream, 1 client")
        ax.set_title("where a request's time goes")
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, frameon=False)
        self.save(fig, "bench-timing.png")

    def section_replay(self) -> None:
        rep = self.r["replay"]
        self.add("## 7. Token-cost replay", "")
        if "skipped" in rep:
            self.add(f"Skipped: {rep['skipped']}.", "")
            fig, ax = self.figure(6, 2)
            ax.text(0.5, 0.5, "replay skipped: LoCoMo data absent", ha="center", va="center")
            ax.axis("off")
            self.save(fig, "bench-tokens.png")
            return
        convs = rep["conversations"]
        up = rep["upstream"]
        licence = rep.get("licence") or "no licence file beside it"
        self.add(f"The conversations of `{rep.get('data', '-')}` (LoCoMo's format; licence: {licence}; read in "
                 f"place) replayed through a memproxy with a {rep['window']:,}-token window ({rep['output_reserve']} reserved for "
                 f"the answer) and {rep['memory']}: the user is speaker A, and the fake upstream answers with "
                 "speaker B's recorded reply. Against a client that resends the whole conversation every time "
                 "(same tokenizer). \"Overflowed\": full requests that would not fit the window at all.", "",
                 "| conversation | requests | resend everything | memproxy sent | saved | overflowed without "
                 "memproxy | refused by memproxy | summary versions |", "|---|---|---|---|---|---|---|---|")
        full_total = sent_total = 0
        for c in convs:
            full, sent = sum(c["full_tokens"]), sum(c["sent_tokens"])
            full_total, sent_total = full_total + full, sent_total + sent
            self.add(f"| {c['name']} | {c['requests']} | {full:,} | {sent:,} | {1 - sent / full:.0%} | "
                     f"{c['overflowed']} ({c['overflowed'] / max(1, c['requests']):.0%}) | {c['refused']} | "
                     f"{c['summary_version']} |")
        summary_in, summary_out = up.get("summary_prompt_tokens", 0), up.get("summary_completion_tokens", 0)
        with_summaries = sent_total + summary_in + summary_out
        requests = sum(c["requests"] for c in convs)
        overflowed = sum(c["overflowed"] for c in convs)
        self.add(f"| **all** | {requests} | {full_total:,} | {sent_total:,} | {1 - sent_total / full_total:.0%} | "
                 f"{overflowed} ({overflowed / max(1, requests):.0%}) | {sum(c['refused'] for c in convs)} | |", "",
                 f"memproxy's summariser made {up.get('summary_requests', 0)} requests of its own: "
                 f"{summary_in:,} prompt and {summary_out:,} completion tokens. Counting them, memproxy sent "
                 f"{with_summaries:,} tokens in all, {with_summaries / full_total:.1%} of what resending "
                 f"everything costs. The upstream counted {up.get('chat_prompt_tokens', 0):,} chat prompt "
                 f"tokens received (memproxy's own count above: {sent_total:,}). Replay time: {rep['seconds']} s.",
                 "", "![prompt tokens per request](bench-tokens.png)", "")
        fig, ax = self.figure(8, 3.8)
        first = convs[0]
        ax.plot(first["full_tokens"], label="client resending everything", color=COLORS[LITELLM])
        ax.plot(first["sent_tokens"], label="memproxy", color=COLORS[MEMORY])
        ax.axhline(rep["window"] - rep["output_reserve"], color="black", linestyle="--", linewidth=1,
                   label="window - answer reserve")
        ax.set_xlabel(f"request ({first['name']})")
        ax.set_ylabel("prompt tokens")
        ax.set_yscale("log")
        ax.set_title("prompt tokens sent upstream per request")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        self.save(fig, "bench-tokens.png")

    def section_recall(self) -> None:
        rec = self.r.get("recall")
        self.add("## 8. Recall quality", "")
        if not rec or "skipped" in rec:
            self.add(f"Not measured: {rec['skipped'] if rec else 'the recall replay is not in this run'}.", "")
            fig, ax = self.figure(6, 2)
            ax.text(0.5, 0.5, "recall replay not run", ha="center", va="center")
            ax.axis("off")
            self.save(fig, "bench-recall.png")
            return
        convs = rec["conversations"]
        windows = list(rec["windows"])
        licence = rec.get("licence") or "no licence file beside it"
        reserves = ", ".join(f"{int(w):,} ({v['output_reserve']} reserved for the answer)"
                             for w, v in rec["windows"].items())
        opened = sum(c["opened_by_b"] for c in convs)
        sessions = sum(c["sessions"] for c in convs)
        self.add(f"The conversations of `{rec['data']}` (LoCoMo's format; licence: {licence}; read in place), "
                 f"{len(convs)} of them, {sessions} sessions, told to memproxy (SQLite) turn by turn, one session per "
                 f"conversation and window, at windows of {reserves} tokens, every memory setting at its default "
                 "(summaries on; the summariser is the fake upstream too, answering every fold with the same "
                 "generic ~85-token summary that holds no dialog id). The client sends only each new dialog turn "
                 "(`X-Memproxy-History: new`) as `[D1:3] Caroline: text` (with ` [shares a photo: caption]` "
                 "where it shares one): speaker A's turns as user messages, speaker B's as the recorded answers "
                 "the fake upstream returns; one speaker's consecutive turns go in one message. "
                 f"{opened} of the {sessions} sessions open with speaker B: those turns are sent as a user "
                 "message too, in the same request as the speaker A turns that follow.", "",
                 "Then every question whose evidence is in the data is asked as the session's next user message "
                 "through the context endpoint (`POST /v1/sessions/{id}/context`: what the chat endpoint would "
                 "send upstream, nothing stored), and scores the share of its evidence ids whose `[Dx:y]` tag "
                 "appears in those messages; the figure is the mean over questions. The settings ask the "
                 "same replayed store (a memproxy for each setting, on the same database file, which the context "
                 "endpoint only reads): "
                 + "; ".join(f"**{MODE_LABELS.get(m, m)}** `{json.dumps(v)}`" for m, v in rec["mode_settings"].items())
                 + ". Odd evidence entries are read for every id they name (`D8:6; D9:17` is two, `D:11:26` is "
                 f"D11:26); entries naming none (a bare `D`) are left out: {sum(c['evidence_dropped'] for c in convs)}. "
                 f"Replay: {rec['replay_seconds']} s (conversations and windows told concurrently); questions: "
                 f"{rec['question_seconds']} s for all settings.", "")
        if rec.get("modes_missing"):
            self.add(f"> Only recall off was measured: {rec['modes_missing']}.", "")
        if rec.get("reply_clashes"):
            self.add(f"> {rec['reply_clashes']} requests' last messages were scripted twice with different "
                     "replies: those got a wrong answer from the fake upstream.", "")
        self.add("| window | setting | questions | overall | " + " | ".join(
                     f"{c} {CATEGORY_NAMES[c]}" for c in CATEGORY_NAMES) + " | refused (overflow) |",
                 "|---|---|---|---|" + "---|" * len(CATEGORY_NAMES) + "---|")
        for window in windows:
            for mode, by_window in rec["modes"].items():
                row = by_window[window]
                cells = [f"{row['by_category'][c]['recall']:.1%} ({row['by_category'][c]['questions']})"
                         if c in row["by_category"] else "-" for c in CATEGORY_NAMES]
                errors = sum(row["errors"].values())
                overall = "-" if row["overall"] is None else f"**{row['overall']:.1%}**"
                self.add(f"| {int(window):,} | {MODE_LABELS.get(mode, mode)} | {row['questions']} | {overall} | "
                         + " | ".join(cells) + f" | {errors} ({row['overflows']}) |")
        self.add("", "The replay itself (every default, so recall on where memproxy has it):", "",
                 "| window | requests | refused for overflow (400) | other errors | recalled messages per request "
                 "(mean) | most tokens sent |", "|---|---|---|---|---|---|")
        for window, row in rec["replay"].items():
            errors = ", ".join(f"{k}: {n}" for k, n in row["errors"].items()) or "0"
            recalled = "-" if row["recalled_mean"] is None else f"{row['recalled_mean']:.2f}"
            self.add(f"| {int(window):,} | {row['requests']:,} | {row['overflows']} | {errors} | {recalled} | "
                     f"{row['context_tokens_max']:,} |")
        self.add("", "![evidence recall by window](bench-recall.png)", "")
        fig, ax = self.figure(7, 3.6)
        modes = list(rec["modes"])
        width = 0.8 / max(1, len(modes))
        colors = {"off": "#bbbbbb", "bm25": COLORS[PASS], "recall": COLORS[MEMORY]}
        for j, mode in enumerate(modes):
            values = [rec["modes"][mode][w]["overall"] or 0.0 for w in windows]
            ax.bar([k + j * width for k in range(len(windows))], [v * 100 for v in values], width,
                   label=MODE_LABELS.get(mode, mode), color=colors.get(mode, "#888888"))
        for k, window in enumerate(windows):
            if window in RECALL_TARGETS:
                ax.hlines(RECALL_TARGETS[window] * 100, k - width / 2, k + width * (len(modes) - 0.5),
                          color="black", linestyle="--", linewidth=1)
        ax.set_xticks([k + width * (len(modes) - 1) / 2 for k in range(len(windows))])
        ax.set_xticklabels([f"{int(w):,} tokens" for w in windows])
        ax.set_ylim(0, 100)
        ax.set_ylabel("evidence in what is sent (%)")
        ax.set_title("LoCoMo evidence recall (dashes: targets)")
        ax.legend(fontsize="small")
        ax.grid(axis="y", alpha=0.3)
        self.save(fig, "bench-recall.png")

    def section_recall_speed(self) -> None:
        speed = self.r.get("recall_speed")
        self.add("## 9. Recall speed", "")
        if not speed:
            self.add("Not measured: the recall speed phase is not in this run.", "")
            return
        stores = speed["store_sizes"]
        size, other = speed["session_size"], speed["other_session_size"]
        rounds = speed["results"]
        first = next(iter(rounds.values()), [])
        requests = first[0]["n"] + first[0]["errors"] if first else 0
        self.add(f"A turn's memory work (`Server-Timing: memory`, as in sections 4 and 6) on one session of "
                 f"{size:,} stored messages, in a store holding that session alone and in one of "
                 f"{stores['big']:,} messages (the rest in {(stores['big'] - size) // other:,} other sessions of "
                 f"{other:,}), with recall on (its defaults) and off (`recall_tokens: 0`). Messages are "
                 f"{speed['texts']}, drawn at random (the measured session is the same in both stores), seeded "
                 "through `Store.record_turn` a thousand messages a transaction. Each store and setting is a "
                 "memproxy of its own (`summaries: false`, `overflow: marker`, the sweep model's "
                 "window) on its own copy of the store, all running at once; one client at 0 ms upstream sends "
                 "each new question to every one in turn, in an order rotated from round to round; "
                 f"{len(first)} round(s) of {requests} requests, median of the rounds' figures.", "")
        if speed.get("modes_missing"):
            self.add(f"> Only recall off was measured: {speed['modes_missing']}.", "")
        self.add("| messages in the store | setting | memory work p50 (ms) | memory work p99 (ms) | latency p50 (ms) "
                 "| recalled messages p50 | errors | store seeded in |", "|---|---|---|---|---|---|---|---|")
        for name, rows in rounds.items():
            store, mode = name.split("-")
            errors = sum(r["errors"] for r in rows)
            self.add(f"| {stores[store]:,} | recall {mode} | {ms(stat(rows, 'memory_p50'), 2)} | "
                     f"{ms(stat(rows, 'memory_p99'), 2)} | {ms(stat(rows, 'p50'), 2)} | "
                     f"{ms(stat(rows, 'recalled_p50'), 0)} | {errors} | {speed['seed_s'][store]} s |")
        self.add("")

    def section_method(self) -> None:
        self.add("## How it was measured", "",
                 "- One fake upstream process (`bench/upstream.py`) serves every path; its delay, stream pacing "
                 "and replies are set between phases. Each path is a separate keep-alive connection pool in "
                 "the one load-generator process.",
                 "- Each round visits every path in turn, in an order rotated from round to round, at the same "
                 "settings; a figure is the median over rounds of that round's percentile, and \"added\" is "
                 "taken round by round against the direct path.",
                 "- Memory-on clients send only their new message and start a new session every few requests "
                 "(the client settings above), so a request carries a few stored messages upstream besides what "
                 "the other paths send; the "
                 "history sweep covers long sessions.",
                 "- Latency and CPU figures on a 2-core machine are shaped by the load generator and the fake "
                 "upstream competing with the proxy for the same cores; the ratios between paths measured "
                 f"side by side are what carries over. memproxy and LiteLLM's proxy run {self.workers_text()}: "
                 "throughput per core divides by the CPU time each actually used.",
                 "- Raw results: `bench-results.json` beside this page.", "")

    def write(self) -> Path:
        self.header()
        self.section_targets()
        if "concurrency" in self.r:  # else a recall-only run (`--only recall`) with no saved run to join
            self.section_machine()
            self.section_latency()
            self.section_throughput()
            self.section_streams()
            self.section_history()
            self.section_long()
            self.section_rss()
            self.section_timing()
            self.section_replay()
        self.section_recall()
        self.section_recall_speed()
        if "concurrency" in self.r:  # the paths' method; the recall sections say their own
            self.section_method()
        path = self.out / "benchmarks.md"
        path.write_text("\n".join(self.lines).rstrip() + "\n", encoding="utf-8")
        (self.out / "bench-results.json").write_text(json.dumps(self.r, separators=(",", ":")) + "\n",
                                                     encoding="utf-8")
        return path


def write(results: dict[str, Any], out: Path, small: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    return Report(results, out, small).write()


def main() -> None:
    """Render a saved `bench-results.json` again (after a change to this file), without a new run."""
    parser = argparse.ArgumentParser(description="rewrite benchmarks.md and the plots from saved results")
    parser.add_argument("results", help="a bench-results.json")
    parser.add_argument("--out", help="where to write (default: beside the results)")
    args = parser.parse_args()
    source = Path(args.results)
    results = json.loads(source.read_text(encoding="utf-8"))
    print(write(results, Path(args.out) if args.out else source.parent, small=results["meta"]["quick"]))


if __name__ == "__main__":
    main()

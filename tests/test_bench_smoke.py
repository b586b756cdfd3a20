"""The benchmark suite's smoke run: `bench/run.py --quick --no-litellm-proxy` end to end, in seconds.

It starts the real fake upstream and memproxy processes, runs every phase with a handful of requests,
and writes the report and plots to a temporary directory, so the suite cannot rot between full runs.
The report is also written from a small saved results file with LiteLLM's proxy in it (three rounds,
numbers chosen so that some targets pass and some fail), which CI's quick run leaves out. The recall
replay's script is checked on a small conversation of LoCoMo's shape written here, so that it is
tested where the data is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_report() -> object:
    """bench/report.py, under a name of its own (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_recall() -> Any:
    """bench/recall.py, which imports its siblings as scripts do."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_recall", ROOT / "bench" / "recall.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _bench(out: Path, *options: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--no-litellm-proxy", "--out", str(out), *options],
        capture_output=True, text=True, timeout=600, cwd=ROOT,  # a hang guard: a quick run takes ~2 min here
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_quick_bench_writes_report_and_plots(tmp_path: Path) -> None:
    _bench(tmp_path)

    bench_report = _bench_report()
    report = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    for section in bench_report.SECTIONS:  # type: ignore[attr-defined]
        assert section in report, section
    assert "Quick run" in report
    assert "| memory work under 1 ms at p50" in report
    for plot in bench_report.PLOTS:  # type: ignore[attr-defined]
        png = tmp_path / plot
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
        assert f"({plot})" in report

    results = json.loads((tmp_path / "bench-results.json").read_text(encoding="utf-8"))
    assert results["paths"] == ["direct", "memproxy-memory", "memproxy-pass", "memproxy-own"]
    for phase in ("cpu", "concurrency", "streams", "throughput", "history", "long", "soak", "rss", "replay",
                  "recall", "recall_speed"):
        assert phase in results, phase
    memory_on = results["cpu"]["memproxy-memory"][0]
    assert memory_on["errors"] == 0 and memory_on["n"] > 0 and "memory_p50" in memory_on
    assert all(row[0]["errors"] == 0 for row in results["history"].values())
    if "skipped" not in results["replay"]:
        conversation = results["replay"]["conversations"][0]
        assert conversation["requests"] > 0 and conversation["refused"] == 0
    if "skipped" not in results["recall"]:
        for window, told in results["recall"]["replay"].items():
            assert told["requests"] > 0 and told["overflows"] == 0 and not told["errors"], window
        for mode, by_window in results["recall"]["modes"].items():
            for window, asked in by_window.items():
                assert asked["questions"] > 0 and not asked["errors"], (mode, window)
    speed = results["recall_speed"]["results"]
    assert {"small-off", "big-off"} <= set(speed)
    assert all(rounds[0]["errors"] == 0 and "memory_p50" in rounds[0] for rounds in speed.values())

    # `--only recall` puts its phases into the saved run and keeps every other section. Run where the
    # LoCoMo data is not (half the time: no replay), so that the phases' own fallbacks run too.
    before = results["cpu"]
    _bench(tmp_path, "--only", "recall", "--locomo", str(tmp_path / "absent" / "locomo5.json"))
    merged = json.loads((tmp_path / "bench-results.json").read_text(encoding="utf-8"))
    assert merged["cpu"] == before and merged["meta"]["recall_run"]["started"] >= results["meta"]["started"]
    assert "skipped" in merged["recall"] and merged["recall_speed"]["texts"].startswith("random words")
    assert all(rounds[0]["errors"] == 0 for rounds in merged["recall_speed"]["results"].values())
    report = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    assert "## 1. Added latency" in report and "Sections 8 and 9 (and their targets) are from" in report
    # `--only recall-quality` replaces the replay's results alone: recall's speed stays as measured.
    _bench(tmp_path, "--only", "recall-quality", "--locomo", str(tmp_path / "absent" / "locomo5.json"))
    again = json.loads((tmp_path / "bench-results.json").read_text(encoding="utf-8"))
    assert again["recall_speed"] == merged["recall_speed"] and again["cpu"] == before
    assert again["meta"]["recall_run"]["only"] == "recall-quality" and "skipped" in again["recall"]
    report = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    assert "Section 8 (and its targets) is from `python bench/run.py --only recall-quality --quick`" in report


def test_recall_script_follows_the_dialog(tmp_path: Path) -> None:
    recall = _bench_recall()
    turns = [("A", "D1:1", "hi"), ("B", "D1:2", "hello"), ("A", "D1:3", "news?"), ("A", "D1:4", "well?"),
             ("B", "D1:5", "a trip")]
    second = [("B", "D2:1", "back!"), ("A", "D2:2", "how was it"), ("B", "D2:3", "great"), ("A", "D2:4", "bye")]
    data = [{"sample_id": "c1", "conversation": {
        "speaker_a": "Ann", "speaker_b": "Bo",
        "session_1": [{"speaker": {"A": "Ann", "B": "Bo"}[s], "dia_id": d, "text": t} for s, d, t in turns],
        "session_2": [{"speaker": {"A": "Ann", "B": "Bo"}[s], "dia_id": d, "text": t,
                       **({"blip_caption": "a beach"} if d == "D2:1" else {})} for s, d, t in second],
    }, "qa": [
        {"question": "Where?", "answer": "x", "evidence": ["D1:5"], "category": 4},
        {"question": "Both?", "answer": "x", "evidence": ["D1:2; D2:3", "D:2:1", "D"], "category": 1},
        {"question": "No evidence", "answer": "x", "evidence": [], "category": 5},
    ]}]
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps(data), encoding="utf-8")

    [script] = recall.load_scripts(path)
    assert [(e.messages, e.reply) for e in script.exchanges] == [
        (["[D1:1] Ann: hi"], "[D1:2] Bo: hello"),
        (["[D1:3] Ann: news?\n[D1:4] Ann: well?"], "[D1:5] Bo: a trip"),
        # A session opening with speaker B: those turns go as a user message, with A's that follow.
        (["[D2:1] Bo: back! [shares a photo: a beach]", "[D2:2] Ann: how was it"], "[D2:3] Bo: great"),
        (["[D2:4] Ann: bye"], recall.NO_REPLY),
    ]
    assert script.opened_by_b == 1 and script.evidence_dropped == 1
    assert [(q.category, q.evidence) for q in script.questions] == [("4", ["D1:5"]), ("1", ["D1:2", "D2:3", "D2:1"])]
    # Only questions whose evidence was told are asked of a shortened replay.
    [first] = recall.load_scripts(path, limit_sessions=1)
    assert [q.text for q in first.questions] == ["Where?"]
    assert recall.found_tags([{"role": "user", "content": [{"type": "text", "text": "[D1:2] x [D1:20]"}]},
                              {"role": "assistant", "content": "[D2:3] y"}]) == {"D1:2", "D1:20", "D2:3"}


def test_report_compares_with_litellm_proxy_round_by_round(tmp_path: Path) -> None:
    bench_report = _bench_report()
    results = json.loads((ROOT / "tests" / "data" / "bench-results-small.json").read_text(encoding="utf-8"))
    report = bench_report.write(results, tmp_path).read_text(encoding="utf-8")  # type: ignore[attr-defined]

    targets = {}
    for line in report.split("## Targets", 1)[1].split("## Machine", 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] not in ("target", "---"):
            targets[cells[0]] = cells[1:]
    assert targets["added p50 at 1 client below LiteLLM proxy's"] == [
        "2.5 ms vs 13.5 ms", "0.18", "0.17–0.21", "**pass**"]
    assert targets["added p99 at 100 clients below LiteLLM proxy's"] == [
        "869.2 ms vs 405.1 ms", "2.15", "2.14–2.16", "**FAIL**"]
    assert targets["latency at 1,000 stored messages within 1.2x of 10 (p50)"] == [
        "5.20 ms vs 4.00 ms", "1.30", "1.22–1.38", "**FAIL**"]
    [memory] = [cells for name, cells in targets.items() if name.startswith("memory work under 1 ms")]
    assert memory == ["0.62 ms", "0.62", "0.55–0.69", "**pass**"]
    [per_core] = [cells for name, cells in targets.items() if name.startswith("throughput per core")]
    assert per_core == ["500 vs 110", "4.55", "4.17–4.95", "**pass**"]
    assert "not measured" not in report.split("## Machine", 1)[0]

    # The ladder reports its median round: rates that were run, with what was measured at them.
    assert "| memproxy, memory on | 100 req/s | 100, 200, 50 | 400 |" in report
    assert "| LiteLLM proxy | 100 req/s | 50, 100, 100 | 400 |" in report
    assert "| LiteLLM proxy | 850 MiB | 854 MiB | 880 MiB | +25.5 MiB |" in report  # growth over the run
    assert "Skipped: the LoCoMo data is not at /nowhere/locomo5.json" in report


def _recall_results() -> dict[str, Any]:
    """What the recall phases (8, 9) measure, as a run saves it: scores and timings made up."""

    def scores(overall: float, multi_hop: float, overflows: int = 0) -> dict[str, Any]:
        return {"questions": 10, "overall": overall, "errors": {}, "overflows": overflows,
                "by_category": {"1": {"questions": 4, "recall": multi_hop}, "4": {"questions": 6, "recall": 0.5}}}

    windows = {"4000": 256, "2000": 256, "1000": 128}
    recall = {
        "data": "locomo.json", "licence": None, "windows": {w: {"output_reserve": o} for w, o in windows.items()},
        "conversations": [{"name": "c1", "sessions": 2, "requests": 9, "questions": 10, "opened_by_b": 1,
                           "evidence_dropped": 0}],
        "reply_clashes": 0, "modes_missing": None, "replay_seconds": 1.0, "question_seconds": 1.0,
        "mode_settings": {"off": {"recall_tokens": 0}, "bm25": {"recall_context": 0}, "recall": {}},
        "replay": {w: {"requests": 9, "overflows": 0, "errors": {}, "recalled_mean": 3.5, "context_tokens_max": 900}
                   for w in windows},
        "modes": {"off": {w: scores(0.05, 0.0) for w in windows},
                  "bm25": {w: scores(0.8, 0.5) for w in windows},
                  "recall": {"4000": scores(0.92, 0.7), "2000": scores(0.86, 0.6), "1000": scores(0.7, 0.5, 1)}},
    }
    timing = {"small-on": [1.9, 2.1, 2.0], "small-off": [1.5, 1.4, 1.5], "big-on": [2.5, 2.4, 2.6],
              "big-off": [1.6, 1.6, 1.5]}
    recall_speed = {
        "session_size": 10_000, "store_sizes": {"small": 10_000, "big": 1_000_000}, "other_session_size": 1_000,
        "modes_missing": None, "texts": "LoCoMo turns", "seed_s": {"small": 0.5, "big": 50.0},
        "results": {name: [{"n": 30, "errors": 0, "p50": 3.0, "memory_p50": value, "recalled_p50": 12}
                           for value in values] for name, values in timing.items()},
    }
    return {"recall": recall, "recall_speed": recall_speed}


def test_report_judges_recall_targets(tmp_path: Path) -> None:
    bench_report = _bench_report()
    results = json.loads((ROOT / "tests" / "data" / "bench-results-small.json").read_text(encoding="utf-8"))
    results.update(_recall_results())
    report = bench_report.write(results, tmp_path).read_text(encoding="utf-8")  # type: ignore[attr-defined]
    targets = {}
    for line in report.split("## Targets", 1)[1].split("## Machine", 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith(("recall", "memory work with")):
            targets[cells[0]] = cells[1:]
    assert targets["recall replay: evidence recall at 4,000 tokens at least 90%"] == [
        "92.0% (recall off 5.0%, plain BM25 80.0%)", "1.02", "-", "**pass**"]
    assert targets["recall replay: evidence recall at 2,000 tokens at least 85%"][-1] == "**pass**"
    assert targets["recall replay: multi-hop (category 1) at 4,000 tokens at least 75%"] == [
        "70.0%", "0.93", "-", "**FAIL**"]
    assert targets["recall replay: no overflow (400 `context_length_exceeded`) in the replay or the questions"] == [
        "1", "-", "-", "**FAIL**"]
    assert targets["recall adds at most 1 ms to memory work at p50 (10,000 messages in the session)"] == [
        "0.50 ms (2.00 vs 1.50 ms)", "0.50", "0.40–0.70", "**pass**"]
    assert targets["memory work with 1,000,000 messages in the store within 1.2x of 10,000 (p50, recall on)"] == [
        "2.50 ms vs 2.00 ms", "1.25", "1.14–1.32", "**FAIL**"]
    assert "| 4,000 | plain BM25 | 10 | **80.0%** | 50.0% (4) | - | - | 50.0% (6) | - | 0 (0) |" in report
    assert "| 1,000,000 | recall on | 2.50 |" in report


@pytest.mark.parametrize("only", ["recall", "recall-quality"])
def test_a_recall_only_run_with_no_saved_run_writes_its_sections_alone(tmp_path: Path, only: str) -> None:
    """`--only recall` (or `recall-quality`) where no full run was saved: the page holds the
    sections it ran and their targets, and nothing that only a full run measures (its settings,
    workers, paths)."""
    bench_report = _bench_report()
    saved = json.loads((ROOT / "tests" / "data" / "bench-results-small.json").read_text(encoding="utf-8"))
    meta = {"started": saved["meta"]["started"], "quick": False, "machine": saved["meta"]["machine"], "notes": [],
            "duration_s": 75.0, "only": only, "plan": saved["meta"]["settings"]["plan"]}
    results = _recall_results()
    if only == "recall-quality":
        del results["recall_speed"]  # the replay alone: nothing timed
    report = bench_report.write({"meta": meta, **results}, tmp_path).read_text(  # type: ignore[attr-defined]
        encoding="utf-8")
    assert "| recall replay: evidence recall at 4,000 tokens at least 90% | 92.0%" in report
    assert f"> **Recall phases only** (`--only {only}`)" in report
    assert "## 8. Recall quality" in report and "## 9. Recall speed" in report
    assert ("Not measured: the recall speed phase is not in this run." in report) == (only == "recall-quality")
    assert ("recall adds at most 1 ms" in report) == (only == "recall")
    assert "## 1. Added latency" not in report and "workers" not in report.split("## 8.", 1)[0]

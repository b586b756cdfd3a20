"""The benchmark suite's smoke run: `bench/run.py --quick --no-litellm-proxy` end to end, in seconds.

It starts the real fake upstream and memproxy processes, runs every phase with a handful of requests,
and writes the report and plots to a temporary directory, so the suite cannot rot between full runs.
The report is also written from a small saved results file with LiteLLM's proxy in it (three rounds,
numbers chosen so that some targets pass and some fail), which CI's quick run leaves out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench_report() -> object:
    """bench/report.py, under a name of its own (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_bench_writes_report_and_plots(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--no-litellm-proxy", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

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
    assert results["paths"] == ["direct", "memproxy-memory", "memproxy-pass", "memproxy-litellm"]
    for phase in ("cpu", "concurrency", "streams", "throughput", "history", "soak", "rss", "replay"):
        assert phase in results, phase
    memory_on = results["cpu"]["memproxy-memory"][0]
    assert memory_on["errors"] == 0 and memory_on["n"] > 0 and "memory_p50" in memory_on
    assert all(row[0]["errors"] == 0 for row in results["history"].values())
    if "skipped" not in results["replay"]:
        conversation = results["replay"]["conversations"][0]
        assert conversation["requests"] > 0 and conversation["refused"] == 0


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

"""The benchmark suite's smoke run: `bench/run.py --quick --no-litellm-proxy` end to end, in seconds.

It starts the real fake upstream and memproxy processes, runs every phase with a handful of requests,
and writes the report and plots to a temporary directory, so the suite cannot rot between full runs.
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

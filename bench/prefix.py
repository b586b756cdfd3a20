"""How well recall keeps the provider's prompt cache: the LoCoMo replay told at a few windows, each
request's bytes compared with the one before it, then every question asked for evidence recall.

    python bench/prefix.py                      # windows 4000, 8000 and 16000
    python bench/prefix.py --windows 16000 --memory '{"recall_min_tokens": 0}'

Each conversation is told turn by turn to a memproxy of its own settings (every memory default
unless `--memory` says otherwise) as a client sending only its new messages (`recall.tell`'s
requests), one request at a time, the fake provider keeping the last body it received. A request
"kept the prefix" when it opens with every message the request before it sent ahead of its recall
block (or, without one, ahead of its new messages): what a provider's prompt cache can reuse.
Requests after which the summary changed are counted apart (a new summary is a new prefix by
design). Then each question goes to the context endpoint (`recall.ask`) and is scored by the share
of its evidence that would be sent. Prints one JSON line a window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402

import recall  # noqa: E402
import servers  # noqa: E402
from replay import DATA  # noqa: E402
from run import PROXY_KEY, memproxy_config  # noqa: E402
from memproxy.memory.fit import SUMMARY_PREFIX  # noqa: E402
from memproxy.memory.recall import RECALL_PREFIX  # noqa: E402


def texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] if isinstance(m.get("content"), str) else json.dumps(m) for m in body["messages"]]


def prefix_end(messages: list[str], new: int) -> int:
    """Where what a cache may reuse next time ends: at the recall block, else at the new messages."""
    return next((i for i, m in enumerate(messages) if m.startswith(RECALL_PREFIX)), len(messages) - new)


async def window_run(work: Path, window: int, memory: dict[str, Any], scripts: list[recall.Script],
                     replies: dict[str, str]) -> dict[str, Any]:
    processes = servers.Processes(work)
    try:
        upstream = servers.start_upstream(processes)
        config = work / f"memproxy-{window}.yaml"
        output = 256 if window >= 2000 else 128
        config.write_text(memproxy_config(upstream.url, work / f"prefix-{window}.db", memory, 4096,
                                          {"m": (window, output)}))
        proxy = servers.start_memproxy(processes, f"memproxy-{window}", config)
        headers = {"Authorization": f"Bearer {PROXY_KEY}"}
        count = {"pairs": 0, "kept": 0, "summary_changed": 0, "broken": 0}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{upstream.url}/_control",
                                 json={"delay_ms": 0, "replies": replies, "keep_last": True}) as response:
                response.raise_for_status()
            for script in scripts:
                system = {"role": "system", "content": script.system}
                before: tuple[list[str], int, list[str]] | None = None
                for exchange in script.exchanges:
                    body = {"model": "m", "messages": [system, *({"role": "user", "content": m}
                                                               for m in exchange.messages)]}
                    async with http.post(f"{proxy.url}/v1/chat/completions", json=body, headers={
                        **headers, "X-Session-Id": f"prefix-{script.name}", "X-Memproxy-History": "new",
                    }) as response:
                        await response.read()
                        response.raise_for_status()
                    async with http.get(f"{upstream.url}/_last") as response:
                        sent = texts(json.loads(await response.read()))
                    summaries = [m for m in sent if m.startswith(SUMMARY_PREFIX)]
                    if before is not None:
                        previous, end, previous_summaries = before
                        count["pairs"] += 1
                        if sent[:end] == previous[:end]:
                            count["kept"] += 1
                        elif summaries != previous_summaries:
                            count["summary_changed"] += 1
                        else:
                            count["broken"] += 1
                    before = (sent, prefix_end(sent, len(exchange.messages)), summaries)
            total = recall.Score()
            for script in scripts:
                score, _ = await recall.ask(http, proxy.url, headers, "m", f"prefix-{script.name}", script)
                total.merge(score)
        kept_share = count["kept"] / max(count["pairs"] - count["summary_changed"], 1)
        return {"window": window, "memory": memory, **count, "prefix_kept": round(kept_share, 4),
                "evidence_recall": total.summary()}
    finally:
        processes.stop_all()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[4000, 8000, 16000])
    parser.add_argument("--memory", type=json.loads, default={}, help="memory settings, as JSON")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    if not args.data.exists():
        print(f"the LoCoMo data is not at {args.data}: nothing to replay")
        return
    scripts = recall.load_scripts(args.data)
    replies, _ = recall.replies(scripts)
    with tempfile.TemporaryDirectory() as work:
        for window in args.windows:
            print(json.dumps(await window_run(Path(work), window, args.memory, scripts, replies)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())

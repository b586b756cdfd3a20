"""The reference for memproxy's litellm path: `litellm.acompletion` in a plain asyncio loop.

    python bench/bare.py --api-base http://127.0.0.1:PORT/v1 --requests 200 --rounds 5

Run as its own process against the bench's fake upstream, with what memproxy's default path passes
(`memproxy.provider`: litellm loaded and set up as memproxy does, the same keyword arguments, the
call's set-up run on the loop as memproxy runs it (`memproxy.inline_setup`), the answer turned
into a dict), on conversations shaped like the latency phase's memory-on requests (a
system prompt, a few earlier exchanges, the new question). Prints one JSON line: per round, the
p50 and p99 of a call in ms and the CPU it took per call (this process; the fake upstream's is its
own). What memproxy's `Server-Timing: upstream` shows beyond this is what memproxy does around the
call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import load  # noqa: E402
from memproxy import inline_setup  # noqa: E402
from memproxy.config import ModelConfig  # noqa: E402
from memproxy.provider import chat_parameters, litellm_kwargs, load_litellm, register_unmapped  # noqa: E402

WINDOW = 8192  # the latency phases' model's (`run.WINDOW`)
EXCHANGES = 4  # earlier exchanges in each request: a memory-on session's middle (TURN_LENGTH 10)


def conversation(question: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": load.SYSTEM}]
    for i in range(EXCHANGES):
        messages += [{"role": "user", "content": f"Question {question - EXCHANGES + i}: what is the capital of France?"},
                     {"role": "assistant", "content": "Paris is the capital of France; it has been the seat of "
                                                      "government for centuries."}]
    return [*messages, {"role": "user", "content": f"Question {question}: what is the capital of France?"}]


async def run(api_base: str, requests: int, rounds: int, warmup: int) -> list[dict[str, float]]:
    litellm = load_litellm()
    inline_setup.install(asyncio.get_running_loop())  # as memproxy's server does
    model = ModelConfig(name="bench", model="openai/bench-model", api_base=api_base, api_key="upstream-key")
    params = {"model": "bench", "max_tokens": 64}
    named = chat_parameters(litellm, model)
    register_unmapped(litellm, model, WINDOW)  # as memproxy's provider does at start
    out = []
    question = 0
    for r in range(rounds + 1):
        times = []
        cpu = time.process_time()
        for _ in range(warmup if r == 0 else requests):
            question += 1
            kwargs = {**litellm_kwargs(model, params, named), "messages": conversation(question)}
            started = time.perf_counter()
            with inline_setup.inline():  # as memproxy calls an `openai/` model
                response = await litellm.acompletion(**kwargs)
            response.model_dump(exclude_none=True)
            times.append((time.perf_counter() - started) * 1000)
        if r:
            out.append({"p50": load.percentile(times, 50), "p99": load.percentile(times, 99),
                        "cpu_ms": (time.process_time() - cpu) * 1000 / len(times)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="litellm.acompletion in a bare loop: the litellm path's reference")
    parser.add_argument("--api-base", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=50)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.api_base, args.requests, args.rounds, args.warmup))), flush=True)


if __name__ == "__main__":
    main()

"""Sessions of a given length for the history sweep and the recall speed phase, written straight
through memproxy's Store API.

Each session is recorded with `Store.record_turn`, as memproxy records real turns (chained hashes,
token counts and running totals from `memproxy.memory.shrink.new_message`), a thousand messages a
transaction, so 100,000 messages take seconds rather than an hour of HTTP requests. Every message is
distinct (no repeat for deduplication to fold) and about `tokens_per_message` long, so a handful fill
the sweep model's window: every session then sends the same amount upstream, whatever its length,
and only the length of the stored history differs. The recall speed phase's stores hold short real
turns instead (`seed_recall_store`), so that the search index sees a real vocabulary.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence

import asyncpg

from memproxy.config import MemoryConfig, StorageConfig
from memproxy.memory.shrink import new_message
from memproxy.messages import chain_hashes
from memproxy.store import Store, Totals, TurnRecord, open_store
from memproxy.tokens import TiktokenCounter
from load import SYSTEM

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education garden river bridge market letter train summer winter music"
).split()
BATCH = 1000


def message_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def seed_sessions(db_url: str, tenant: str, sizes: Sequence[int], memory: MemoryConfig,
                        encoding: str, words_per_message: int = 400) -> dict[int, float]:
    """One session `hist-N` per size N, holding N messages; returns the seconds each took."""
    store = await open_store(StorageConfig(url=db_url))
    counter = TiktokenCounter(encoding)
    rng = random.Random(6)
    took: dict[int, float] = {}
    try:
        for size in sizes:
            started = time.perf_counter()
            await seed_session(store, tenant, f"hist-{size}", size, lambda: message_text(rng, words_per_message),
                               counter, memory, "bench-sweep")
            took[size] = time.perf_counter() - started
    finally:
        await store.close()
    return took


async def seed_recall_store(db_url: str, tenant: str, session_id: str, session_size: int, store_size: int,
                            other_size: int, texts: Sequence[str], memory: MemoryConfig, encoding: str,
                            model: str) -> float:
    """The recall speed phase's store: `session_id` with `session_size` messages, then sessions of
    `other_size` until the store holds `store_size`; returns the seconds it took.

    Each message is one of `texts` (real dialog turns where there are some), drawn at random and
    numbered, so the index holds a realistic vocabulary. The measured session is drawn from a
    generator of its own, so it is the same in every store whatever is seeded beside it.
    """
    store = await open_store(StorageConfig(url=db_url))
    counter = TiktokenCounter(encoding)
    started = time.perf_counter()
    try:
        mine = random.Random(session_id)
        await seed_session(store, tenant, session_id, session_size, lambda: mine.choice(texts), counter, memory,
                           model)
        others = random.Random(8)
        for n in range((store_size - session_size) // other_size):
            await seed_session(store, tenant, f"{session_id}-other-{n}", other_size, lambda: others.choice(texts),
                               counter, memory, model)
    finally:
        await store.close()
    return time.perf_counter() - started


async def seed_long_sessions(db_url: str, schema: str | None, tenant: str, session_ids: Sequence[str],
                             sizes: Sequence[int], words_per_message: int, memory: MemoryConfig,
                             encoding: str) -> None:
    """The long-session sweep's sessions, `session_ids[i]` holding `sizes[i]` messages."""
    store = await open_store(StorageConfig(url=db_url, schema=schema))
    counter = TiktokenCounter(encoding)
    rng = random.Random(7)
    try:
        for session_id, size in zip(session_ids, sizes):
            await seed_session(store, tenant, session_id, size, lambda: message_text(rng, words_per_message),
                               counter, memory, "bench-long")
    finally:
        await store.close()


async def postgres_reachable(url: str) -> bool:
    try:
        conn = await asyncio.wait_for(asyncpg.connect(url), 5)
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return False
    await conn.close()
    return True


async def drop_schema(url: str, schema: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def seed_session(store: Store, tenant: str, session_id: str, size: int, text: Callable[[], str],
                       counter: TiktokenCounter, memory: MemoryConfig, model: str) -> None:
    """`size` messages, user and assistant in turn, `BATCH` a transaction, each `[n] ` + `text()`."""
    length, head, totals = 0, "", Totals(0, 0)
    while length < size:
        bodies = [
            {"role": "user" if (length + i) % 2 == 0 else "assistant", "content": f"[{length + i}] " + text()}
            for i in range(min(BATCH, size - length))
        ]
        hashes = chain_hashes(head, bodies)
        new = [new_message(body, digest, counter, memory) for body, digest in zip(bodies, hashes)]
        await store.record_turn(TurnRecord(
            tenant=tenant, session_id=session_id, expected_length=length,
            expected_head_hash=head, base=length, base_totals=totals, base_hash=head,
            messages=new, system=[{"role": "system", "content": SYSTEM}],
            model=model, kind="append", context_tokens=0,
            latency_ms=0.0,
        ))
        added = sum(m.tokens for m in new)
        compact = sum(m.tokens if m.compact_tokens is None else m.compact_tokens for m in new)
        length, head = length + len(new), hashes[-1]
        totals = Totals(totals.full + added, totals.compact + compact)

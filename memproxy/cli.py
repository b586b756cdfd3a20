"""The `memproxy` command: `serve` runs the daemon, `check-config` validates a config file,
`sessions ...` manages stored sessions (`memproxy.sessions_cli`).

Only `serve` and `sessions context` import litellm (once); the other commands stay light.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections import Counter
from dataclasses import replace
from typing import Any, Sequence

from aiohttp import web

from . import __version__, sessions_cli
from .app import runner as app_runner
from .config import Config, ConfigError, StorageConfig, load_config
from .deadlines import protocols
from .errors import ProxyError
from .provider import check_provider
from .store import Store, open_store
from .store.errors import StoreConflict


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # Whoever read the output stopped reading (`memproxy sessions list | head`): stop quietly.
        # Python's own advice: point stdout at devnull, or the interpreter's last flush fails too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="memproxy", description="OpenAI-compatible proxy with memory.")
    parser.add_argument("--version", action="version", version=f"memproxy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("-c", "--config", help="YAML config file (defaults apply without one)")
    serve.add_argument("--host", help="address to bind (overrides server.host)")
    serve.add_argument("--port", type=int, help="port to bind, 0 for any free one (overrides server.port)")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="allow a non-loopback address with no auth.keys configured")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    check = commands.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("-c", "--config", required=True)

    migrate = commands.add_parser("migrate", help="apply the store's pending migrations and exit")
    migrate.add_argument("-c", "--config", help="YAML config file (storage.url)")

    copy = commands.add_parser("migrate-store", help="copy every session from one store to another")
    copy.add_argument("--from", dest="source", required=True, help="e.g. sqlite:///./memproxy.db")
    copy.add_argument("--to", dest="target", required=True, help="e.g. postgresql://user@host:5432/db")
    copy.add_argument("--from-schema", help="PostgreSQL schema of the source")
    copy.add_argument("--to-schema", help="PostgreSQL schema of the target")
    copy.add_argument("--resume", action="store_true",
                      help="the target holds part of an interrupted copy: check those sessions, copy the rest")

    sessions_cli.add_parser(commands)

    args = parser.parse_args(argv)
    try:
        config = load_config(args.config) if getattr(args, "config", None) else Config()
    except ConfigError as exc:
        print(f"memproxy: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "sessions":
        return sessions_cli.run(args, config)
    if args.command == "migrate":
        return asyncio.run(_migrate(config))
    if args.command == "migrate-store":
        source = StorageConfig(url=args.source, schema=args.from_schema)
        target = StorageConfig(url=args.target, schema=args.to_schema)
        return asyncio.run(_migrate_store(source, target, args.resume))
    if args.command == "check-config":
        try:
            check_provider(config)  # what `serve` checks at start besides the file itself
        except ConfigError as exc:
            print(f"memproxy: config error: {ConfigError(exc.key, exc.why, source=args.config)}", file=sys.stderr)
            return 2
        print(f"{args.config}: ok ({len(config.models)} models, "
              f"{len(config.auth.keys)} API keys, store {config.storage.url})")
        return 0
    server = config.server
    server = replace(
        server,
        host=args.host or server.host,
        port=server.port if args.port is None else args.port,
        allow_unauthenticated=server.allow_unauthenticated or args.allow_unauthenticated,
    )
    config = replace(config, server=server)
    if not config.auth.keys and not server.is_loopback and not server.allow_unauthenticated:
        print(f"memproxy: refusing to bind {server.host} with no auth.keys configured; add keys, bind "
              "127.0.0.1, or pass --allow-unauthenticated", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        check_provider(config)  # before anything starts: an unknown window or callback opens no store
        asyncio.run(_serve(config))
    except ConfigError as exc:  # found at start, e.g. a model whose context window is unknown
        print(f"memproxy: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


async def _migrate(config: Config) -> int:
    store = await open_store(config.storage)  # opening a store applies what is pending
    await store.close()
    print(f"{config.storage.url}: migrated")
    return 0


async def _migrate_store(source_config: StorageConfig, target_config: StorageConfig, resume: bool) -> int:
    """Copy each tenant's usage of deleted sessions, then every session (messages with their
    branches, summaries, metadata, usage), then check each session: its export from the target
    must equal its export from the source.

    Each session is copied in one transaction, so an interrupted copy leaves whole sessions only. A
    target that already holds some of the sessions stops the copy before anything is written, unless
    `--resume` says it is the rest of an interrupted copy: those sessions are checked, not copied,
    and the usage rollups, copied before the first session, are not added again."""
    source, target = await open_store(source_config), await open_store(target_config)
    try:
        sessions = await source.tenants_sessions()
        present = set(await target.tenants_sessions()) & set(sessions)
        if present and not resume:
            tenant, session_id = sorted(present)[0]
            print(f"memproxy: the target already holds {len(present)} of the {len(sessions)} sessions "
                  f"(e.g. {tenant}/{session_id}); nothing was copied. If an earlier copy was "
                  "interrupted, --resume copies the rest", file=sys.stderr)
            return 1
        rollups = await source.tenant_rollups()  # what deleted sessions spent
        if not resume:
            for tenant, usage in rollups.items():
                await target.add_to_rollup(tenant, usage)
        in_source: Counter[str] = Counter(tenant_usage=len(rollups))
        in_target: Counter[str] = Counter(tenant_usage=len(rollups.keys() & (await target.tenant_rollups()).keys()))
        different = []
        for tenant, session_id in sessions:
            records = await _export(source, tenant, session_id)
            if (tenant, session_id) not in present:
                try:
                    await target.import_session(tenant, session_id, records)
                except (ProxyError, StoreConflict) as exc:
                    print(f"memproxy: {tenant}/{session_id}: {exc.message}; sessions copied before it are"
                          " kept, --resume copies the rest", file=sys.stderr)
                    return 1
            copy = await _export(target, tenant, session_id)
            in_source.update(r["type"] for r in records)
            in_target.update(r["type"] for r in copy)
            if copy != records:
                different.append(f"{tenant}/{session_id}")
    finally:
        await source.close()
        await target.close()
    for kind, table in [("session", "sessions"), ("turn", "turns"), ("message", "messages"),
                        ("summary", "summaries"), ("tenant_usage", "tenant_usage")]:
        n, copied = in_source[kind], in_target[kind]
        print(f"{table:<12} source {n:>8}  copied {copied:>8}  {'ok' if copied == n else 'MISMATCH'}")
    for name in different:
        print(f"memproxy: {name}: the copy differs from the source", file=sys.stderr)
    return 1 if different or in_source != in_target else 0


async def _export(store: Store, tenant: str, session_id: str) -> list[dict[str, Any]]:
    session = await store.get_session(tenant, session_id)
    assert session is not None
    return await store.export_session(session)


async def _serve(config: Config) -> None:
    # A handler whose client went away is cancelled, as in the test server: an answer nobody
    # received is not recorded, so a client's retry of it is not stored twice.
    server = config.server
    access_log = logging.getLogger("aiohttp.access") if server.access_log else None
    runner = app_runner(config, access_log=access_log, handler_cancellation=True,
                        keepalive_timeout=server.keepalive_timeout_seconds)
    try:
        await runner.setup()
    except BaseException:
        await runner.cleanup()  # what started before the failure stops (the store's threads would keep the process)
        raise
    assert runner.server is not None
    # aiohttp's server, each connection wrapped with the header deadline (memproxy.deadlines).
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(protocols(runner.server, server.header_timeout_seconds),
                                        server.host, server.port, reuse_address=True)
    port = listener.sockets[0].getsockname()[1]
    print(f"memproxy listening on http://{server.host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        listener.close()  # no new connections; the runner then closes idle ones and drains the rest
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())

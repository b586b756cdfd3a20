"""The `memproxy` command: `serve` runs the daemon (`memproxy.daemon`), `check-config` checks a
config file as `serve` would (`memproxy.preflight`), `init` writes a starting one
(`memproxy.starter`), `sessions ...` manages stored sessions (`memproxy.sessions_cli`). The console
script enters through `memproxy.entry`, which handles `serve`'s stop signals before this module is
imported.

A command imports what it needs when it runs: the daemon's app and server for `serve`, the
provider's checks for `check-config`, the planner for `sessions context`. The others (`init`,
`migrate`, most `sessions` verbs) start with the config and the store alone, in less than half the
time (measured: 0.40-0.59 s against 0.92-1.21 s to import). Only `serve`, `sessions context` and
`check-config` (for a model whose window is not set) import litellm (once).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit, urlunsplit

from . import __version__, sessions_cli
from .config import LOG_LEVELS, Config, ConfigError, StorageConfig, load_config
from .errors import ProxyError
from .starter import PROVIDERS, ProviderKind, starter_config
from .store import Store, apply_migrations, open_store
from .store.errors import DRIVER_ERRORS, StoreConflict, StoreUnavailable
from .store.sqlite import sqlite_path

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
    serve.add_argument("--log-level", choices=LOG_LEVELS, help="overrides logging.level (default INFO)")
    serve.add_argument("--workers", type=int, help="server processes sharing the port (overrides server.workers)")
    serve.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # a worker's, from `memproxy.workers`

    check = commands.add_parser("check-config", help="check a config file as serve would, and exit")
    check.add_argument("-c", "--config", required=True)

    init = commands.add_parser("init", help="write a commented starting config")
    init.add_argument("--provider", choices=PROVIDERS, default="openai")
    init.add_argument("-o", "--output", default="memproxy.yaml", help="file to write (- for stdout)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")

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
    if args.command == "init":
        return _init(args.provider, args.output, args.force)
    try:
        config = load_config(args.config) if getattr(args, "config", None) else Config()
    except ConfigError as exc:
        print(f"memproxy: config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "sessions":
        return sessions_cli.run(args, config)
    if args.command == "migrate":
        try:
            return asyncio.run(_migrate(config))
        except DRIVER_ERRORS as exc:
            return _refuse([ConfigError("storage.url", f"the store did not open: {type(exc).__name__}: {exc}")],
                           args.config)
        except ConfigError as exc:  # the store's own refusal (a schema it may not create)
            return _refuse([exc], args.config)
    if args.command == "migrate-store":
        source = StorageConfig(url=args.source, schema=args.from_schema)
        target = StorageConfig(url=args.target, schema=args.to_schema)
        try:
            path = None if source.is_postgres else sqlite_path(source.url)
            if path is not None and path != ":memory:" and not Path(path).is_file():  # opened, it would be made
                print(f"memproxy: the source {source.url} does not exist; nothing was copied", file=sys.stderr)
                return 1
            return asyncio.run(_migrate_store(source, target, args.resume))
        except (StoreUnavailable, OSError, ValueError) as exc:  # a store that cannot be opened
            print(f"memproxy: {sessions_cli.failure(exc)}", file=sys.stderr)
            return 1
    if args.command == "check-config":
        from .preflight import problems  # the provider's checks: aiohttp, and litellm where a window is unknown

        if found := problems(config):  # what `serve` checks at start besides the file itself
            return _refuse(found, args.config)
        print(f"{args.config}: ok ({len(config.models)} models, "
              f"{len(config.auth.keys)} API keys, store {_without_password(config.storage.url)})")
        return 0
    # The daemon's module (the app, aiohttp's server, litellm's loader) is imported for `serve` alone:
    # the other commands start in about half the time without it.
    from . import daemon

    try:
        return daemon.serve(args, config)
    except daemon.Refused as exc:
        return _refuse(exc.found, args.config)


def _refuse(found: list[ConfigError], source: str | None) -> int:
    for exc in found:
        print(f"memproxy: config error: {ConfigError(exc.key, exc.why, source=source)}", file=sys.stderr)
    return 2


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


def _init(provider: ProviderKind, output: str, force: bool) -> int:
    text = starter_config(provider)
    if output == "-":
        print(text, end="")
        return 0
    try:
        with open(output, "w" if force else "x", encoding="utf-8") as file:  # "x": never over a file
            file.write(text)
    except FileExistsError:
        print(f"memproxy: {output} exists; --force overwrites it", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"memproxy: cannot write {output}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {output} for {provider}; check it with `memproxy check-config -c {output}`, "
          f"start with `memproxy serve -c {output}`")
    return 0


async def _migrate(config: Config) -> int:
    await apply_migrations(config.storage)
    print(f"{_without_password(config.storage.url)}: migrated")
    return 0


async def _migrate_store(source_config: StorageConfig, target_config: StorageConfig, resume: bool) -> int:
    """Copy each tenant's usage of deleted sessions, then every session (messages with their
    branches, summaries, metadata, usage), then check each session: its export from the target
    must equal its export from the source.

    Each session is copied in one transaction, so an interrupted copy leaves whole sessions only. A
    target that already holds some of the sessions stops the copy before anything is written, unless
    `--resume` says it is the rest of an interrupted copy: those sessions are checked, not copied,
    and the usage rollups, copied before the first session, are not added again."""
    source = await open_store(source_config)
    try:
        target = await open_store(target_config)
    except BaseException:
        await source.close()  # its threads would keep the process from exiting
        raise
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
        endpoint_usage = await source.endpoint_usage(None)  # what the session-less endpoint calls spent
        if not resume:
            for tenant, usage in rollups.items():
                await target.add_to_rollup(tenant, usage)
            for spent in endpoint_usage:
                await target.add_endpoint_usage(spent)
        in_source: Counter[str] = Counter(tenant_usage=len(rollups))
        in_target: Counter[str] = Counter(tenant_usage=len(rollups.keys() & (await target.tenant_rollups()).keys()))
        in_source["endpoint_usage"] = len(endpoint_usage)
        in_target["endpoint_usage"] = len(set(endpoint_usage) & set(await target.endpoint_usage(None)))
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
        await target.refresh_statistics()
    finally:
        await source.close()
        await target.close()
    for kind, table in [("session", "sessions"), ("turn", "turns"), ("message", "messages"),
                        ("summary", "summaries"), ("tenant_usage", "tenant_usage"),
                        ("endpoint_usage", "endpoint_usage")]:
        n, copied = in_source[kind], in_target[kind]
        print(f"{table:<12} source {n:>8}  copied {copied:>8}  {'ok' if copied == n else 'MISMATCH'}")
    for name in different:
        print(f"memproxy: {name}: the copy differs from the source", file=sys.stderr)
    return 1 if different or in_source != in_target else 0


async def _export(store: Store, tenant: str, session_id: str) -> list[dict[str, Any]]:
    session = await store.get_session(tenant, session_id)
    assert session is not None
    return await store.export_session(session)


if __name__ == "__main__":
    sys.exit(main())

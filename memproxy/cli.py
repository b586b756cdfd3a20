"""The `memproxy` command: `serve` runs the daemon, `check-config` checks a config file as `serve`
would (`memproxy.preflight`), `init` writes a starting one (`memproxy.starter`), `sessions ...`
manages stored sessions (`memproxy.sessions_cli`). The console script enters through
`memproxy.entry`, which handles `serve`'s stop signals before this module is imported.

Only `serve`, `sessions context` and `check-config` (for a model whose window is not set) import
litellm (once); the other commands stay light.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit, urlunsplit

from . import __version__, sessions_cli, workers
from .app import runner as app_runner
from .config import LOG_LEVELS, Config, ConfigError, StorageConfig, load_config
from .deadlines import protocols
from .errors import ProxyError
from .logs import configure as configure_logging, log_start
from .preflight import problems
from .provider import load_litellm
from .starter import PROVIDERS, ProviderKind, starter_config
from .stopping import Stopped, stop_signals
from .store import Store, open_store
from .store.errors import DRIVER_ERRORS, StoreConflict, StoreUnavailable
from .store.sqlite import sqlite_path
from .typedefs import PROVIDER

log = logging.getLogger("memproxy")


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
        if found := problems(config):  # what `serve` checks at start besides the file itself
            return _refuse(found, args.config)
        print(f"{args.config}: ok ({len(config.models)} models, "
              f"{len(config.auth.keys)} API keys, store {_without_password(config.storage.url)})")
        return 0
    server = config.server
    server = replace(
        server,
        host=args.host or server.host,
        port=server.port if args.port is None else args.port,
        allow_unauthenticated=server.allow_unauthenticated or args.allow_unauthenticated,
        workers=server.workers if args.workers is None else args.workers,
    )
    config = replace(config, server=server)
    if server.workers < 1:
        return _refuse([ConfigError("server.workers", "must be at least 1")], args.config)
    stop_signals.install()  # as `memproxy.entry` does, for a caller that did not come through it
    configure_logging(args.log_level or config.logging.level, config.logging.format)
    try:
        if found := problems(config):  # before anything starts: a config `serve` would stop on opens nothing
            return _refuse(found, args.config)
        if server.workers > 1 and args.ready_fd is None:
            return _supervise(args, config)
        log.debug("starting: importing litellm")
        # here, where a stop signal interrupts it at once; the provider finds it loaded
        load_litellm(observed=bool(config.litellm.callbacks))
        asyncio.run(_serve(config, args.ready_fd))
    except ConfigError as exc:  # found while starting: the store would not open, the port is taken
        return _refuse([exc], args.config)
    except Stopped:  # a stop signal before the server's event loop ran: nothing was left open
        log.info("stopped while starting")
    return 0


def _supervise(args: argparse.Namespace, config: Config) -> int:
    """`serve --workers N` (`memproxy.workers`): the store migrated once, then N workers, each this
    command with one worker, on the port this process reserved."""
    try:
        asyncio.run(_apply_migrations(config.storage))  # before any worker opens the store
    except DRIVER_ERRORS as exc:
        raise ConfigError("storage.url", f"the store did not open: {type(exc).__name__}: {exc}") from exc

    def worker_args(port: int, ready_fd: int) -> list[str]:
        return ["serve", *(["-c", args.config] if args.config else []), "--host", config.server.host,
                "--port", str(port), "--workers", "1", "--ready-fd", str(ready_fd),
                *(["--allow-unauthenticated"] if config.server.allow_unauthenticated else []),
                *(["--log-level", args.log_level] if args.log_level else [])]

    try:
        return asyncio.run(workers.supervise(config.server.workers, config.server.host, config.server.port,
                                             worker_args))
    except OSError as exc:
        raise ConfigError("server.port", f"cannot listen on {config.server.host}:{config.server.port}: "
                                         f"{exc.strerror or exc}") from exc


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
    await _apply_migrations(config.storage)
    print(f"{_without_password(config.storage.url)}: migrated")
    return 0


async def _apply_migrations(storage: StorageConfig) -> None:
    store = await open_store(storage)  # opening a store applies what is pending
    await store.close()


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


async def _serve(config: Config, ready_fd: int | None = None) -> None:
    """Start, then serve until a stop signal. A signal cancels this task wherever it is, starting
    (the store opening or migrating) or serving; what had started then stops, in reverse order.
    A worker of `serve --workers N` (`ready_fd` set) shares its port with the others (SO_REUSEPORT)
    and says it listens with a byte on `ready_fd` instead of the "listening" line."""
    task = asyncio.current_task()
    assert task is not None
    closing = False
    supervisor = os.getppid() if ready_fd is not None else None

    def stop() -> None:
        if not closing:  # a cancel while closing would leave the store open, its threads keeping the process
            task.cancel()

    # A handler whose client went away is cancelled, as in the test server: an answer nobody
    # received is not recorded, so a client's retry of it is not stored twice.
    server = config.server
    access_log = logging.getLogger("aiohttp.access") if server.access_log else None
    runner = app_runner(config, access_log=access_log, handler_cancellation=True,
                        keepalive_timeout=server.keepalive_timeout_seconds)
    listener = None
    loop = asyncio.get_running_loop()
    with stop_signals.on_loop(loop, stop):
        try:
            log.debug("starting: opening the store, then the provider")
            try:
                await runner.setup()
            except DRIVER_ERRORS as exc:  # what the checks cannot see: a migration, a schema's rights
                raise ConfigError("storage.url", f"the store did not open: {type(exc).__name__}: {exc}") from exc
            assert runner.server is not None
            # aiohttp's server, each connection wrapped with the header deadline (memproxy.deadlines).
            try:
                listener = await loop.create_server(
                    protocols(runner.server, server.header_timeout_seconds), server.host, server.port,
                    reuse_address=True, reuse_port=ready_fd is not None)
            except OSError as exc:
                raise ConfigError("server.port", f"cannot listen on {server.host}:{server.port}: "
                                                 f"{exc.strerror or exc}") from exc
            port = listener.sockets[0].getsockname()[1]
            provider = runner.app[PROVIDER]
            log_start(config, {model.name: provider.window(model) for model in config.models})
            if ready_fd is None:
                print(f"memproxy listening on http://{server.host}:{port}", flush=True)
            else:
                os.write(ready_fd, b"1")
                os.close(ready_fd)
            if supervisor is None:
                await loop.create_future()  # until a stop signal cancels this task
            else:  # or until the worker's supervisor is gone
                await _while_supervised(supervisor)
                log.warning("the supervisor (serve --workers, pid %d) is gone: this worker stops", supervisor)
        except asyncio.CancelledError:
            if not stop_signals.requested:
                raise
            log.info("stopping")
        finally:
            closing = True
            if listener is not None:
                listener.close()  # no new connections; the runner then closes idle ones and drains the rest
            await runner.cleanup()  # what started stops (the store's threads would keep the process)


async def _while_supervised(supervisor: int) -> None:
    """Return once the worker's supervisor is gone (the worker is another process's child then):
    killed with SIGKILL it cannot pass on a stop, and its workers would serve on, beside those of
    the next `serve` on the port (SO_REUSEPORT lets both bind), perhaps on another store. Each then
    finishes what it serves, as on SIGTERM."""
    while os.getppid() == supervisor:
        await asyncio.sleep(_SUPERVISOR_CHECK_SECONDS)


_SUPERVISOR_CHECK_SECONDS = 1.0


if __name__ == "__main__":
    sys.exit(main())

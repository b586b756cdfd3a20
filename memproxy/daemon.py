"""`memproxy serve`: the daemon. Its config checked (`memproxy.preflight`), litellm loaded, the app
(`memproxy.app`) served on aiohttp's server until a stop signal, or `--workers N` processes of it
(`memproxy.workers`). Imported by `memproxy.cli` for this command alone: the app and everything it
serves with are about half of what the other commands would otherwise take to start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import replace

from . import workers
from .app import runner as app_runner
from .config import Config, ConfigError
from .deadlines import protocols
from .logs import configure as configure_logging, log_start
from .preflight import problems
from .provider import load_litellm
from .stopping import Stopped, stop_signals
from .store import apply_migrations
from .store.errors import DRIVER_ERRORS
from .typedefs import PROVIDER

log = logging.getLogger("memproxy")


class Refused(Exception):
    """`serve` refused its config before anything started: each reason, by key."""

    def __init__(self, found: list[ConfigError]) -> None:
        super().__init__("; ".join(str(exc) for exc in found))
        self.found = found


def serve(args: argparse.Namespace, config: Config) -> int:
    """`memproxy serve` with its options (`args`) over `config`: the exit code once stopped."""
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
        raise Refused([ConfigError("server.workers", "must be at least 1")])
    stop_signals.install()  # as `memproxy.entry` does, for a caller that did not come through it
    configure_logging(args.log_level or config.logging.level, config.logging.format)
    try:
        if found := problems(config):  # before anything starts: a config `serve` would stop on opens nothing
            raise Refused(found)
        if server.workers > 1 and args.ready_fd is None:
            return _supervise(args, config)
        log.debug("starting: importing litellm")
        # here, where a stop signal interrupts it at once; the provider finds it loaded
        load_litellm(observed=bool(config.litellm.callbacks))
        asyncio.run(_serve(config, args.ready_fd))
    except ConfigError as exc:  # found while starting: the store would not open, the port is taken
        raise Refused([exc]) from exc
    except Stopped:  # a stop signal before the server's event loop ran: nothing was left open
        log.info("stopped while starting")
    return 0


def _supervise(args: argparse.Namespace, config: Config) -> int:
    """`serve --workers N` (`memproxy.workers`): the store migrated once, then N workers, each this
    command with one worker, on the port this process reserved."""
    try:
        asyncio.run(apply_migrations(config.storage))  # before any worker opens the store
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

"""A TCP relay of a test's own between memproxy and the machine's PostgreSQL, which the test cuts
(every open connection closed, new ones refused, as a restart or a network reset would) or stalls
(connections stay open and new ones are accepted, but no byte goes either way, as with a server that
hangs or a network that drops packets without a reset), then restores."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from dataclasses import replace

from memproxy.config import StorageConfig


class Relay:
    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.cut_off = False
        self.port = 0

    @classmethod
    async def to(cls, storage: StorageConfig) -> Relay:
        """A relay started to the server `storage` names."""
        url = urllib.parse.urlsplit(storage.url)
        relay = cls(url.hostname or "127.0.0.1", url.port or 5432)
        relay._server = await asyncio.start_server(relay._serve, "127.0.0.1", 0)
        relay.port = relay._server.sockets[0].getsockname()[1]
        return relay

    async def cut(self) -> None:
        """Close every open connection; refuse new ones until `restore`."""
        self.cut_off = True
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def restore(self) -> None:
        self.cut_off = False

    def stall(self) -> None:
        """Hold every byte either way until `resume`; a side that closes is passed on at once."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self.resume()
        await self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            client_writer.close()
            return
        server_reader, server_writer = await asyncio.open_connection(*self._target)
        self._writers.update((client_writer, server_writer))
        await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))
        for writer in (client_writer, server_writer):
            writer.close()
            self._writers.discard(writer)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        writer.close()


def through(storage: StorageConfig, relay: Relay) -> StorageConfig:
    """The same database and schema, reached through the relay."""
    url = urllib.parse.urlsplit(storage.url)
    netloc = f"{url.username}@127.0.0.1:{relay.port}" if url.username else f"127.0.0.1:{relay.port}"
    return replace(storage, url=urllib.parse.urlunsplit(url._replace(netloc=netloc)))

"""Messages between the server's process and an engine process over a connected socket: each
one pickled, framed by its length. Both ends are neuronpy's own processes (a socket pair made
by the server, never a listening address), so what is unpickled is only what they wrote."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import struct
from typing import Any

HEADER = struct.Struct("<Q")  # the payload's length in bytes


def frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def send_blocking(sock: socket.socket, message: Any) -> None:
    """Sends one message on a blocking socket (the processes' handshake, before either runs
    an event loop)."""
    sock.sendall(frame(message))


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = sock.recv(min(left, 1 << 20))
        if not part:
            raise EOFError("the other process closed the channel")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def receive_blocking(sock: socket.socket) -> Any:
    """The next message on a blocking socket; EOFError once the other end has closed."""
    (size,) = HEADER.unpack(_read_exactly(sock, HEADER.size))
    return pickle.loads(_read_exactly(sock, size))


class Channel:
    """One end of the socket on an asyncio event loop. `send` never blocks (what the other
    end has not read yet waits in the transport's buffer), so the engine's loop hands its
    messages over between two steps without waiting for the server's process."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer)

    def send(self, message: Any) -> None:
        """Queues one message; ConnectionError once the other end has gone."""
        if self._writer.is_closing():
            raise ConnectionResetError("the channel is closed")
        self._writer.write(frame(message))

    async def receive(self) -> Any:
        """The next message; EOFError once the other end has closed (or gone)."""
        try:
            (size,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
            payload = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise EOFError("the other process closed the channel") from exc
        return pickle.loads(payload)

    async def drain(self) -> None:
        """Waits until what was sent has left this process's buffer."""
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    def close(self) -> None:
        self._writer.close()

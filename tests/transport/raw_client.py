"""A client that speaks HTTP/1.1 byte by byte, as slowly or as oddly as a test needs: for
the servers' limits on what (and how fast, and how many) clients send."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import msgspec


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def error(self) -> dict[str, object]:
        """The `error` object of a JSON error body."""
        assert self.headers.get("content-type", "").startswith("application/json"), self
        error = msgspec.json.decode(self.body)["error"]
        assert isinstance(error, dict)
        return error


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str) -> RawConnection:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self, timeout_s: float = 15.0) -> Answer:
        """The next response (Content-Length or chunked framing)."""
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int((await self.reader.readuntil(b"\r\n"))[:-2], 16):
                    body += (await self.reader.readexactly(size + 2))[:-2]
                await self.reader.readuntil(b"\r\n")
            else:
                body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return Answer(status, headers, body)

    async def closed_by_server(self, timeout_s: float = 15.0) -> bool:
        """Whether the server ends the connection within `timeout_s` (reading, and dropping,
        what it sends meanwhile)."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
        except TimeoutError:
            return False
        except ConnectionError:
            pass
        return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def request_head(
    path: str, length: int | None = None, method: str = "POST", extra: str = ""
) -> bytes:
    """A request's head; `length` None: a chunked body."""
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    if method == "GET":
        framing = ""
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    return (head + (framing + "\r\n" if framing else "") + extra + "\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)

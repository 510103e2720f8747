"""The router's lean HTTP/1.1 client against raw asyncio servers on loopback that answer in each of
the ways a backend can: kept alive, chunked, closed after answering, not HTTP at all, dropped,
stalled, or refused."""
from __future__ import annotations

import asyncio
import socket

import pytest

from shardserve.router.http1 import ConnectionFailed, Http1Pool

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\": 1}\r\n"


async def serve(answer):
    """A server that reads one request at a time and calls answer(writer, n) with the request's
    number on that connection; returns (url, stats)."""
    stats = {"connections": 0, "bodies": []}

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats["connections"] += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                stats["bodies"].append(await reader.readexactly(length))
                n += 1
                if await answer(writer, n) == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions", stats


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_keeps_connections_alive_and_reads_the_answer():
    async def main():
        async def answer(writer, n):
            writer.write(OK)
        server, url, stats = await serve(answer)
        pool = Http1Pool()
        for i in range(3):
            status, body, ctype = await pool.post(url, b'{"i": %d}' % i, {"X-Test": "1"}, 5)
            assert (status, body, ctype) == (200, b'{"ok": 1}\r\n', "application/json")
        assert stats["connections"] == 1 and stats["bodies"] == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
        pool.close()
        server.close()
    run(main())


def test_chunked_answers_and_connection_close():
    async def main():
        async def answer(writer, n):
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n4\r\nnot \r\n5\r\nfound\r\n0\r\n\r\n")
            return "close"
        server, url, stats = await serve(answer)
        pool = Http1Pool()
        assert await pool.post(url, b"{}", {}, 5) == (404, b"not found", "text/plain")
        assert await pool.post(url, b"{}", {}, 5) == (404, b"not found", "text/plain")
        assert stats["connections"] == 2   # "Connection: close" is honoured: no reuse
        server.close()
    run(main())


def test_a_kept_alive_connection_the_server_dropped_is_replaced():
    async def main():
        async def answer(writer, n):
            writer.write(OK)
            return "close"   # closes without saying so, as an idle timeout would
        server, url, stats = await serve(answer)
        pool = Http1Pool()
        assert (await pool.post(url, b"{}", {}, 5))[0] == 200
        await asyncio.sleep(0.1)
        assert (await pool.post(url, b"{}", {}, 5))[0] == 200
        assert stats["connections"] == 2
        server.close()
    run(main())


@pytest.mark.parametrize("reply", [b"this is not HTTP\r\n\r\n", b""])
def test_garbage_or_a_dropped_connection_is_a_connection_failure(reply):
    async def main():
        async def answer(writer, n):
            writer.write(reply)
            return "close"
        server, url, _ = await serve(answer)
        with pytest.raises(ConnectionFailed):
            await Http1Pool().post(url, b"{}", {}, 5)
        server.close()
    run(main())


def test_a_stalled_backend_times_out_and_its_connection_is_not_reused():
    async def main():
        async def answer(writer, n):
            if n == 1:
                await asyncio.sleep(30)
            writer.write(OK)
        server, url, stats = await serve(answer)
        pool = Http1Pool()
        with pytest.raises(asyncio.TimeoutError):
            await pool.post(url, b"{}", {}, 0.3)
        assert not any(pool.idle.values())
        server.close()
    run(main())


def test_refused():
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionFailed):
        run(Http1Pool().post(f"http://127.0.0.1:{port}/v1/x", b"{}", {}, 5))

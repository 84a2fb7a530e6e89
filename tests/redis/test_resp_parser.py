"""The RESP reply parsers (SPEC O6): ``hiredis``'s Reader as relay configures it and the
pure-Python fallback give the same values — error replies as `RespError` objects, inside
arrays too — whatever the pieces the bytes arrive in; both are incremental: a large reply
read off a real loopback socket in 4 KiB pieces costs CPU linear in its size (measured
against itself: 2 MiB against 1 MiB, not a wall-clock constant); a reply past the cap
fails the connection."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio

from relay.redis import resp
from relay.redis.wire import (
    _NOT_YET,
    HAVE_HIREDIS,
    MAX_REPLY_BYTES,
    ConnectionLost,
    HiredisParser,
    PyParser,
    Reader,
    RespError,
)

PARSERS: list[Any] = [pytest.param(PyParser, id="python")]
if HAVE_HIREDIS:
    PARSERS.insert(0, pytest.param(HiredisParser, id="hiredis"))

WIRE = (b"+OK\r\n" b":-42\r\n" b"$-1\r\n" b"*-1\r\n" b"*0\r\n" b"$0\r\n\r\n"
        b"$12\r\n\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87 \xe2\x9c\x93\r\n"
        b"*4\r\n:1\r\n-ERR in an array\r\n*2\r\n$1\r\na\r\n*1\r\n:2\r\n$2\r\n\xff!\r\n"
        b"-NOSCRIPT No matching script\r\n")


def canon(value: Any) -> Any:
    if isinstance(value, RespError):
        return ("error", str(value), value.code)
    if isinstance(value, list):
        return [canon(v) for v in value]
    return value


EXPECTED = ["OK", -42, None, None, [], "", "ключ ✓",
            [1, ("error", "ERR in an array", "ERR"), ["a", [2]], "\ufffd!"],
            ("error", "NOSCRIPT No matching script", "NOSCRIPT")]


@pytest.mark.parametrize("make", PARSERS)
@pytest.mark.parametrize("seed", range(4))
def test_both_parsers_give_the_same_values_whatever_the_pieces(make: Callable[[], Any],
                                                              seed: int) -> None:
    rng = random.Random(seed)
    parser = make()
    got: list[Any] = []
    pos = 0
    while pos < len(WIRE):
        step = 1 if seed == 0 else rng.randint(1, 12)
        parser.feed(WIRE[pos:pos + step])
        pos += step
        while (value := parser.gets()) is not _NOT_YET:
            got.append(canon(value))
    assert got == EXPECTED


@pytest.mark.parametrize("make", PARSERS)
def test_a_reply_that_is_not_resp_fails(make: Callable[[], Any]) -> None:
    parser = make()
    parser.feed(b"?what\r\n")
    with pytest.raises(ConnectionLost, match="not RESP"):
        parser.gets()


def test_the_python_parser_refuses_a_reply_nested_past_reason() -> None:
    parser = PyParser()
    parser.feed(b"*1\r\n" * 1000)
    with pytest.raises(ConnectionLost, match="nested"):
        parser.gets()


def big_array(size: int) -> bytes:
    item = b"$8\r\nabcdefgh\r\n"
    n = size // len(item)
    return b"*%d\r\n" % n + item * n


async def serve_once(reply: bytes, task_status: trio.TaskStatus[int]) -> None:
    """A fake server on loopback: one connection, one command, ``reply`` in 4 KiB pieces."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    stream = await listeners[0].accept()
    async with stream:
        await stream.receive_some(65536)
        try:
            for i in range(0, len(reply), 4096):
                await stream.send_all(reply[i:i + 4096])
            await stream.receive_some(65536)  # until the client closes
        except trio.BrokenResourceError:
            pass  # the client gave up on it (the cap)
    await listeners[0].aclose()


async def cpu_of_one_reply(make: Callable[[], Any], size: int) -> float:
    """CPU time (this thread: client, parser and the fake server) to read one array of
    ``size`` bytes over a real loopback socket."""
    reply = big_array(size)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_once, reply)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            reader = Reader(stream, make())
            # The collector's passes cost with every object the process holds (what the
            # tests before this one left), not with the reply: measured without them.
            gc.collect()
            gc.disable()
            try:
                started = time.thread_time()
                await stream.send_all(resp.encode(("LRANGE", "big", 0, -1)))
                value = await reader.reply()
                spent = time.thread_time() - started
            finally:
                gc.enable()
        assert len(value) == size // 14 and value[-1] == "abcdefgh"
    return spent


@pytest.mark.parametrize("make", PARSERS)
async def test_a_large_reply_costs_cpu_linear_in_its_size(make: Callable[[], Any]) -> None:
    # The least of five runs of each (other processes share the CPU); linear means about
    # 2x for twice the bytes, the old re-parse from the first byte was 4x and more.
    one = min([await cpu_of_one_reply(make, 1 << 20) for _ in range(5)])
    two = min([await cpu_of_one_reply(make, 2 << 20) for _ in range(5)])
    print(f"{make.__name__}: 1 MiB {one * 1000:.1f} ms CPU, 2 MiB {two * 1000:.1f} ms CPU, "
          f"ratio {two / one:.2f}")
    assert two / one < 3.0


@pytest.mark.parametrize("make", PARSERS)
async def test_a_reply_past_the_cap_fails_the_connection(make: Callable[[], Any]) -> None:
    endless = b"$%d\r\n" % (4 * MAX_REPLY_BYTES) + b"x" * (MAX_REPLY_BYTES + 2 * 65536)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_once, endless)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(resp.encode(("GET", "x")))
            with trio.fail_after(20), pytest.raises(ConnectionLost, match="more than"):
                await Reader(stream, make()).reply()

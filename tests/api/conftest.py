"""The pool's tests share one tiny server (`helpers.pool_server`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
from helpers.pool_server import Server, serve


@pytest.fixture
async def server(nursery: trio.Nursery) -> AsyncIterator[Server]:
    yield await serve(nursery)

"""The shared room's server: a real redis-server, as the default user and as the user
with exactly the rights docs/operators.md documents (`helpers.redis_server`).

The room's tests run on real time against deadlines of the product's own (a command to
the server has at most 1 s). A worker that has run many tests holds a large heap, and a
full pass of the cycle collector over it, slowed further on a busy machine, can stall
the relays' event loop for a good part of that second: what the earlier tests left is
frozen out of the collector's passes before each test here (`gc.freeze`: what this test
makes is still collected).
"""

from __future__ import annotations

import gc

import pytest
from helpers.redis_server import redis_shared_fixture

__all__ = ["redis_shared_fixture"]


@pytest.fixture(autouse=True)
def _earlier_objects_frozen() -> None:
    gc.freeze()

"""The Redis client's server: a real redis-server on a free loopback port."""

from helpers.redis_server import redis_fixture

__all__ = ["redis_fixture"]

"""The shared room's server: a real redis-server, as the default user and as the user
with exactly the rights docs/operators.md documents (`helpers.redis_server`)."""

from helpers.redis_server import redis_shared_fixture

__all__ = ["redis_shared_fixture"]

"""Every exception class httpx can raise, each as an instance: what an upstream failure can
look like to an adapter."""

from __future__ import annotations

import inspect

import httpx


def _httpx_exception_classes() -> list[type[BaseException]]:
    seen: dict[type[BaseException], None] = {}
    todo = [getattr(httpx, name) for name in httpx.__all__]
    todo = [c for c in todo if inspect.isclass(c) and issubclass(c, BaseException)]
    while todo:
        cls = todo.pop()
        if cls not in seen and cls.__module__.startswith("httpx"):
            seen[cls] = None
            todo += cls.__subclasses__()
    return sorted(seen, key=lambda c: c.__name__)


def _instance(cls: type[BaseException]) -> BaseException:
    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    if issubclass(cls, httpx.HTTPStatusError):
        return cls("boom", request=request, response=httpx.Response(500, request=request))
    if issubclass(cls, httpx.RequestError):
        return cls("boom", request=request)
    if cls in (httpx.StreamConsumed, httpx.StreamClosed, httpx.ResponseNotRead,
               httpx.RequestNotRead):
        return cls()
    return cls("boom")

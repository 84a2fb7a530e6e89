"""What relay adds to its non-chat endpoints: ``POST /v1/embeddings`` (OpenAI-compatible
and Gemini upstreams, float and base64), ``POST /v1/messages/count_tokens`` and
``GET /v1/models/{id}``, against a direct call to the same fake upstream, in one run.

    python -m bench.endpoints [--n N]

One process: the fakes (tests/fakes/fake_endpoints.py), relay (``relay.serve`` on port 0) and
the client (httpx, one keep-alive connection, one request at a time) share one trio
loop on one core, so a row's absolute time includes the client's and the fake's work.
The *added* column (relay minus direct, medians) is what a client waits longer through
relay: relay's own work (guard, parse, lane, record, render) and its own HTTP hop to the
upstream, whose cost on this shared core is about the direct column again. Rows run
interleaved (direct, relay, …) so noise hits both sides.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [f"a sentence to embed, number {i}" for i in range(16)]


def _config(emb: Any, gem: Any, ant: Any, records: Path) -> str:
    profile = "lanes = 4\nqueue_max = 64\nqueue_timeout_s = 30\nrun_timeout_s = 600\nrpm = 0\n"
    return (f'[server]\nrecords = "{records}"\n'
            f'[providers.emb]\nadapter = "openai"\nbase_url = "{emb.url}"\n'
            f'models = ["e1"]\n[providers.emb.profile]\n{profile}'
            f'[providers.gem]\nadapter = "gemini"\nbase_url = "{gem.url}"\n'
            f'api_key_env = "BENCH_GEMINI_KEY"\nmodels = ["text-embedding-test"]\n'
            f'[providers.gem.profile]\n{profile}'
            f'[providers.ant]\nadapter = "anthropic"\nbase_url = "{ant.url}"\n'
            f'api_key_env = "BENCH_ANTHROPIC_KEY"\nmodels = ["claude-test-1"]\n'
            f'[providers.ant.profile]\n{profile}')


async def _time(http: httpx.AsyncClient, method: str, url: str, body: Any,
                headers: dict[str, str]) -> float:
    started = time.perf_counter()
    r = await http.request(method, url, json=body, headers=headers)
    took = time.perf_counter() - started
    if r.status_code != 200:
        raise SystemExit(f"{method} {url}: {r.status_code} {r.text[:300]}")
    return took


async def main(n: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from fakes import (
        fake_anthropic,  # type: ignore[import-not-found]
        fake_endpoints,  # type: ignore[import-not-found]
        fake_gemini,  # type: ignore[import-not-found]
    )

    import relay

    os.environ["BENCH_GEMINI_KEY"] = fake_gemini.KEY
    os.environ["BENCH_ANTHROPIC_KEY"] = fake_anthropic.KEY
    tmp = Path(tempfile.mkdtemp(prefix="relay-bench-endpoints-"))
    async with trio.open_nursery() as nursery:
        emb = await nursery.start(fake_endpoints.serve_fake_embeddings)
        gem = await nursery.start(fake_endpoints.serve_embedding_gemini)
        ant = await nursery.start(fake_endpoints.serve_counting_anthropic)
        config = relay.parse_config(_config(emb, gem, ant, tmp / "records.jsonl"),
                                    source="bench.toml", base_dir=tmp)
        served = await nursery.start(functools.partial(relay.serve, config, port=0))
        gkey = {"x-goog-api-key": fake_gemini.KEY}
        akey = {"x-api-key": fake_anthropic.KEY, "anthropic-version": "2023-06-01"}
        count = {"messages": [{"role": "user", "content": " ".join(TEXTS)}]}
        gem_body = {"requests": [{"model": "models/text-embedding-test",
                                  "content": {"parts": [{"text": t}]}} for t in TEXTS]}
        rows = [
            ("embeddings, openai, float",
             ("POST", f"{emb.url}/embeddings", {"model": "e1", "input": TEXTS}, {}),
             ("POST", f"{served.url}/v1/embeddings",
              {"model": "emb/e1", "input": TEXTS, "encoding_format": "float"}, {})),
            ("embeddings, openai, base64",
             ("POST", f"{emb.url}/embeddings", {"model": "e1", "input": TEXTS,
                                                "encoding_format": "base64"}, {}),
             ("POST", f"{served.url}/v1/embeddings",
              {"model": "emb/e1", "input": TEXTS, "encoding_format": "base64"}, {})),
            ("embeddings, gemini, float",
             ("POST", f"{gem.url}/models/text-embedding-test:batchEmbedContents", gem_body,
              gkey),
             ("POST", f"{served.url}/v1/embeddings",
              {"model": "gem/text-embedding-test", "input": TEXTS,
               "encoding_format": "float"}, {})),
            ("count_tokens, anthropic",
             ("POST", f"{ant.url}/messages/count_tokens",
              {"model": "claude-test-1", **count}, akey),
             ("POST", f"{served.url}/v1/messages/count_tokens",
              {"model": "ant/claude-test-1", **count}, {})),
            ("models/{id}",
             ("GET", f"{emb.url}/models", None, {}),
             ("GET", f"{served.url}/v1/models/emb%2Fe1", None, {})),
        ]
        print(f"{n} requests per side, one at a time, {len(TEXTS)} texts per embedding "
              "request; medians in ms")
        print(f"{'endpoint':28} {'direct':>8} {'relay':>8} {'added':>8}")
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            for name, direct, via in rows:
                times: dict[str, list[float]] = {"direct": [], "relay": []}
                for _ in range(n):
                    times["direct"].append(await _time(http, *direct))
                    times["relay"].append(await _time(http, *via))
                d, r = (statistics.median(times[k]) * 1000 for k in ("direct", "relay"))
                print(f"{name:28} {d:8.2f} {r:8.2f} {r - d:8.2f}")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    trio.run(main, parser.parse_args().n)

"""How far relay's local token estimate (`relay.capacity.estimate`) is from real tokenizers.

    pip install bpe-openai        # (not a dependency of relay: only this measurement)
    python -m bench.estimate
    python -m bench.estimate --learn      # how the estimate learns (no package needed)

For each corpus — the tests' English-like prose (`tests/fakes/fake_metered.prose`), relay's own
README and docs (real English), Python source, JSON, and Chinese and German text — it
prints the estimate against OpenAI's ``o200k_base`` and ``cl100k_base`` encodings (exact,
from the ``bpe-openai`` package, which ships them) and against the fake provider's own
counter. An estimate above the provider's count costs throughput (a request waits for
tokens it will not use, until its settlement gives them back); one below it risks a 429
that the provider's headers then correct.

``--learn`` replays the prompts of ``bench/estimate_counts.json`` (slices of the frozen
corpora in ``bench/estimate_corpora/``, counted by three real tokenizers with
``bench/count_tokens.mjs``; see its header) as a provider's answers to relay's
`InputRatio`, one corpus and tokenizer at a time, in 20 shuffled orders: after N answers
it freezes what was learned and prints how far the learned estimate is from the real
count on the prompts not yet seen (the median error, and the 10th-90th percentiles).
A provider's count is the tokenizer's count of the text plus 7, as OpenAI frames one
chat message (relay's estimate adds the same 7).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakes.fake_metered import count_tokens, prose  # noqa: E402

from relay.capacity.estimate import (  # noqa: E402
    InputRatio,
    estimate_input,
    estimate_text,
    script_of,
)
from relay.vocab.events import Call  # noqa: E402

COUNTS = ROOT / "bench" / "estimate_counts.json"
FRAMING = 7                 # tokens OpenAI adds to one chat message's text (3 + 1 + 3)
AFTER = (0, 3, 10, 30, 100)
ORDERS = 20

CHINESE = ("人工智能模型按令牌计费，每分钟的输入和输出令牌都有上限。当请求过多时，服务会返回"  # noqa: RUF001
           "错误并要求稍后重试。中继在发送前估计每个请求的令牌数，并在队列中等待预算。") * 20  # noqa: RUF001
GERMAN = ("Die Anfrage wartet in der Warteschlange, bis das Token-Budget des Anbieters "
          "wieder ausreicht; danach wird sie gesendet und mit dem gemeldeten Verbrauch "
          "abgerechnet. Überschreitungen führen zu Fehlermeldungen. ") * 20


def corpora() -> dict[str, str]:
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted(
        (ROOT / "docs").glob("*.md"))])
    code = "\n".join(p.read_text() for p in sorted((ROOT / "relay" / "engine").glob("*.py")))
    status = json.dumps({"providers": {f"p{i}": {"lanes": {"running": i, "capacity": 8},
                                                  "models": [f"model-{i}-{j}" for j in
                                                             range(5)]}
                                       for i in range(40)}}, indent=1)
    return {"tests' prose, 200": prose(200, 1), "tests' prose, 6,000": prose(6000, 3),
            "README + docs (English)": docs, "Python (relay/engine)": code,
            "JSON": status, "German": GERMAN, "Chinese": CHINESE}


@functools.cache
def prompts() -> dict[str, tuple[list[tuple[str, int]], dict[str, list[int]]]]:
    """By corpus: its prompts' (script by `script_of`, relay's estimate of one user
    message holding it), and by tokenizer each prompt's count as a provider reports it."""
    data = json.loads(COUNTS.read_text(encoding="utf-8"))
    out: dict[str, tuple[list[tuple[str, int]], dict[str, list[int]]]] = {}
    for name, corpus in data["corpora"].items():
        text = (ROOT / "bench" / "estimate_corpora" / corpus["file"]).read_text(
            encoding="utf-8")
        slices = [(text * ((start + length) // len(text) + 2))[start:start + length]
                  for start, length, *_ in corpus["prompts"]]
        seen = [(script_of(s), estimate_input(Call(
            request_id="bench", provider="p", model="m", stream=False,
            messages=[{"role": "user", "content": s}]))) for s in slices]
        out[name] = (seen, {encoding: [row[2 + k] + FRAMING for row in corpus["prompts"]]
                            for k, encoding in enumerate(data["encodings"])})
    return out


def answers_of(corpus: str, encoding: str) -> list[tuple[str, int, int]]:
    """A corpus's prompts as a provider counting with ``encoding`` answers them: (script,
    relay's estimate, reported prompt tokens)."""
    seen, by_encoding = prompts()[corpus]
    return [(script, guess, real)
            for (script, guess), real in zip(seen, by_encoding[encoding], strict=True)]


def learning(answers: list[tuple[str, int, int]], after: tuple[int, ...] = AFTER,
             orders: int = ORDERS, by_script: bool = True) -> dict[int, list[float]]:
    """For each N in ``after``: the errors (learned estimate / real count - 1) on the
    prompts not yet seen, once N answers taught the learner, over ``orders`` shuffles of
    ``answers`` (script, relay's estimate, reported count)."""
    errors: dict[int, list[float]] = {n: [] for n in after}
    for seed in range(orders):
        shuffled = answers[:]
        random.Random(seed).shuffle(shuffled)
        ratio, taught = InputRatio(), 0
        for n in after:
            for script, guess, real in shuffled[taught:n]:
                ratio.learn("m", script if by_script else "all", guess, real)
            taught = n
            frozen = copy.deepcopy(ratio)
            errors[n] += [frozen.adjust("m", script if by_script else "all", guess) / real - 1
                          for script, guess, real in shuffled[n:]]
    return errors


def _cell(errors: list[float]) -> str:
    deciles = statistics.quantiles(errors, n=10)
    return f"{statistics.median(errors):+.0%} ({deciles[0]:+.0%} to {deciles[-1]:+.0%})"


def learn_tables() -> None:
    corpora = prompts()
    print("| corpus | tokenizer | script | " + " | ".join(
        "before learning" if n == 0 else f"after {n}" for n in AFTER) + " |")
    print("|---|---|---|" + "---|" * len(AFTER))
    mixed: dict[str, list[tuple[str, str, int, int]]] = {}
    for name, (seen, by_encoding) in corpora.items():
        scripts = [script for script, _ in seen]
        top = max(set(scripts), key=scripts.count)
        share = scripts.count(top) / len(scripts)
        for encoding in by_encoding:
            answers = answers_of(name, encoding)
            mixed.setdefault(encoding, []).extend((name, *a) for a in answers)
            errors = learning(answers)
            print(f"| {name} | {encoding} | {top} ({share:.0%}) | "
                  + " | ".join(_cell(errors[n]) for n in AFTER) + " |")
    print()
    print("All six corpora's prompts in one stream, after 300 answers: one ratio per (model,")
    print("script), against one per model:")
    print()
    print("| tokenizer | " + " | ".join(corpora) + " |")
    print("|---|" + "---|" * len(corpora))
    for encoding, rows_ in mixed.items():
        for by_script in (True, False):
            answers = [(script, guess, real) for _, script, guess, real in rows_]
            names = [name for name, *_ in rows_]
            cells = []
            for name in corpora:
                picked = [a for a, n in zip(answers, names, strict=True) if n == name]
                rest = [a for a, n in zip(answers, names, strict=True) if n != name]
                # teach 300 answers of the mixed stream, then measure this corpus's prompts
                errors = _after_mixed(rest, picked, by_script)
                cells.append(f"{statistics.median(errors):+.0%}")
            label = "by script" if by_script else "one ratio"
            print(f"| {encoding}, {label} | " + " | ".join(cells) + " |")


def _after_mixed(rest: list[tuple[str, int, int]], measured: list[tuple[str, int, int]],
                 by_script: bool) -> list[float]:
    errors: list[float] = []
    for seed in range(ORDERS // 4):
        rng = random.Random(seed)
        stream = rng.sample(rest, 250) + rng.sample(measured, 50)
        rng.shuffle(stream)
        ratio = InputRatio()
        for script, guess, real in stream:
            ratio.learn("m", script if by_script else "all", guess, real)
        errors += [ratio.adjust("m", script if by_script else "all", guess) / real - 1
                   for script, guess, real in measured]
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.estimate")
    parser.add_argument("--learn", action="store_true",
                        help="how the estimate learns, from bench/estimate_counts.json")
    if parser.parse_args().learn:
        learn_tables()
        return
    try:
        import bpe_openai
    except ImportError:
        sys.exit("bench.estimate needs the bpe-openai package: pip install bpe-openai")
    encodings = {name: bpe_openai.get_encoding(name) for name in ("o200k_base", "cl100k_base")}
    print("| corpus | characters | estimate | o200k_base | cl100k_base | fake's counter |")
    print("|---|---|---|---|---|---|")
    for name, text in corpora().items():
        guess = estimate_text(text)
        cells = [f"{len(text):,}", f"{guess:,}"]
        for encoding in encodings.values():
            real = len(encoding.encode(text))
            cells.append(f"{real:,} ({guess / real - 1:+.0%})")
        fake = count_tokens(text)
        cells.append(f"{fake:,} ({guess / fake - 1:+.0%})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""How far relay's local token estimate (`relay.capacity.estimate`) is from real tokenizers.

    pip install bpe-openai        # (not a dependency of relay: only this measurement)
    python -m bench.estimate

For each corpus — the tests' English-like prose (`tests/fakes/fake_metered.prose`), relay's own
README and docs (real English), Python source, JSON, and Chinese and German text — it
prints the estimate against OpenAI's ``o200k_base`` and ``cl100k_base`` encodings (exact,
from the ``bpe-openai`` package, which ships them) and against the fake provider's own
counter. An estimate above the provider's count costs throughput (a request waits for
tokens it will not use, until its settlement gives them back); one below it risks a 429
that the provider's headers then correct.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fakes.fake_metered import count_tokens, prose  # noqa: E402

from relay.capacity.estimate import estimate_text  # noqa: E402

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


def main() -> None:
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

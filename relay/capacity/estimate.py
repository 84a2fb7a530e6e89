"""relay's local token estimate (SPEC L12): cheap, no network call, no tokenizer.

words, digits and punctuation counted as `estimate_text` says (a regular expression, no
vocabulary); 4 tokens a message beyond its text, 3 for the reply's priming; tool
definitions and calls by their JSON; an image part a flat `IMAGE_TOKENS`. docs/tokens.md
says how it was made and how far off it was on the tests' corpora. The output reservation
is the request's own limit, else the provider's, else a learned percentile of the model's
answers (`Learned`), never below `OUTPUT_FLOOR`.

The input estimate learns (`InputRatio`): each whole answer's reported prompt tokens over
relay's estimate, by model and by the prompt's script (`script_of`: the same estimate is
0.8x of one provider's count on Korean and 1.35x of another's), a trimmed mean of the
recent ratios that starts at 1.0 and moves as answers come — at once where the answers
say relay counts too few (an under-estimate sends requests into 429s; an over-estimate
only waits a little). The ratio is of the text: the framing (`estimate_framing`) is
counted as it is.
"""

from __future__ import annotations

import collections
import json
import math
import re
from typing import Any, Final

from relay.vocab.events import Call

__all__ = ["IMAGE_TOKENS", "LEAST_RATIO", "MESSAGE_OVERHEAD", "OUTPUT_FLOOR", "SCRIPTS",
           "InputRatio", "Learned", "estimate_framing", "estimate_input", "estimate_text",
           "output_reservation", "script_of"]

OUTPUT_FLOOR = 256          # tokens reserved for an answer of unknown length
MESSAGE_OVERHEAD = 4        # tokens a chat message costs beyond its text (role, framing)
IMAGE_TOKENS = 1000         # an image part, roughly (providers count 85-1,600)
LEARNED_SAMPLES = 100       # answers per model kept for the percentile


_PIECES = re.compile(r"[^\W\d_]+|\d{1,3}|[^\w\s]|_")


def estimate_text(text: str) -> int:
    """Tokens in ``text``, locally: a word is a token and one more for every 6 letters
    after its first, a CJK character a token (other scripts' words one more every 4),
    digits a token per 3, each punctuation mark a token; spaces are free. Within about
    -5 % to +20 % of OpenAI's encodings on English, code, JSON and German, over on
    Chinese (docs/tokens.md)."""
    if not text:
        return 0
    total = 0
    for piece in _PIECES.findall(text):
        first = piece[0]
        if first.isascii():
            total += 1 + (len(piece) - 1) // 6 if first.isalpha() else 1
        elif not first.isalpha():
            total += 1
        elif ord(first) >= 0x2E80:  # CJK and after: about a token a character
            total += len(piece)
        else:
            total += 1 + (len(piece) - 1) // 4
    return total


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return estimate_text(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type")
                if kind in ("image_url", "image", "input_image"):
                    total += IMAGE_TOKENS
                elif isinstance(part.get("text"), str):
                    total += estimate_text(part["text"])
                else:
                    total += estimate_text(json.dumps(part, ensure_ascii=False))
            elif isinstance(part, str):
                total += estimate_text(part)
        return total
    if content is None:
        return 0
    return estimate_text(json.dumps(content, ensure_ascii=False))


def estimate_input(call: Call) -> int:
    """The input tokens ``call`` will cost, estimated locally (no network call)."""
    total = 3
    for message in call.messages:
        total += MESSAGE_OVERHEAD
        total += _content_tokens(message.get("content"))
        for key in ("tool_calls", "function_call"):
            if message.get(key):
                total += estimate_text(json.dumps(message[key], ensure_ascii=False))
    for key in ("tools", "functions", "response_format"):
        if call.params.get(key):
            total += estimate_text(json.dumps(call.params[key], ensure_ascii=False))
    return total


def estimate_framing(call: Call) -> int:
    """The part of `estimate_input` that is framing, not text: 3 for the reply's priming
    and `MESSAGE_OVERHEAD` a message. A provider frames a chat message with a fixed count
    too (OpenAI: the same 7 for one message), so the learned ratio is of the rest."""
    return 3 + MESSAGE_OVERHEAD * len(call.messages)


def output_reservation(call: Call, learned: int | None, provider_max: int | None = None
                       ) -> int:
    """The request's own output limit, else the provider's, else the learned percentile
    (never below `OUTPUT_FLOOR`)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = call.params.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if provider_max:
        return provider_max
    return max(OUTPUT_FLOOR, learned or 0)


class Learned:
    """The lengths of a provider's recent reported answers, by model: the output
    reservation of a request that sets no limit of its own (SPEC L12). Kept by each
    relay, shared provider or not (a relay's own answers are sample enough)."""

    def __init__(self) -> None:
        self._seen: dict[str, collections.deque[int]] = {}

    def learn(self, model: str, output_tokens: int) -> None:
        """A reported answer's length, for the output reservation of the next ones."""
        seen = self._seen.setdefault(model, collections.deque(maxlen=LEARNED_SAMPLES))
        seen.append(output_tokens)

    def output(self, model: str) -> int | None:
        """The 90th percentile of the model's last answers (None: fewer than 3)."""
        seen = self._seen.get(model)
        if not seen or len(seen) < 3:
            return None
        ordered = sorted(seen)
        return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


# --- the prompt's script ------------------------------------------------------------------

SCRIPTS: Final = ("latin", "code", "json", "han", "kana", "hangul", "other", "image")
"""What `script_of` answers: Latin-script prose; source code; JSON; Chinese (Han without
kana); Japanese (kana among the Han); Korean (Hangul); any other script; a prompt with an
image part (its flat `IMAGE_TOKENS` is least like text, so it learns apart)."""

_SAMPLE = 1024              # characters a window of a long text's sample
_WINDOWS = 8                # windows, evenly spread, when a text is longer than all of them
_HANGUL = r"\u1100-\u11ff\u3130-\u318f\uac00-\ud7af"
_KANA = r"\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f"
_HAN = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_LATIN = r"A-Za-z\u00c0-\u024f"
_RUNS = {  # characters of a class, counted by runs (a regular expression's matches cost)
    "hangul": re.compile(f"[{_HANGUL}]+"),
    "kana": re.compile(f"[{_KANA}]+"),
    "han": re.compile(f"[{_HAN}]+"),
    "latin": re.compile(f"[{_LATIN}]+"),
    "other": re.compile(f"[^\\W\\d_{_LATIN}{_HANGUL}{_KANA}{_HAN}]+"),  # other letters
    "digit": re.compile(r"[0-9]+"),
    "punct": re.compile(r"[!-/:-@\[-`{-~]+"),
    "jsonish": re.compile(r'[{}\[\]:,"]+'),
    "codeish": re.compile(r"[_(){}=;<>\[\]]+"),
}


def _tally(text: str, into: dict[str, float]) -> None:
    """Add ``text``'s character classes to ``into``: all of a short text, else
    `_WINDOWS` windows of `_SAMPLE` characters spread over it, scaled to its length (a
    bounded cost whatever the length)."""
    if len(text) <= _SAMPLE * _WINDOWS:
        sample, scale = text, 1.0
    else:
        step = (len(text) - _SAMPLE) // (_WINDOWS - 1)
        sample = "\n".join(text[i * step:i * step + _SAMPLE] for i in range(_WINDOWS))
        scale = len(text) / len(sample)
    for name, pattern in _RUNS.items():
        into[name] = into.get(name, 0.0) + sum(map(len, pattern.findall(sample))) * scale
    into["quote"] = into.get("quote", 0.0) + sample.count('"') * scale
    into["indent"] = into.get("indent", 0.0) + (sample.count("\n ") + sample.count("\n\t")
                                                ) * scale


def _script_of_tally(counts: dict[str, float]) -> str:
    """The script whose characters weigh most in relay's estimate: a Han, kana or Hangul
    character a token, another script's letter a quarter, a Latin letter a fifth, a digit
    a third, a punctuation mark one. Text in Latin letters is JSON when its punctuation is
    mostly JSON's and a third of its characters, code when brackets, ``=``, ``_`` and
    indented lines are frequent among its letters, prose otherwise."""
    get = counts.get
    hangul, kana, han, latin = get("hangul", 0.0), get("kana", 0.0), get("han", 0.0), \
        get("latin", 0.0)
    other = get("other", 0.0)
    punct = get("punct", 0.0)
    japanese = kana > 0.1 * (kana + han)
    weights = {"hangul": hangul, "kana": kana + han if japanese else 0.0,
               "han": 0.0 if japanese else han, "other": other / 4,
               "latin": latin / 5 + get("digit", 0.0) / 3 + punct}
    script = max(weights, key=lambda name: weights[name])
    if script != "latin" or not weights["latin"]:
        return script if weights[script] else "latin"
    if punct >= 0.2 * (punct + latin + get("digit", 0.0)) and get("jsonish", 0.0) >= 0.7 * \
            punct and get("quote", 0.0) >= 0.3 * punct:
        return "json"
    if get("codeish", 0.0) + 2 * get("indent", 0.0) >= 0.06 * max(latin, 1.0):
        return "code"
    return "latin"


def _texts(call: Call) -> tuple[list[str], bool]:
    """The texts of ``call``'s prompt, and whether it has an image part."""
    texts: list[str] = []
    image = False
    for message in call.messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict):
                    if part.get("type") in ("image_url", "image", "input_image"):
                        image = True
                    elif isinstance(part.get("text"), str):
                        texts.append(part["text"])
        for key in ("tool_calls", "function_call"):
            if message.get(key):
                texts.append(json.dumps(message[key], ensure_ascii=False))
    for key in ("tools", "functions", "response_format"):
        if call.params.get(key):
            texts.append(json.dumps(call.params[key], ensure_ascii=False))
    return texts, image


def script_of(prompt: str | Call) -> str:
    """Which of `SCRIPTS` dominates ``prompt`` (a text, or a call's messages, tool
    definitions and tool calls) by weight in relay's estimate; ``"image"`` for a call with
    an image part. Linear in the number of texts, at most 8 KiB read of each."""
    if isinstance(prompt, str):
        texts, image = [prompt], False
    else:
        texts, image = _texts(prompt)
    if image:
        return "image"
    counts: dict[str, float] = {}
    for text in texts:
        if text:
            _tally(text, counts)
    return _script_of_tally(counts)


# --- the learned ratio --------------------------------------------------------------------

RATIO_WINDOW = 200          # answers kept a (model, script)
RATIO_PRIOR = 4             # pseudo-answers at ratio 1.0 among them (relay's estimate as is)
RATIO_TRIM = 0.25           # of the kept ratios (and the prior's), cut off at each end
RATIO_KEYS = 256            # (model, script) pairs kept, the least recently used dropped
RATIO_BOUNDS = (0.05, 20.0)  # an answer's ratio outside them teaches nothing
# The least text (beyond the framing) an answer must carry to teach a ratio: "hi" counted
# 3 where relay said 1 is framing or rounding (believed, a 5,000-word prompt was "too large").
RATIO_MIN_TEXT = 32
RATIO_MIN_TEXT_CJK = 8  # CJK: 0.5 to 2 tokens a character where relay says 1; a few say it
_CJK = frozenset({"han", "kana", "hangul"})
RATIO_SURE = 20             # answers before `least` trusts their lowest ratio
RATIO_UNSURE = 0.05  # until then, more reserved on a ratio above 1.0 (`InputRatio.reserve`)
LEAST_RATIO: Final = {"latin": 0.4, "code": 0.4, "json": 0.5, "han": 0.5, "kana": 0.5,
                      "hangul": 0.5, "other": 0.3, "image": 0.05}
"""The fewest tokens a provider may count of a script for each token of relay's estimate,
before its own answers say (`InputRatio.least`): below every prompt measured with three
tokenizers (docs/tokens.md; the lowest, 0.42, a code slice with a line of 80 dashes, which
the estimate counts a token each), with room for one not measured."""


class _Ratios:
    """One (model, script)'s recent ratios (as logarithms) and their learned center."""

    __slots__ = ("logs", "ratio", "seen")

    def __init__(self) -> None:
        self.logs: collections.deque[float] = collections.deque(maxlen=RATIO_WINDOW)
        self.ratio = 1.0
        self.seen = 0

    def add(self, log: float) -> None:
        self.logs.append(log)
        self.seen += 1
        ordered = sorted(self.logs)
        # The prior brakes a ratio below 1.0 only: answers whose median says relay counts
        # too few are believed at once (under-counting sends requests into 429s).
        if ordered[(len(ordered) - 1) // 2] <= 0.0:  # (the lower middle: two answers
            # that disagree are not yet a majority saying relay counts too few)
            ordered = sorted([*ordered, *([0.0] * RATIO_PRIOR)])
        cut = int(RATIO_TRIM * len(ordered))
        kept = ordered[cut:len(ordered) - cut]
        self.ratio = math.exp(math.fsum(kept) / len(kept))

    def low(self) -> float:
        """The lowest of the kept ratios."""
        return math.exp(min(self.logs))


class InputRatio:
    """The provider's reported prompt tokens over relay's estimate, learned per (model,
    script) from whole answers (SPEC L12): ``adjust`` turns the next estimate into the
    provider's likely count.

    Robust: the ratio is the trimmed mean (a quarter cut at each end) of the logarithms of
    the last `RATIO_WINDOW` answers' ratios and of `RATIO_PRIOR` pseudo-answers at 1.0 (the
    estimate as it is), so a single odd answer (an image, a provider's hidden system
    prompt) is cut, and the first answers that say relay over-counts move it gradually:
    one moves nothing, then each moves it further (4 answers at 0.72 give 0.85, 10 give
    0.75). Answers whose median ratio is above 1.0 (relay under-counts: its requests would
    meet 429s) are believed at once, without the prior: one answer at 2.0 gives 2.0.

    The ratio is of the text: ``fixed`` (`estimate_framing`, the message framing, which a
    provider counts alike) is taken off relay's estimate and the reported count before the
    ratio, and added back as it is (a 20-token prompt is mostly framing; its ratio says
    little of a 6,000-token one's). Bounded: at most `RATIO_KEYS` (model, script) pairs,
    each at most `RATIO_WINDOW` floats."""

    def __init__(self, keys: int = RATIO_KEYS) -> None:
        self._keys = keys
        self._ratios: collections.OrderedDict[tuple[str, str], _Ratios] = \
            collections.OrderedDict()

    def ratio(self, model: str, script: str) -> float:
        """The learned ratio (1.0 before any answer)."""
        found = self._ratios.get((model, script))
        return found.ratio if found is not None else 1.0

    def adjust(self, model: str, script: str, estimate: int, fixed: int = 0, *,
               margin: float = 0.0) -> int:
        """``estimate`` (relay's, `estimate_input`; ``fixed`` of it framing, counted as it
        is) as the provider would likely count it (``margin``: that share more); >= 1."""
        fixed = min(max(0, fixed), estimate)
        ratio = self.ratio(model, script) * (1.0 + margin)
        return max(1, fixed + math.ceil((estimate - fixed) * ratio - 1e-9))

    def reserve(self, model: str, script: str, estimate: int, fixed: int = 0) -> int:
        """`adjust`'s count, `RATIO_UNSURE` more where the ratio is above 1.0 and rests on
        fewer than `RATIO_SURE` answers: short ones' digits pull it toward 1.0 (Korean
        greetings said 1.91 where long prompts counted 2.0; an under-count meets 429s)."""
        found = self._ratios.get((model, script))
        unsure = found is not None and found.ratio > 1.0 and len(found.logs) < RATIO_SURE
        return self.adjust(model, script, estimate, fixed,
                           margin=RATIO_UNSURE if unsure else 0.0)

    def least(self, model: str, script: str, estimate: int, fixed: int = 0) -> int:
        """The fewest tokens the provider may plausibly count for ``estimate``: once
        `RATIO_SURE` answers are kept, at their lowest ratio; before, at the script's
        `LEAST_RATIO` (or the learned ratio, if lower). For refusing a request that could
        never fit (``request_too_large``): where relay cannot tell, it sends."""
        found = self._ratios.get((model, script))
        if found is None or len(found.logs) < RATIO_SURE:
            low = min(LEAST_RATIO.get(script, LEAST_RATIO["other"]), self.ratio(model, script))
        else:
            low = min(found.low(), found.ratio)
        fixed = min(max(0, fixed), estimate)
        return max(1, fixed + math.floor((estimate - fixed) * low + 1e-9))

    def known(self, model: str, script: str) -> bool:
        """`RATIO_SURE` answers are kept: ``least`` rests on the provider's own counts."""
        found = self._ratios.get((model, script))
        return found is not None and len(found.logs) >= RATIO_SURE

    def learn(self, model: str, script: str, estimate: int, reported: int,
              fixed: int = 0) -> bool:
        """A whole answer's reported prompt tokens against relay's estimate of its prompt
        (before `adjust`; ``fixed`` of both the framing). A count of 0, less text beyond
        the framing than `RATIO_MIN_TEXT` (`RATIO_MIN_TEXT_CJK` for Chinese, Japanese and
        Korean), or a ratio outside `RATIO_BOUNDS` teaches nothing (False)."""
        fixed = max(0, fixed)
        least = RATIO_MIN_TEXT_CJK if script in _CJK else RATIO_MIN_TEXT
        if estimate - fixed < least or reported <= fixed:
            return False  # (a few words of text: their ratio is noise, not a tokenizer's)
        ratio = (reported - fixed) / (estimate - fixed)
        if not RATIO_BOUNDS[0] <= ratio <= RATIO_BOUNDS[1]:
            return False
        key = (model, script)
        found = self._ratios.get(key)
        if found is None:
            found = self._ratios[key] = _Ratios()
            while len(self._ratios) > self._keys:
                self._ratios.popitem(last=False)
        else:
            self._ratios.move_to_end(key)
        found.add(math.log(ratio))
        return True

    def status(self, model: str) -> dict[str, dict[str, float | int]]:
        """The model's learned ratios by script, for the status JSON:
        ``{"hangul": {"ratio": 0.72, "samples": 37}}`` (samples: answers learned from)."""
        return {script: {"ratio": round(found.ratio, 3), "samples": found.seen}
                for (model_, script), found in self._ratios.items() if model_ == model}

    def __len__(self) -> int:
        return len(self._ratios)

"""Fake ``claude``, ``codex`` and ``gemini`` programs for relay's assembled tests.

They print what the real tools print (shapes and strings from notes/cli-tools.md) and
behave as they do on signals and on their interrupt messages. Stdlib only; each runs as
``tests/fakes/fake_cli/<tool>``. What a run does is chosen by the model name (``--model`` /
``-m`` / the per-thread model), so one relay config drives every path:

  ok (and default)  a short answer in four deltas
  echo              answers "system=<system prompt> | prompt=<prompt>"
  history           answers with every user prompt of this conversation (warm processes
                    keep a conversation until /clear, thread/start or session/new)
  slow              100 deltas, 0.05 s apart; honours SIGINT and the interrupt message
  stubborn          like slow, but ignores SIGINT, SIGTERM and the interrupt message
  die               one delta, then exits 3 with a message on stderr
  huge              an answer of 33 MiB in 1 MiB deltas
  linger            (codex exec) exits 5 s after its final event, with status 0
  emptyexit         (codex exec) completes with no answer, then exits 1 with words on
                    stderr
  flaky             the first run of a test dies after three deltas; later ones answer
                    the long text of ``longusage``
  badreply          (warm codex, gemini) thread/start, session/new reply without an id
  …                 tool-specific failures (see each tool's SCENARIOS)

Launchers: ``codex`` spawns a "native" child that does the work (as the npm launcher does
on Node 20); ``gemini`` relaunches itself as a child that does the work (its parent
ignores SIGINT/SIGTERM) unless GEMINI_CLI_NO_RELAUNCH=true. So a relay that signals or
kills only the pid it started leaves a process behind — which the tests look for.

FAKE_CLI_LOG names a file that gets one JSON line per process start and per turn.
FAKE_CLI_STDIN_STALL_S makes a warm tool stop reading its stdin for that long in the
middle of a line over 16 KiB (see `read_stdin_lines`); a stdin line that is not JSON is
ignored and never answered, as by the real tools.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SLOW_N, SLOW_DELAY = 100, 0.05
LONG_USAGE = ("Here is how a usage limit works in most APIs. " * 20 +
              "When you hit the usage limit, requests are refused until the window resets.")

_out_lock = threading.Lock()


def emit(obj: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
        sys.stdout.flush()


def log(**fields: Any) -> None:
    path = os.environ.get("FAKE_CLI_LOG")
    if path:
        fields.setdefault("pid", os.getpid())
        fields.setdefault("pgid", os.getpgid(0))
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(fields) + "\n")


def login_scenario(variable: str) -> str | None:
    """The scenario a logged-in configuration forces (SPEC L13: one login's behaviour):
    the text of ``$VARIABLE/scenario``, if that file exists. Every turn logs the login."""
    home = os.environ.get(variable)
    if not home:
        return None
    try:
        with open(os.path.join(home, "scenario"), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def opt(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
    return None


def pieces(scenario: str, tool: str, prompt: str, system: str | None,
           history: list[str]) -> list[str]:
    if scenario == "echo":
        return [f"system={system} | ", f"prompt={prompt}"]
    if scenario == "history":
        return ["history: ", " || ".join(history)]
    if scenario in ("slow", "stubborn"):
        return [f"tick{i} " for i in range(SLOW_N)]
    if scenario == "huge":   # 33 MiB: over relay's 32 MiB bound for one answer
        return ["y" * (1 << 20)] * 33
    if scenario in ("longusage", "flaky"):
        words = LONG_USAGE.split(" ")
        return [w + " " for w in words[:-1]] + [words[-1]]
    return ["Hello ", "from the fake ", f"{tool} ", f"(FAKE-{tool.upper()}-OK)."]


def first_flaky() -> bool:
    """True for the first "flaky" turn of a test (a marker beside FAKE_CLI_LOG)."""
    path = os.environ.get("FAKE_CLI_LOG")
    if not path:
        return False
    try:
        with open(path + ".flaky", "x"):
            return True
    except FileExistsError:
        return False


class Stopper:
    """Interrupt requests (SIGINT or a protocol message) for the turn in progress."""

    def __init__(self, scenario: str) -> None:
        self.stubborn = scenario == "stubborn"
        self.event = threading.Event()

    def request(self) -> None:
        if not self.stubborn:
            self.event.set()

    def stream(self, parts: list[str], send: Any, scenario: str) -> bool:
        """Send the parts (slowly for slow scenarios); False if interrupted."""
        for i, part in enumerate(parts):
            if self.event.is_set():
                return False
            if (scenario == "die" and i == 1) or (scenario == "flaky" and i == 3
                                                  and first_flaky()):
                sys.stderr.write("fake tool: crashed mid-answer (FAKE-CRASH)\n")
                sys.stderr.flush()
                os._exit(3)
            if i and scenario in ("slow", "stubborn") and self.event.wait(SLOW_DELAY):
                return False
            send(part)
        return not self.event.is_set()


STALL_AT = 16 * 1024   # FAKE_CLI_STDIN_STALL_S: a line longer than this stalls stdin


def read_stdin_lines() -> Any:
    """The lines of a warm tool's stdin, read raw. With ``FAKE_CLI_STDIN_STALL_S`` set,
    a line longer than `STALL_AT` makes the tool stop reading for that long (once per
    line, logged as ``stdin-stall``), as a busy tool does: whoever writes the rest of
    that line blocks once the pipe's buffer (64 KiB) is full."""
    stall = float(os.environ.get("FAKE_CLI_STDIN_STALL_S") or 0)
    buf = b""
    stalled = False
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            if buf:
                yield buf.decode("utf-8", "replace")
            return
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            stalled = False
            yield line.decode("utf-8", "replace") + "\n"
        if stall and not stalled and len(buf) > STALL_AT:
            stalled = True
            log(event="stdin-stall", pending=len(buf))
            time.sleep(stall)


def parse_line(line: str) -> dict[str, Any] | None:
    """One stdin line as JSON; a line that is not (half a message glued onto the next)
    is reported on stderr and ignored, as the real tools do — nobody answers it."""
    try:
        msg = json.loads(line)
    except ValueError:
        sys.stderr.write(f"fake tool: ignored a line that is not JSON ({len(line)} "
                         "characters)\n")
        sys.stderr.flush()
        log(event="bad-line", size=len(line))
        return None
    return msg if isinstance(msg, dict) else None


def stdin_lines() -> queue.Queue[str | None]:
    q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in read_stdin_lines():
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


# --- claude -----------------------------------------------------------------------------

CLAUDE_SUCCESS_NOTICES = {  # success-marked results that are really failures (SPEC E2)
    "success-authexpired": "Failed to authenticate: OAuth session expired and could not be "
                           "refreshed",
    "success-notloggedin": "Not logged in · Please run /login",
    "success-invalidkey": "Invalid API key · Fix external API key",
    "success-limit": "Claude AI usage limit reached|1753441200",
    "success-hitlimit": "You've hit your limit · resets 3:30am (Asia/Calcutta)",
    "success-reachedlimit": "You've reached your usage limit. Try again after your limit "
                            "resets.",
}


class Claude:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.scenario = login_scenario("CLAUDE_CONFIG_DIR") or opt(argv, "--model") or "ok"
        self.session = opt(argv, "--input-format") == "stream-json"
        path = opt(argv, "--system-prompt-file")
        self.system = read(path) if path else opt(
            argv, "--system-prompt")
        self.sid = str(uuid.uuid4())
        self.history: list[str] = []

    def base(self, **fields: Any) -> dict[str, Any]:
        return {**fields, "session_id": self.sid, "uuid": str(uuid.uuid4())}

    def result(self, text: str | None, *, is_error: bool = False, subtype: str = "success",
               **extra: Any) -> dict[str, Any]:
        fields = dict(type="result", subtype=subtype, is_error=is_error, result=text,
                      stop_reason="end_turn", terminal_reason="completed",
                      api_error_status=None, duration_ms=5, num_turns=1, total_cost_usd=0.0,
                      usage={"input_tokens": 7, "output_tokens": 4,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0})
        fields.update(extra)
        return self.base(**fields)

    def turn(self, prompt: str, stopper: Stopper) -> int:
        """One turn; returns the exit code a one-shot run would end with."""
        self.history.append(prompt)
        log(tool="claude", event="turn", prompt=prompt, system=self.system,
            scenario=self.scenario, login=os.environ.get("CLAUDE_CONFIG_DIR"))
        emit(self.base(type="system", subtype="init", cwd=os.getcwd(), tools=[],
                       model=self.scenario, claude_code_version="2.1.332-fake"))
        emit(self.base(type="system", subtype="status", status="requesting"))
        s = self.scenario
        if s == "notloggedin":
            emit(self.base(type="assistant", message={"model": "<synthetic>", "content": [
                {"type": "text", "text": "Not logged in · Please run /login"}]},
                error="authentication_failed", is_api_error_message=True,
                parent_tool_use_id=None))
            emit(self.result("Not logged in · Please run /login", is_error=True,
                             terminal_reason="api_error"))
            return 1
        if s in CLAUDE_SUCCESS_NOTICES:
            emit(self.result(CLAUDE_SUCCESS_NOTICES[s]))
            return 0
        if s == "success-grace":
            emit(self.result("You are out of extra usage", error_type="grace_daily_limit_reached"))
            return 0
        if s == "api401":
            emit(self.result("Invalid API key · Fix external API key", is_error=True,
                             terminal_reason="api_error", api_error_status=401,
                             api_error_type="authentication_error"))
            return 1
        if s == "api429":
            emit(self.result("API Error: Request rejected (429) · FAKE-QUOTA: You have "
                             "exceeded your usage quota for this billing period.",
                             is_error=True, terminal_reason="api_error",
                             api_error_status=429, api_error_type="rate_limit_error"))
            return 1
        if s == "iserror":
            emit(self.result("API Error: 500 {\"type\":\"error\",\"error\":{\"type\":"
                             "\"api_error\",\"message\":\"FAKE-500\"}}", is_error=True,
                             terminal_reason="api_error", api_error_status=500))
            return 1
        parts = ["ok"] if s == "salvage" else pieces(s, "claude", prompt, self.system,
                                                     self.history)

        def send(part: str) -> None:
            emit(self.base(type="stream_event", parent_tool_use_id=None, event={
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": part}}))

        if not stopper.stream(parts, send, s):
            emit(self.base(type="assistant", message={"content": []}, aborted=True,
                           parent_tool_use_id=None))
            emit(self.base(type="user", message={"role": "user", "content": [
                {"type": "text", "text": "[Request interrupted by user]"}]}))
            emit(self.result(None, is_error=True, subtype="error_during_execution",
                             terminal_reason="aborted_streaming", errors=[
                                 "[ede_diagnostic] result_type=user last_content_type=n/a "
                                 "stop_reason=null"]))
            return 0   # claude exits 0 on SIGINT: success is never the exit code
        text = "".join(parts)
        emit(self.base(type="assistant", parent_tool_use_id=None,
                       message={"role": "assistant", "content": [{"type": "text",
                                                                  "text": text}]}))
        if s == "salvage":
            emit(self.result(text, errors=["[ede_diagnostic] FAKE-SALVAGE: an error after "
                                           "the answer"]))
            sys.stderr.write("Error: FAKE-SALVAGE tool failure after the result\n")
            return 1
        emit(self.result(text))
        return 0

    def run(self) -> int:
        log(tool="claude", event="start", argv=self.argv, session=self.session)
        if not self.session:
            prompt = sys.stdin.read()
            stopper = Stopper(self.scenario)
            signal.signal(signal.SIGINT, lambda *_: stopper.request())
            if stopper.stubborn:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return self.turn(prompt, stopper)
        turns: queue.Queue[dict[str, Any] | None] = queue.Queue()
        current: dict[str, Stopper] = {}

        def dispatch() -> None:   # control requests act at once; turns wait their turn
            for line in read_stdin_lines():
                msg = parse_line(line)
                if msg is None:
                    continue
                if msg.get("type") == "control_request":
                    stopper = current.get("stopper")
                    if stopper is not None and stopper.stubborn:
                        continue   # never confirmed
                    emit({"type": "control_response", "response": {
                        "subtype": "success", "request_id": msg["request_id"],
                        "response": {"still_queued": []}}})
                    if stopper is not None:
                        stopper.request()
                elif msg.get("type") == "user":
                    turns.put(msg)
            turns.put(None)

        threading.Thread(target=dispatch, daemon=True).start()
        while True:
            msg = turns.get()
            if msg is None:
                return 1   # stdin closed: claude exits 1
            text = "".join(p.get("text", "") for p in msg["message"]["content"])
            if text.strip() == "/clear":
                self.history.clear()
                emit({"type": "conversation_reset", "session_id": self.sid})
                emit(self.base(type="system", subtype="init", cwd=os.getcwd()))
                emit(self.result(""))
                continue
            current["stopper"] = Stopper(self.scenario)
            self.turn(text, current["stopper"])
            current.pop("stopper")


# --- codex ------------------------------------------------------------------------------

CODEX_FAILURES = {
    "quota": "Quota exceeded. Check your plan and billing details.",
    "auth401": "unexpected status 401 Unauthorized: Incorrect API key provided: sk-fake. "
               "You can find your API key at https://platform.openai.com/account/api-keys., "
               "url: http://127.0.0.1:18401/v1/responses",
    "missingkey": "Missing environment variable: `FAKE_OPENAI_KEY`.",
}
CODEX_INFO = {"quota": "usageLimitExceeded", "auth401": "unauthorized", "missingkey": "other"}


class Codex:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.app_server = "app-server" in argv
        self.model = opt(argv, "-m", "--model") or "ok"
        self.threads: dict[str, list[str]] = {}

    def run(self) -> int:
        log(tool="codex", event="start", argv=self.argv, role="native")
        sys.stderr.write("WARNING: proceeding, even though we could not create PATH aliases\n")
        return self.app() if self.app_server else self.exec()

    def exec(self) -> int:
        sys.stderr.write("Reading additional input from stdin...\n")
        prompt = sys.stdin.read()
        system = None
        for i, arg in enumerate(self.argv):
            if arg == "-c" and self.argv[i + 1].startswith("model_instructions_file="):
                path = json.loads(self.argv[i + 1].partition("=")[2])
                system = read(path)
        s = self.model
        log(tool="codex", event="turn", prompt=prompt, system=system, scenario=s)
        stopper = Stopper(s)
        interrupted = threading.Event()

        def on_sigint(*_: Any) -> None:
            if not stopper.stubborn:
                interrupted.set()
                stopper.request()

        signal.signal(signal.SIGINT, on_sigint)
        if stopper.stubborn:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        emit({"type": "thread.started", "thread_id": str(uuid.uuid4())})
        emit({"type": "item.completed", "item": {"id": "item_0", "type": "error", "message":
              f"Model metadata for `{s}` not found. Defaulting to fallback metadata; this "
              "can degrade performance and cause issues."}})
        emit({"type": "turn.started"})
        if s in CODEX_FAILURES:
            emit({"type": "error", "message": CODEX_FAILURES[s]})
            emit({"type": "turn.failed", "error": {"message": CODEX_FAILURES[s]}})
            return 1
        if s == "reconnect":
            emit({"type": "error", "message": "Reconnecting... 1/5 (unexpected status 401 "
                  "Unauthorized: FAKE-AUTH, url: http://127.0.0.1:18401/v1/responses)"})
            stopper.event.wait(30)
            return 1
        if s == "turnfailed":
            emit({"type": "item.completed", "item": {"id": "item_1", "type": "agent_message",
                                                     "text": "a partial answer"}})
            emit({"type": "turn.failed", "error": {"message": "stream disconnected before "
                                                   "completion: FAKE-CUT"}})
            return 1
        parts = ["ok"] if s == "salvage" else pieces(s, "codex", prompt, system, [prompt])
        collected: list[str] = []
        if not stopper.stream(parts, collected.append, s):   # exec sends no deltas
            return 1   # SIGINT: exit 1 with no turn.failed line
        if s != "emptyexit":
            emit({"type": "item.completed", "item": {"id": "item_1",
                                                     "type": "agent_message",
                                                     "text": "".join(collected)}})
        if s == "salvage":
            emit({"type": "error", "message": "FAKE-SALVAGE: failed to record the rollout"})
        emit({"type": "turn.completed", "usage": {"input_tokens": 10, "cached_input_tokens": 0,
                                                  "output_tokens": 4,
                                                  "reasoning_output_tokens": 0}})
        if s == "linger":   # still busy after its final event (flushing, say)
            time.sleep(5)
        if s == "emptyexit":
            sys.stderr.write("Error: FAKE-EMPTY-EXIT: the rollout could not be written\n")
            return 1
        return 1 if s == "salvage" else 0

    def app(self) -> int:
        lines = stdin_lines()
        current: dict[str, Any] = {}

        def reply(msg: dict[str, Any], result: Any) -> None:
            emit({"id": msg["id"], "result": result})

        while True:
            line = lines.get()
            if line is None:
                return 0
            msg = parse_line(line)
            if msg is None:
                continue
            method, params = msg.get("method"), msg.get("params") or {}
            if method == "initialize":
                reply(msg, {"userAgent": "codex-fake/0.171.0"})
            elif method == "thread/start":
                tid = str(uuid.uuid4())
                self.threads[tid] = []
                current["model"] = params.get("model") or self.model
                current["system"] = params.get("baseInstructions")
                if current["model"] == "badreply":   # a reply without the thread's id
                    reply(msg, {"thread": {"status": "idle"}})
                    continue
                reply(msg, {"thread": {"id": tid}})
                emit({"method": "thread/started", "params": {"thread": {"id": tid}}})
            elif method == "turn/start":
                tid = params["threadId"]
                prompt = "".join(p.get("text", "") for p in params["input"])
                self.threads[tid].append(prompt)
                turn_id = str(uuid.uuid4())
                reply(msg, {"turn": {"id": turn_id, "status": "inProgress", "items": []}})
                stopper = Stopper(current["model"])
                current["stopper"], current["turn"] = stopper, turn_id
                t = threading.Thread(target=self.app_turn, args=(
                    tid, turn_id, prompt, current["model"], current["system"], stopper),
                    daemon=True)
                current["thread"] = t
                t.start()
            elif method == "turn/interrupt":
                stopper = current.get("stopper")
                if stopper is not None and not stopper.stubborn:
                    reply(msg, {})
                    stopper.request()
            elif "id" in msg:
                emit({"id": msg["id"], "error": {"code": -32601, "message": "unknown"}})

    def app_turn(self, tid: str, turn_id: str, prompt: str, s: str, system: str | None,
                 stopper: Stopper) -> None:
        log(tool="codex", event="turn", prompt=prompt, system=system, scenario=s,
            history=self.threads[tid])

        def note(method: str, **params: Any) -> None:
            emit({"method": method, "params": {"threadId": tid, "turnId": turn_id, **params}})

        def done(status: str, error: dict[str, Any] | None = None,
                 items: list[Any] | None = None) -> None:
            emit({"method": "turn/completed", "params": {"threadId": tid, "turn": {
                "id": turn_id, "items": items or [], "status": status, "error": error}}})

        note("turn/started")
        if s in CODEX_FAILURES:
            error = {"message": CODEX_FAILURES[s], "codexErrorInfo": CODEX_INFO[s]}
            note("error", error=error, willRetry=False)
            done("failed", error)
            return
        parts = ["ok"] if s == "salvage" else pieces(s, "codex", prompt, system,
                                                     self.threads[tid])
        if not stopper.stream(parts, lambda p: note("item/agentMessage/delta",
                                                    itemId="msg_1", delta=p), s):
            done("interrupted")
            return
        text = "".join(parts)
        item = {"type": "agentMessage", "id": "msg_1", "text": text}
        note("item/completed", item=item)
        note("thread/tokenUsage/updated", tokenUsage={"last": {
            "inputTokens": 10, "outputTokens": 4, "totalTokens": 14}})
        if s == "salvage":
            note("error", error={"message": "FAKE-SALVAGE: failed to record the rollout"},
                 willRetry=False)
        done("completed", items=[item])


def codex_launcher(argv: list[str]) -> int:
    """The npm launcher on Node 20: spawn the native binary, forward SIGINT/SIGTERM."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "codex-native",
                              *argv])
    log(tool="codex", event="start", role="launcher", child=child.pid)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    return child.wait()


# --- gemini -----------------------------------------------------------------------------

GEMINI_NOT_LOGGED_IN = ("Please set an Auth method in your ~/.gemini/settings.json or specify "
                        "one of the following environment variables before running: "
                        "GEMINI_API_KEY, GOOGLE_GENAI_USE_VERTEXAI, GOOGLE_GENAI_USE_GCA")
GEMINI_QUOTA = ("[API Error: FAKE-QUOTA: You have exceeded your usage quota for this billing "
                "period.]\nPlease wait and try again later. To increase your limits, request "
                "a quota increase through AI Studio, or switch to another /auth method")
GEMINI_401 = ('{"error":{"code":401,"message":"API key not valid. Please pass a valid API '
              'key.","status":"UNAUTHENTICATED"}}')


class Gemini:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.acp = "--acp" in argv
        self.model = opt(argv, "-m", "--model") or "ok"
        path = os.environ.get("GEMINI_SYSTEM_MD")
        self.system = read(path) if path else None
        self.sessions: dict[str, list[str]] = {}

    def ts(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())

    def run(self) -> int:
        log(tool="gemini", event="start", argv=self.argv, role="worker",
            settings=os.environ.get("GEMINI_CLI_SYSTEM_SETTINGS_PATH"))
        return self.server() if self.acp else self.oneshot()

    def oneshot(self) -> int:
        prompt = sys.stdin.read()
        s = self.model
        log(tool="gemini", event="turn", prompt=prompt, system=self.system, scenario=s)
        stopper = Stopper(s)

        def on_signal(*_: Any) -> None:
            if not stopper.stubborn:
                os._exit(0)   # a signal: exit 0 with no result line

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        if s == "notloggedin":
            sys.stderr.write(GEMINI_NOT_LOGGED_IN + "\n")
            return 41
        sid = str(uuid.uuid4())
        emit({"type": "init", "timestamp": self.ts(), "session_id": sid, "model": s})
        emit({"type": "message", "timestamp": self.ts(), "role": "user", "content": prompt})
        stats = {"total_tokens": 14, "input_tokens": 10, "output_tokens": 4}
        if s in ("auth401", "quota"):
            message = GEMINI_401 if s == "auth401" else GEMINI_QUOTA
            emit({"type": "result", "timestamp": self.ts(), "status": "error",
                  "error": {"type": "unknown", "message": message}, "stats": stats})
            return 145 if s == "auth401" else 173
        parts = ["ok"] if s == "salvage" else pieces(s, "gemini", prompt, self.system,
                                                     [prompt])
        if s == "resulterror":
            parts = ["a partial answer"]
        stopper.stream(parts, lambda p: emit({
            "type": "message", "timestamp": self.ts(), "role": "assistant", "content": p,
            "delta": True}), s)
        if s == "resulterror":
            emit({"type": "result", "timestamp": self.ts(), "status": "error",
                  "error": {"type": "unknown", "message": "[API Error: FAKE-500]"},
                  "stats": stats})
            return 244
        if s == "salvage":
            emit({"type": "error", "timestamp": self.ts(), "severity": "error",
                  "message": "FAKE-SALVAGE: loop detection failed after the answer"})
        emit({"type": "result", "timestamp": self.ts(), "status": "success", "stats": stats})
        return 1 if s == "salvage" else 0

    def server(self) -> int:
        lines = stdin_lines()
        current: dict[str, Any] = {}

        def reply(msg: dict[str, Any], result: Any) -> None:
            emit({"jsonrpc": "2.0", "id": msg["id"], "result": result})

        def fail(msg: dict[str, Any], code: int, message: str) -> None:
            emit({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": code,
                                                              "message": message}})

        while True:
            line = lines.get()
            if line is None:
                return 0
            msg = parse_line(line)
            if msg is None:
                continue
            method, params = msg.get("method"), msg.get("params") or {}
            if method == "initialize":
                reply(msg, {"protocolVersion": 1, "authMethods": [],
                            "agentInfo": {"name": "gemini-cli", "version": "0.61.0-fake"}})
            elif method == "session/new":
                if self.model == "notloggedin":
                    fail(msg, -32000, "Gemini API key is missing or not configured.")
                    continue
                sid = str(uuid.uuid4())
                self.sessions[sid] = []
                if self.model == "badreply":   # a reply without the session's id
                    reply(msg, {"modes": {"currentModeId": "plan"}})
                    continue
                reply(msg, {"sessionId": sid, "modes": {"currentModeId": "plan"}})
            elif method == "session/prompt":
                sid = params["sessionId"]
                prompt = "".join(p.get("text", "") for p in params["prompt"])
                self.sessions[sid].append(prompt)
                stopper = Stopper(self.model)
                current["stopper"] = stopper
                threading.Thread(target=self.acp_turn, args=(msg, sid, prompt, stopper),
                                 daemon=True).start()
            elif method == "session/cancel":
                stopper = current.get("stopper")
                if stopper is not None:
                    stopper.request()

    def acp_turn(self, msg: dict[str, Any], sid: str, prompt: str, stopper: Stopper) -> None:
        s = self.model
        log(tool="gemini", event="turn", prompt=prompt, system=self.system, scenario=s,
            history=self.sessions[sid])
        if s in ("auth401", "quota"):
            code = 401 if s == "auth401" else 429
            message = GEMINI_401 if s == "auth401" else "FAKE-QUOTA: You have exceeded your " \
                "usage quota for this billing period."
            emit({"jsonrpc": "2.0", "id": msg["id"], "error": {"code": code,
                                                              "message": message}})
            return
        parts = pieces(s, "gemini", prompt, self.system, self.sessions[sid])
        ok = stopper.stream(parts, lambda p: emit({
            "jsonrpc": "2.0", "method": "session/update", "params": {
                "sessionId": sid, "update": {"sessionUpdate": "agent_message_chunk",
                                             "content": {"type": "text", "text": p}}}}), s)
        result: dict[str, Any] = {"stopReason": "end_turn" if ok else "cancelled"}
        if ok:
            result["_meta"] = {"quota": {"token_count": {"input_tokens": 10,
                                                         "output_tokens": 4}}}
        emit({"jsonrpc": "2.0", "id": msg["id"], "result": result})


def gemini_launcher(argv: list[str]) -> int:
    """gemini relaunches itself as a child; the parent ignores SIGINT/SIGTERM/SIGHUP."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    env = {**os.environ, "GEMINI_CLI_NO_RELAUNCH": "true"}
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "gemini", *argv],
                             env=env, preexec_fn=lambda: signal.signal(
                                 signal.SIGINT, signal.SIG_DFL))
    log(tool="gemini", event="start", role="launcher", child=child.pid)
    return child.wait()


def main(tool: str, argv: list[str]) -> int:
    if tool == "claude":
        return Claude(argv).run()
    if tool == "codex":
        if os.environ.get("FAKE_CODEX_NO_CHILD") == "1":
            return Codex(argv).run()
        return codex_launcher(argv)
    if tool == "codex-native":
        return Codex(argv).run()
    if tool == "gemini":
        if os.environ.get("GEMINI_CLI_NO_RELAUNCH") != "true":
            return gemini_launcher(argv)
        return Gemini(argv).run()
    raise SystemExit(f"unknown fake tool {tool!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))

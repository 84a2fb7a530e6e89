"""Run the README's daemon and its marked examples, in the folder of a fresh clone.

``python readme_driver.py CLONE SERVE_COMMAND BLOCKS.json RESULTS.json`` — used by
tests/assembly/test_readme.py, usually inside a network namespace of its own (``unshare --net``):
it first brings that namespace's loopback up, so 127.0.0.1:8765 exists and is this run's
alone. Then it starts the first command's ``relay serve`` part as written, waits for its
``relay listening on`` line, runs each block (``{"kind": "sh"|"python", "text", ...}``)
as the README says to, stops the daemon with SIGTERM, and writes what happened as JSON.
Only the standard library: it runs under whatever Python starts it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
BLOCK_TIMEOUT_S = 90.0
READY_TIMEOUT_S = 30.0


def loopback_up() -> None:
    """``ip link set lo up``, without needing iproute2 (a new namespace's lo is down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, request)[:18])[1]
        if not flags & IFF_UP:
            fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def run_block(clone: Path, block: dict[str, Any]) -> dict[str, Any]:
    """A shell block runs as ``sh -e``; a Python block is saved under the name its first
    line gives (``# hello.py — run it with: COMMAND``) and COMMAND is run."""
    command = block["text"]
    if block["kind"] == "python":
        header = re.match(r"# (\S+) — run it with: (.+)", block["text"])
        if header is None:
            return {"rc": None, "out": "", "err": "no '# NAME — run it with: COMMAND' line"}
        (clone / header.group(1)).write_text(block["text"])
        command = header.group(2)
    started = time.monotonic()
    try:
        done = subprocess.run(["sh", "-ec", command], cwd=clone, capture_output=True,
                              text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        return {"rc": None, "out": str(exc.stdout or ""), "err": f"timed out: {exc}",
                "seconds": time.monotonic() - started}
    return {"rc": done.returncode, "out": done.stdout, "err": done.stderr,
            "seconds": round(time.monotonic() - started, 2)}


def main() -> int:
    clone, serve, blocks_file, results_file = sys.argv[1:5]
    if os.environ.get("README_OWN_NETNS") == "1":
        loopback_up()
    blocks = json.loads(Path(blocks_file).read_text())
    result: dict[str, Any] = {"blocks": []}
    daemon = subprocess.Popen(["sh", "-ec", f"exec {serve}"], cwd=clone, text=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    log: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert daemon.stderr is not None
        for line in daemon.stderr:
            log.append(line)
            if line.startswith("relay listening on "):
                ready.set()
        ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        if ready.wait(READY_TIMEOUT_S) and daemon.poll() is None:
            result["listening"] = next(x for x in log if x.startswith("relay listening"))
            for block in blocks:
                result["blocks"].append(run_block(Path(clone), block))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            result["serve_rc"] = daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            result["serve_rc"] = daemon.wait()
        reader.join(timeout=5)
        result["serve_log"] = "".join(log)
        Path(results_file).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's first ten minutes, as a new user lives them (issue 15).

A fresh clone of this repository (``git clone`` of its committed HEAD: commit before
running this), the install part of the README's first command, the first command's
``relay serve`` on the packaged default, then every example the README marks
``<!-- runnable -->`` (optionally ``expect="TEXT"``), run as written, from the clone's
folder, against that daemon. An example that is not marked must say why (it needs LM
Studio, Redis, a service manager or a vendor key): the text before it says "need".

What it proves: the committed tree has everything `pip install .` needs to build and
install relay; the installed ``relay`` console script starts on the packaged default at
127.0.0.1:8765; each marked example exits 0 and prints what its marker expects; the
daemon then drains on SIGTERM and exits 0.

What it does not prove: that the pinned dependencies resolve from PyPI. To be fast (and
not download the world each run) the clone's venv sees this test run's own installed
packages through a ``.pth`` file (a symlinked view of them, without relay itself), so pip
finds them installed and builds only relay; CI's own ``pip install -e '.[test]'`` is what
resolves the pins. ``python3`` is the interpreter running these tests (the view must
match its version).

The daemon and the examples run in a network namespace of their own (``unshare
--net``), so 127.0.0.1:8765 is theirs alone on a machine shared with other test runs;
without one (no privileges for it) the test runs them directly if 8765 is free, and
skips, saying why, if it is not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).parents[1] / "helpers" / "readme_driver.py"
MARK = re.compile(r'<!-- runnable(?: expect="([^"]*)")? -->\Z')
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)


def readme_blocks(text: str) -> list[dict[str, Any]]:
    """Every fenced block: its language, text, marker (None: not marked) and the prose
    between it and the block before it."""
    blocks: list[dict[str, Any]] = []
    last_end = 0
    for found in FENCE.finditer(text):
        before = text[last_end:found.start()]
        lines = before.rstrip("\n").splitlines()
        mark = MARK.match(lines[-1].strip()) if lines else None
        blocks.append({"kind": found.group(1), "text": found.group(2), "prose": before,
                       "runnable": mark is not None,
                       "expect": mark.group(1) if mark else None})
        last_end = found.end()
    return blocks


def test_every_example_is_marked_or_says_what_it_needs() -> None:
    """The rule the fresh-clone test relies on, checked on its own (fast): a shell or
    Python example is runnable on the packaged default, or says what it needs."""
    blocks = readme_blocks((ROOT / "README.md").read_text())
    first_two = blocks[:2]
    assert [b["kind"] for b in first_two] == ["sh", "sh"]
    assert first_two[0]["text"] == ("python3 -m venv .venv && .venv/bin/pip install . && "
                                    ".venv/bin/relay serve\n")
    assert first_two[1]["text"] == ("python3 -m venv .venv && .venv/bin/pip install -e "
                                    "'.[test]' && .venv/bin/python -m pytest\n")
    examples = [b for b in blocks[2:] if b["kind"] in ("sh", "python")]
    assert sum(b["runnable"] for b in examples) >= 8
    for block in examples:
        if not block["runnable"]:
            assert "need" in block["prose"].lower(), (
                "an example that is not marked runnable must say what it needs:\n"
                + block["text"])
        if block["kind"] == "python" and block["runnable"]:
            assert re.match(r"# \S+ — run it with: .+", block["text"]), block["text"]
    # The LM Studio example is not run, and the README says why.
    assert all("lmstudio/" not in b["text"] for b in examples if b["runnable"])


def _view_of_installed_packages(tmp: Path) -> Path:
    """Symlinks to this run's installed packages, less relay itself and the packaging
    tools the new venv brings its own of."""
    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp / "site-view"
    view.mkdir()
    skip = ("relay", "__editable__", "pip", "setuptools", "_distutils_hack", "pkg_resources",
            "wheel", "__pycache__", "distutils-precedence")
    for entry in site.iterdir():
        if entry.name.startswith(skip) or entry.suffix == ".pth":
            continue
        (view / entry.name).symlink_to(entry)
    return view


def _namespace_prefix() -> list[str] | None:
    """The command that runs a child in a network namespace of its own, if allowed."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return None
    prefix = [unshare, "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    probe = subprocess.run([*prefix, "true"], capture_output=True, check=False, timeout=10)
    return prefix if probe.returncode == 0 else None


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_fresh_clone_runs_the_readme_as_written(tmp_path: Path) -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and this repository's .git (a fresh clone is the point)")
    blocks = readme_blocks((ROOT / "README.md").read_text())
    first = blocks[0]["text"].strip()
    *install, serve = first.split(" && ")
    assert serve == ".venv/bin/relay serve", first
    runnable = [b for b in blocks if b["runnable"]]
    assert len(runnable) >= 8, "the README marks too few examples runnable"

    clone = tmp_path / "relay"
    subprocess.run([git, "clone", "-q", str(ROOT), str(clone)], check=True, timeout=60)
    # The daemon reads ./profiles.toml in the clone: it must be the packaged default.
    assert (clone / "profiles.toml").read_bytes() == \
        (clone / "relay" / "profiles.toml").read_bytes()

    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python3").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RELAY_URL", "RELAY_TOKEN")
           and not k.lower().endswith("_proxy")}
    env.update(PATH=f"{shims}{os.pathsep}{env.get('PATH', '')}",
               XDG_STATE_HOME=str(tmp_path / "state"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    # The install part, as written — with the view of installed packages dropped into
    # the venv between its two commands (see the module docstring).
    assert install[0] == "python3 -m venv .venv", first
    subprocess.run(["sh", "-ec", install[0]], cwd=clone, env=env, check=True, timeout=120)
    site = next((clone / ".venv" / "lib").glob("python3*/site-packages"))
    (site / "zz-readme-test-view.pth").write_text(f"{_view_of_installed_packages(tmp_path)}\n")
    done = subprocess.run(["sh", "-ec", " && ".join(install[1:])], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (clone / ".venv" / "bin" / "relay").exists()

    prefix = _namespace_prefix()
    if prefix is None:
        if not _port_free(8765):
            pytest.skip("no network namespace allowed here (unshare --net) and "
                        "127.0.0.1:8765 is taken: the README's examples need that port")
        prefix = []
    else:
        env["README_OWN_NETNS"] = "1"
    env["PIP_NO_INDEX"] = "1"   # a marked `pip install` must be satisfied, not download
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    results_file = tmp_path / "results.json"
    subprocess.run([*prefix, sys.executable, str(DRIVER), str(clone), serve,
                    str(tmp_path / "blocks.json"), str(results_file)],
                   env=env, check=True, timeout=600)
    results = json.loads(results_file.read_text())
    log = results["serve_log"]
    assert results.get("listening", "").startswith(
        "relay listening on http://127.0.0.1:8765 (config profiles.toml;"), log
    assert len(results["blocks"]) == len(runnable), log
    for block, got in zip(runnable, results["blocks"], strict=True):
        said = f"{block['text']}\n--- stdout:\n{got['out']}\n--- stderr:\n{got['err']}"
        assert got["rc"] == 0, said
        assert '"error"' not in got["out"], said
        if block["expect"]:
            assert block["expect"] in got["out"], said
    assert results["serve_rc"] == 0, log
    assert "Traceback" not in log, log

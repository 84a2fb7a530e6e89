#!/usr/bin/env bash
# Install what tests/adapters/cli/test_cli_adapters_real.py needs (and opencode, a client of relay in
# tests/clients/test_opencode_client.py; ollama-js for tests/clients/test_ollama_clients.py,
# found there through NODE_PATH=$(npm root -g); Qwen Code and aider, run by `relay launch`
# in tests/clients/test_launch.py): the three command-line AI tools from
# the npm registry (global, pinned to the versions notes/cli-tools.md observed) and iproute2
# (`ip netns`: the real tools run in a network namespace that has only loopback).
# Idempotent: a tool already installed at its pinned version is left alone.
set -euo pipefail
export npm_config_fund=false npm_config_audit=false npm_config_update_notifier=false

PINS=(
  "@anthropic-ai/claude-code@2.1.332"
  "@openai/codex@0.171.0"
  "@google/gemini-cli@0.61.0"
  "opencode-ai@1.18.33"          # a client of relay (tests/clients/test_opencode_client.py)
  "ollama@0.6.4"                 # ollama-js, a library: tests/clients/test_ollama_clients.py
  "@qwen-code/qwen-code@0.15.10" # run by `relay launch qwen` (tests/clients/test_launch.py)
)
# aider (`relay launch aider`) is a Python program with ~150 dependencies: a venv of its
# own, outside the project's, with its command linked onto PATH. Measured: 78 s, 687 MB.
AIDER_VERSION="0.86.2"
AIDER_VENV="/opt/relay-aider"

if ! command -v ip >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi
if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi

root="$(npm root -g)"
missing=()
for pin in "${PINS[@]}"; do
  name="${pin%@*}"
  want="${pin##*@}"
  have="$(node -p "require('$root/$name/package.json').version" 2>/dev/null || true)"
  if [[ "$have" != "$want" ]]; then
    missing+=("$pin")
  fi
done
if ((${#missing[@]})); then
  echo "installing ${missing[*]}"
  # claude-code declares engines.node >=22 but ships a native binary (notes/cli-tools.md):
  # npm's EBADENGINE warning is expected on Node 20.
  npm install -g --no-progress --loglevel=error "${missing[@]}"
fi
if [[ "$("$AIDER_VENV/bin/aider" --version 2>/dev/null)" != "aider $AIDER_VERSION" ]]; then
  echo "installing aider-chat==$AIDER_VERSION in $AIDER_VENV"
  python3 -m venv "$AIDER_VENV"
  "$AIDER_VENV/bin/pip" install -q --disable-pip-version-check "aider-chat==$AIDER_VERSION"
fi
ln -sf "$AIDER_VENV/bin/aider" /usr/local/bin/aider
for tool in claude codex gemini opencode qwen aider; do
  command -v "$tool" >/dev/null || { echo "install-clis: $tool not on PATH" >&2; exit 1; }
done
echo "install-clis: claude $(claude --version 2>/dev/null | head -1); codex $(codex --version 2>/dev/null | head -1); gemini $(gemini --version 2>/dev/null | head -1); opencode $(opencode --version 2>/dev/null | head -1); qwen $(qwen --version 2>/dev/null | head -1); $(aider --version 2>/dev/null | head -1)"

#!/usr/bin/env bash
# Install what the operations tests need (issue 8): headless Chromium and its WebDriver for
# tests/front/test_status_page.py, and systemd-analyze for tests/assembly/test_service.py (which also
# checks the unit without it, but verifies it with systemd when it is there).
# Debian packages; idempotent: nothing is installed when the commands are already there.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if ((${#missing[@]})); then
  echo "install-ops: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    "${missing[@]}" >/dev/null
fi
echo "install-ops: $(chromium --version 2>/dev/null | head -1); $(chromedriver --version | head -1); $(systemd-analyze --version | head -1)"

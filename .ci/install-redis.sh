#!/usr/bin/env bash
# Install redis-server for the shared-lane tests and bench (SPEC L11, O6: tests/test_shared_*.py
# start their own servers on free loopback ports, Sentinels too as `redis-server FILE
# --sentinel` of the same binary; nothing uses a system-wide instance).
# Debian package; idempotent: nothing is installed when redis-server (or valkey-server) is
# already there.
set -euo pipefail

if ! command -v redis-server >/dev/null 2>&1 && ! command -v valkey-server >/dev/null 2>&1; then
  echo "install-redis: installing redis-server"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
echo "install-redis: $( (command -v redis-server >/dev/null && redis-server --version) \
  || valkey-server --version)"

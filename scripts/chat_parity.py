"""The token ids the engine computes for each chat of a file, with a model's own tokenizer and
chat template: what kvroute's renderer and tokenizer must reproduce.

The engine is vLLM on Hugging Face transformers. vLLM itself is not installed (it needs a GPU
build of PyTorch); this script does what it does before calling transformers'
`apply_chat_template`, written anew from its source (vllm/renderers/hf.py and
vllm/entrypoints/chat_utils.py):

* it decides whether the template wants each message's content as one string or as a list of
  parts, by walking the template's Jinja syntax tree for a loop over a message's content
  (`content_format`, below);
* it rebuilds the messages as vLLM does (`conversation`): text parts joined with a line break
  or listed as `{"type": "text", ...}` dicts, media parts as `{"type": "image"}` in the list
  form and left out of the string (a text-only model has no placeholder for them), a null
  content as "" or [], tool-call arguments parsed from JSON, unknown keys dropped;
* it dumps the tool definitions with the fields of vLLM's request model (`tool_dicts`).

Then transformers renders and tokenizes. A chat that vLLM or the template refuses is recorded
with its error instead of ids: kvroute must refuse it too.

usage: chat_parity.py MODEL_DIR CHATS_JSON OUT_JSON
writes {"content_format": "string" | "openai", "chats": [{"name", "ids" | "error"}, ...]}
"""
import json
import logging
import sys
from collections import deque

import jinja2.nodes
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template


# --- the content format ---------------------------------------------------------------------


def _reaches(node, var, key=None):
    """Whether `node` is `var` (or `var[key]` / `var.key`), possibly sliced, filtered or tested."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reaches(node.node, var, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reaches(node.node, var, key)
    is_var = lambda n: isinstance(n, jinja2.nodes.Name) and n.ctx == "load" and n.name == var
    if key is None:
        return is_var(node)
    if isinstance(node, jinja2.nodes.Getitem):
        return is_var(node.node) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return is_var(node.node) and node.attr == key
    return False


class _Fallback(Exception):
    """vLLM's walk fails here (a target that is not a plain name): it takes its default."""


def _name_of(target):
    if not isinstance(target, jinja2.nodes.Name):
        raise _Fallback()
    return target.name


def content_format(template):
    """"openai" when the template loops over a message's content, else "string" (vLLM's rule
    for `--chat-template-content-format auto`)."""
    try:
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"
    try:
        # Names bound to the messages, followed through `set` transitively.
        names, queue = ["messages"], deque(["messages"])
        while queue:
            name = queue.popleft()
            for assign in tree.find_all(jinja2.nodes.Assign):
                if _reaches(assign.node, name):
                    target = _name_of(assign.target)
                    if target not in names:
                        names.append(target)
                        queue.append(target)
        loops = list(tree.find_all(jinja2.nodes.For))
        message_vars = [
            _name_of(loop.target) for loop in loops if any(_reaches(loop.iter, n) for n in names)
        ]
        for loop in loops:
            over_content = any(_reaches(loop.iter, v, "content") for v in message_vars) or (
                isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content"
            )
            if over_content:
                _name_of(loop.target)
                return "openai"
    except _Fallback:
        return "string"
    return "string"


# --- the messages and tools as vLLM passes them -----------------------------------------------

_MEDIA = {
    "image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
    "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio", "video_url": "video",
}
_TEXT_KEY = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
             "thinking": "thinking"}


def _part(part):
    """("text", str) | ("media", modality) | ("tool_reference", name) | None (skipped)."""
    if isinstance(part, str):
        return ("text", part)
    if not isinstance(part, dict):
        raise ValueError(f"a content part must be an object: {part!r}")
    kind = part.get("type")
    if isinstance(kind, str) and part.get("uuid") is None:
        if kind in _TEXT_KEY:
            text = part.get(_TEXT_KEY[kind])
            return None if text is None else ("text", text)
        if kind == "tool_reference":
            return ("tool_reference", part.get("name") or "")
        if kind in _MEDIA:
            return ("media", _MEDIA[kind])
        raise ValueError(f"unsupported chat content part type: {kind!r}")
    if kind is not None and not isinstance(kind, str):
        raise ValueError("invalid 'type' field in a content part")
    for key in ("image_url", "image_pil", "image_embeds", "audio_embeds"):
        if key in part:
            return ("media", _MEDIA[key])
    if "audio_url" in part or part.get("input_audio") is not None:
        return ("media", "audio")
    if "video_url" in part:
        return ("media", "video")
    if "tool_reference" in part:
        return ("tool_reference", part.get("tool_reference") or "")
    raise ValueError("missing 'type' field in a content part")


def _content(content, fmt):
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [("text", content)]
    elif isinstance(content, list):
        parts = [p for p in map(_part, content) if p is not None]
    else:
        raise ValueError(f"a message's content must be text or parts: {content!r}")
    if fmt == "openai":
        out = []
        for kind, value in parts:
            if kind == "text":
                out.append({"type": "text", "text": value})
            elif kind == "media":
                out.append({"type": value})
            else:
                out.append({"type": "tool_reference", "name": value})
        return out
    return "\n".join(value for kind, value in parts if kind != "media" and value)


def _arguments(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, (dict, list)) else {}


def conversation(messages, fmt):
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"a message must be an object with a role: {message!r}")
        role = message["role"]
        msg = {"role": role, "content": _content(message.get("content"), fmt)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    raise ValueError("an assistant's tool_calls must be a list")
                if calls:
                    msg["tool_calls"] = []
                    for call in calls:
                        call = json.loads(json.dumps(call))
                        if not isinstance(call.get("function"), dict):
                            raise ValueError("a tool call must have a function")
                        call["function"]["arguments"] = _arguments(call["function"].get("arguments"))
                        msg["tool_calls"].append(call)
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                msg["reasoning"] = reasoning
                msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if isinstance(msg["content"], list) and all(p.get("type") == "text" for p in msg["content"]):
                msg["content"] = "\n".join(p["text"] for p in msg["content"])
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                msg[key] = message[key]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def tool_dicts(tools):
    """The request's tools as vLLM's request model dumps them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ValueError("a tool must have a function")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ValueError(f"unsupported tool type {kind!r}")
        function = tool["function"]
        if not isinstance(function.get("name"), str):
            raise ValueError("a tool's function must have a name")
        dumped = {k: function.get(k) for k in ("name", "description", "parameters")}
        dumped.update({k: v for k, v in function.items() if k not in dumped})
        entry = {"type": kind, "function": dumped}
        entry.update({k: v for k, v in tool.items() if k not in entry})
        out.append(entry)
    return out


def main() -> None:
    logging.disable(logging.WARNING)
    model_dir, chats_path, out_path = sys.argv[1:4]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fmt = content_format(tokenizer.get_chat_template())
    with open(chats_path, encoding="utf-8") as f:
        chats = json.load(f)
    results = []
    for chat in chats:
        try:
            ids = tokenizer.apply_chat_template(
                conversation(chat["messages"], fmt),
                tools=tool_dicts(chat.get("tools")),
                add_generation_prompt=chat.get("add_generation_prompt", True),
                tokenize=True,
            )
        except Exception as e:  # the engine refuses the chat: so must kvroute
            results.append({"name": chat["name"], "error": f"{type(e).__name__}: {e}"})
            continue
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        results.append({"name": chat["name"], "ids": [int(i) for i in ids]})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"content_format": fmt, "chats": results}, f)


if __name__ == "__main__":
    main()

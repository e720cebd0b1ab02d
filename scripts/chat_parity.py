"""The token ids Hugging Face transformers gives for each chat of a file, with the model's own
tokenizer and chat template: what kvroute's renderer and tokenizer must reproduce.

usage: chat_parity.py MODEL_DIR CHATS_JSON OUT_JSON
"""
import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    model_dir, chats_path, out_path = sys.argv[1:4]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(chats_path, encoding="utf-8") as f:
        chats = json.load(f)
    expected = []
    for chat in chats:
        ids = tokenizer.apply_chat_template(
            chat["messages"],
            tools=chat.get("tools"),
            add_generation_prompt=chat.get("add_generation_prompt", True),
            tokenize=True,
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        expected.append({"name": chat["name"], "ids": [int(i) for i in ids]})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(expected, f)


if __name__ == "__main__":
    main()

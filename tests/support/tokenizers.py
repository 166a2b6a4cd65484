"""Tokenizers for the tiny targets of the training tests."""
from __future__ import annotations

SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>")
CHARS = "\nabcdefghijklmnopqrstuvwxyz 0123456789.,?!'-:"   # ids 3 .. 47


class CharChatTokenizer:
    """A ChatML character tokenizer over the tiny target's 48 ids (every id decodes and re-encodes)."""

    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((k for k, s in enumerate(SPECIALS) if text.startswith(s, i)), None)
            if special is not None:
                ids.append(special)
                i += len(SPECIALS[special])
            else:
                ids.append(len(SPECIALS) + CHARS.index(text[i]))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(SPECIALS[i] if i < len(SPECIALS) else CHARS[i - len(SPECIALS)] for i in ids)

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, return_dict=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

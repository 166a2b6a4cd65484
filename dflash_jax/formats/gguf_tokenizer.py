"""A transformers tokenizer built from a GGUF file's own metadata (vocabulary, merges, special
tokens, chat template); nothing here touches the network."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from dflash_jax.formats.gguf_file import (
    GGUFCheckpoint,
    Vocabulary,
    existing_gguf,
    open_reader,
    read_vocabulary,
    scalar_metadata,
)

# Tokens that close a chat turn, in the order we prefer them as `eos_token`.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def _template_text(tok) -> str:
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(v) for v in template.values())
    return template or ""


def _encoding_adds(tok, token_id, at_start: bool) -> bool:
    """Whether encoding with special tokens wraps text in `token_id` (at the start or the end)."""
    if token_id is None:
        return False
    with_special = tok("x", add_special_tokens=True)["input_ids"]
    plain = tok("x", add_special_tokens=False)["input_ids"]
    edge = with_special[:1] if at_start else with_special[-1:]
    return with_special != plain and edge == [token_id]


_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp token types


def _tokenizer_from_gguf_only(path: Path, meta: Mapping[str, Any], vocabulary: Vocabulary):
    """A byte-level BPE tokenizer built straight from the GGUF metadata with `tokenizers`.

    transformers' own GGUF tokenizer path imports torch, which must never be needed at run time,
    so the vocabulary, merges, special tokens and chat template are read here. Only the "gpt2"
    (byte-level BPE) tokenizer model is supported; "smollm"/"llama-bpe"-style pre-tokenizers that
    split digits one by one get a Digits pre-tokenizer, as llama.cpp does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE, "
                         "'gpt2'); load the target from a Hugging Face directory with its tokenizer.json")
    tokens, types = vocabulary.tokens, vocabulary.token_types
    merges = [tuple(m.split(" ", 1)) for m in vocabulary.merges]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, continuing_subword_prefix="", end_of_word_suffix=""))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in ("smollm", "llama-bpe", "llama3", "qwen2", "deepseek-llm"):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types) if kind in (_CONTROL_TOKEN, _USER_DEFINED_TOKEN)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key: str):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"))
    tok.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    tok.add_eos_token = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if tok.add_bos_token and tok.bos_token:  # the plain post-processor below never adds it
        from tokenizers import processors

        backend = tok.backend_tokenizer
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B",
            special_tokens=[(tok.bos_token, tok.bos_token_id)])
    tok.name_or_path = str(path)
    return tok


def gguf_tokenizer(source: "str | Path | GGUFCheckpoint"):
    """A transformers fast tokenizer built from the GGUF's own vocabulary, merges, special tokens
    and chat template (no hub access), made safe for chat use:

    * If the BOS token is written literally by the chat template (ChatML files mark
      ``<|im_start|>`` as BOS), encoding never prepends it, so a templated prompt starts with
      exactly one such token however it is encoded.
    * ``eos_token`` is the token that ends a chat turn (``<|im_end|>`` for ChatML) when the
      template uses one, and no EOS is ever appended to an encoded prompt.
    * ``pad_token`` falls back to ``eos_token`` when the file names none.
    """
    if isinstance(source, GGUFCheckpoint):  # reuse the parsed file instead of reading it again
        path, meta, vocabulary = source.path, source.metadata, source.vocabulary
    else:
        path = existing_gguf(source)
        reader = open_reader(path)
        meta, vocabulary = scalar_metadata(reader), read_vocabulary(reader)
    tok = _tokenizer_from_gguf_only(path, meta, vocabulary)
    template = _template_text(tok)
    vocab = tok.get_vocab()

    if template:
        turn_end = next((t for t in _TURN_END_TOKENS if t in template and t in vocab), None)
        if turn_end is not None and tok.eos_token != turn_end:
            tok.eos_token = turn_end
        if tok.bos_token and tok.bos_token in template and getattr(tok, "add_bos_token", False):
            tok.add_bos_token = False
    if getattr(tok, "add_eos_token", False):
        tok.add_eos_token = False
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token

    # Belt and braces across transformers versions: if the post-processor still wraps text in
    # special tokens that the template writes itself (or an EOS), replace it by a plain one.
    bad_bos = (bool(template) and bool(tok.bos_token) and tok.bos_token in template
               and _encoding_adds(tok, tok.bos_token_id, at_start=True))
    if bad_bos or _encoding_adds(tok, tok.eos_token_id, at_start=False):
        from tokenizers import processors

        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    return tok

"""Build a `tokenizers.Tokenizer` from a GGUF file's metadata (tokenizer.ggml.*).

Byte-level BPE vocabularies (model "gpt2": SmolLM2, Llama 3, Qwen) are assembled directly, which
takes well under a second; other kinds fall back to transformers' GGUF converter."""
from __future__ import annotations

import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shardserve.models.gguf_loader import field_value
from shardserve.utils import require_extra

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    for split, names in ((_LLAMA3_SPLIT, ("llama-bpe", "llama3", "smaug-bpe")), (_QWEN2_SPLIT, ("qwen2",))):
        if pre in names:
            return pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level


def tokenizer_from_gguf(reader, path: str) -> tuple[Tokenizer, dict]:
    """Returns the tokenizer and its special-token facts (bos/eos token strings, chat template)."""
    kind = field_value(reader, "tokenizer.ggml.model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    bos_id = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos_id = field_value(reader, "tokenizer.ggml.eos_token_id")
    info = {
        "bos_token": tokens[bos_id] if bos_id is not None else None,
        "eos_token": tokens[eos_id] if eos_id is not None else None,
        "chat_template": field_value(reader, "tokenizer.chat_template"),
        # End-of-turn / end-of-message tokens end generation too (Llama 3 instruct).
        "extra_eos_ids": [int(i) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                          if (i := field_value(reader, key)) is not None],
    }
    if kind != "gpt2":
        require_extra(f"a GGUF with a {kind!r} vocabulary needs", "sentencepiece", "transformers")
        from transformers import AutoTokenizer  # slow path for sentencepiece-style vocabularies
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        return hf.backend_tokenizer, info
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = field_value(reader, "tokenizer.ggml.token_type")
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED])
    if field_value(reader, "tokenizer.ggml.add_bos_token", False) and info["bos_token"]:
        bos = info["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, info

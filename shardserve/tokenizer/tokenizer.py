"""A thin tokenizer over the `tokenizers` library, loaded from an HF directory or a GGUF file.

It keeps the pieces a server needs in one place: encode/decode, special tokens, EOS ids (from
generation_config.json too) and the chat template. transformers is not imported unless a checkpoint
has no tokenizer.json (sentencepiece-only vocabularies)."""
from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer

from shardserve.tokenizer.chat_template import render_chat_template
from shardserve.utils import require_extra


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):   # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


class Tokenizer:
    def __init__(self, backend: _RustTokenizer, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None, extra_eos_ids: list[int] | None = None) -> None:
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        self.eos_token_ids = frozenset(eos | set(extra_eos_ids or []))
        self.all_special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.vocab_size = backend.get_vocab_size()

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str) -> "Tokenizer":
        if path.endswith(".gguf"):
            return cls.from_gguf(path)
        return cls.from_hf_dir(path)

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        from shardserve.models.gguf_loader import open_gguf
        from shardserve.tokenizer.gguf_tokenizer import tokenizer_from_gguf
        backend, info = tokenizer_from_gguf(open_gguf(path), path)
        return cls(backend, info["bos_token"], info["eos_token"], info["chat_template"], info["extra_eos_ids"])

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tokenizer_file):
            backend = _RustTokenizer.from_file(tokenizer_file)
        else:   # converted by transformers (a sentencepiece tokenizer.model needs sentencepiece too)
            spm = ("sentencepiece", "google.protobuf") if os.path.isfile(os.path.join(path, "tokenizer.model")) else ()
            require_extra("a checkpoint without tokenizer.json needs", "sentencepiece", "transformers", *spm)
            from transformers import AutoTokenizer
            backend = AutoTokenizer.from_pretrained(path).backend_tokenizer
        template = config.get("chat_template")
        template_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template_file):
            with open(template_file) as f:
                template = f.read()
        if isinstance(template, list):   # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        gen = _read_json(os.path.join(path, "generation_config.json"))
        extra = gen.get("eos_token_id")
        extra = extra if isinstance(extra, list) else ([extra] if extra is not None else [])
        return cls(backend, _token_str(config.get("bos_token")), _token_str(config.get("eos_token")), template, extra)

    # ---- use -------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:   # the Rust tokenizer refuses str that is not valid Unicode
            if any("\ud800" <= ch <= "\udfff" for ch in text):
                raise ValueError("the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid "
                                 "Unicode: encode characters outside the BMP as surrogate pairs") from None
            raise

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str:
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; pass chat_template= (or --chat-template)")
        return render_chat_template(template, messages, add_generation_prompt, tools,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

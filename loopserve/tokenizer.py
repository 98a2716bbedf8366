"""Tokenizer of a checkpoint folder: `tokenizer.json` + `tokenizer_config.json` (special tokens,
Jinja chat template) + `generation_config.json` (extra eos ids)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_str(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: missing tokenizer file")
        self.tok = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token_ids: set[int] = {self.eos_token_id} if self.eos_token_id is not None else set()
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            self.eos_token_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """Incremental decoding: feed generated ids one at a time, get the new text (None while a
        multi-byte character is incomplete); about 2 us a token instead of re-decoding windows."""
        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token: stream.step(self.tok, token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

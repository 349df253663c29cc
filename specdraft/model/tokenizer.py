"""The target's tokenizer at inference, without importing ``transformers`` (about 2 s) for what a prompt needs.

A converted tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``, the chat template) is read
with the Rust ``tokenizers`` library directly: encoding and decoding are the same backend calls the
transformers tokenizer makes, so the ids and text are the same (tests/test_loading.py checks it).

The chat template is jinja code run by transformers.  For the one conversation a prompt makes (one user
message, then the assistant prefix) the loader renders it once with marker contents and keeps the text
around the content (``chat.json``: "before", "after"), but only if the template puts any content there
verbatim; then such a prompt is ``before + content + after``.  Every other conversation, and every
other attribute (the vocabulary tools training uses, ``save_pretrained``), goes to the transformers
tokenizer, loaded on first use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

WRAP_FILE = "chat.json"
TEMPLATE_FILE = "chat_template.jinja"  # a folder's chat template (read before tokenizer_config.json's)
# Gemma's turn format, for a Gemma GGUF that carries no template: system text opens the next user turn,
# each turn is <start_of_turn>user|model, its text, <end_of_turn>; the prompt ends with the model's turn.
GEMMA_CHAT_TEMPLATE = (
    '{{- bos_token -}}{%- set ns = namespace(system="") -%}'
    '{%- for message in messages -%}'
    '{%- if message["role"] == "system" -%}{%- set ns.system = ns.system + message["content"] | trim + "\n\n" -%}'
    '{%- else -%}'
    '{{- "<start_of_turn>" + ("model" if message["role"] == "assistant" else "user") + "\n" -}}'
    '{%- if message["role"] != "assistant" -%}{{- ns.system -}}{%- set ns.system = "" -%}{%- endif -%}'
    '{{- message["content"] | trim + "<end_of_turn>\n" -}}'
    '{%- endif -%}{%- endfor -%}'
    '{%- if add_generation_prompt -%}{{- "<start_of_turn>model\n" -}}{%- endif -%}')
_MARKERS = ("specdraft-marker", " two  words\n\nand lines ", "<b>{{ x }}</b> \\n ")  # contents the wrap must hold for


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters for the 256 bytes (GPT-2's table): printable Latin-1 bytes stand for
    themselves, the others take the code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {chr(b if b in keep else next(extra)): b for b in range(256)}


_BYTE_OF = _byte_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback pieces


@dataclass
class Encoding:
    input_ids: list[int]


def _ids(backend, text: str, add_special_tokens: bool) -> list[int]:
    """``backend.encode(text).ids``, through the batch call: it lets go of the GIL while it works (a single
    ``encode`` holds it, and a megabyte prompt on a server worker thread would stall every other request
    for a second) and skips the character offsets nothing here uses.  The same ids."""
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _token_text(value) -> str | None:  # tokenizer_config.json writes a token as a string or {"content": ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_wrap(hf_tokenizer) -> dict | None:
    """{"before", "after"}: the one-user-message prompt of ``hf_tokenizer``'s chat template around its
    content, or None when the template does not put every marker content there verbatim."""
    if not getattr(hf_tokenizer, "chat_template", None):
        return None
    texts = []
    for m in _MARKERS:
        try:
            texts.append(hf_tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                                          add_generation_prompt=True))
        except Exception:  # the template's own raise_exception or any jinja error: no shortcut
            return None
    i = texts[0].find(_MARKERS[0])
    if i < 0:
        return None
    before, after = texts[0][:i], texts[0][i + len(_MARKERS[0]):]
    if any(t != before + m + after for t, m in zip(texts, _MARKERS)):
        return None
    return {"before": before, "after": after}


class Tokenizer:
    """Encode, decode and the one-message chat prompt from a tokenizer folder; anything else from the
    transformers tokenizer of the same folder (``hf``), loaded when first needed."""

    def __init__(self, folder: str | Path, wrap: str | Path | None = None) -> None:
        from tokenizers import Tokenizer as Backend  # the Rust library: milliseconds

        self.folder = Path(folder)
        self._tk = Backend.from_file(str(self.folder / "tokenizer.json"))
        cfg = json.loads((self.folder / "tokenizer_config.json").read_text())
        template = self.folder / TEMPLATE_FILE
        self.chat_template = template.read_text() if template.is_file() else cfg.get("chat_template")
        eos = _token_text(cfg.get("eos_token"))
        self.eos_token_id = None if eos is None else self._tk.token_to_id(eos)
        # as transformers decodes: its space clean-up, never for a BPE model unless the config insists
        self._clean_spaces = bool(cfg.get("clean_up_tokenization_spaces", False)) and (
            type(self._tk.model).__name__ != "BPE"
            or bool(cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)))
        wrap = Path(wrap) if wrap is not None else self.folder / WRAP_FILE  # chat_wrap's JSON (the loader caches it)
        self._wrap = json.loads(wrap.read_text()) if wrap.is_file() else None
        added = self._tk.get_added_tokens_decoder()
        self._added = [t.content for t in added.values()]
        self._added_ids = set(added)
        self._byte_level = (json.loads(self._tk.to_str()).get("decoder") or {}).get("type") == "ByteLevel"
        self._hf = None
        self._text_only = None  # the backend again, with special-token matching off (encode_as_text)

    @property
    def hf(self):
        """The transformers tokenizer of the same folder (imported and loaded on first use)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.folder))
        return self._hf

    def __getattr__(self, name: str):  # only for attributes not defined here
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(_ids(self._tk, text, add_special_tokens))

    def added_texts(self) -> list[str]:
        """The text of every added token (the special tokens among them): what ``__call__`` turns into
        those tokens wherever it appears."""
        return self._added

    def encode_as_text(self, text: str) -> list[int]:
        """Ids of ``text`` with any special-token text in it tokenized as plain text (a user cannot write
        ``<|im_start|>`` into a prompt and get the token)."""
        if self._text_only is None:
            from tokenizers import Tokenizer as Backend

            self._text_only = Backend.from_str(self._tk.to_str())
            self._text_only.encode_special_tokens = True
        return _ids(self._text_only, text, False)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a byte-level piece maps back through the byte alphabet; a
        SentencePiece piece's "▁" is a space, "<0xNN>" one byte; an added token is its text).  A token's
        bytes may be part of a UTF-8 character: the log-probabilities' "bytes" field."""
        piece = self._tk.id_to_token(token)
        if piece is None:
            return b""
        if token in self._added_ids:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_spaces else text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs):
        one = (len(messages) == 1 and set(messages[0]) == {"role", "content"} and messages[0]["role"] == "user"
               and isinstance(messages[0]["content"], str))
        if self._wrap is not None and one and add_generation_prompt and not tokenize and not kwargs:
            return self._wrap["before"] + messages[0]["content"] + self._wrap["after"]
        return self.hf.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                                           **kwargs)


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (the spaces before punctuation and English contractions)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def added_texts(tok) -> list[str]:
    """``Tokenizer.added_texts`` for this project's tokenizer or a transformers one."""
    if isinstance(tok, Tokenizer):
        return tok.added_texts()
    return [t.content for t in tok.added_tokens_decoder.values()]


def encode_as_text(tok, text: str) -> list[int]:
    """``Tokenizer.encode_as_text`` for this project's tokenizer or a transformers one."""
    if isinstance(tok, Tokenizer):
        return tok.encode_as_text(text)
    return tok(text, add_special_tokens=False, split_special_tokens=True).input_ids

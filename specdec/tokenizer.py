"""Tokenizer shared by the gateway, drafter and verifier.

Speculative decoding only works if the drafter and the target agree on what every
token id means, so besides encode/decode this wrapper can fingerprint the id space.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Files next to the tokenizer that may name extra end-of-sequence ids. Instruct models
# often stop on a chat-turn terminator that the tokenizer itself does not call "eos".
_EOS_CONFIG_FILES = ("generation_config.json", "config.json")


class Tokenizer:
    """A Hugging Face tokenizer plus the serving-side knowledge around it."""

    def __init__(
        self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Iterable[int] = ()
    ) -> None:
        self._hf = hf_tokenizer
        eos = set(extra_eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self._eos_token_ids = frozenset(eos)
        self._skipped_ids: frozenset[int] | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        # Serving must never reach out to the Hub; a missing file is a preparation bug.
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(hf, _eos_ids_from_configs(path))

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        return self._hf

    @property
    def vocab_size(self) -> int:
        # len() rather than .vocab_size: the latter leaves out added tokens, which the
        # model can still emit.
        return len(self._hf)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def skipped_token_ids(self) -> frozenset[int]:
        """Ids that decode to nothing with ``skip_special_tokens=True``."""
        if self._skipped_ids is None:
            # Asking decode itself keeps this in step with whatever the backend treats as
            # special, instead of trusting transformers' own list of special tokens.
            self._skipped_ids = frozenset(
                i
                for i in self._hf.added_tokens_decoder
                if self._hf.decode([i], skip_special_tokens=True) == ""
            )
        return self._skipped_ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Space clean-up (" ." -> ".") looks across token boundaries, which would make
        # incremental decoding disagree with decoding everything at once.
        return self._hf.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """`tools`: OpenAI-style function definitions, for templates with a tools section
        (others ignore them)."""
        if not getattr(self._hf, "chat_template", None):
            raise ValueError(
                "tokenizer has no chat template; send a plain prompt instead of messages"
            )
        return self._hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        # Render then encode, as transformers does internally: the template already
        # writes BOS and the turn markers, so encoding must not add special tokens again.
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools)
        return self.encode(text, add_special_tokens=False)

    def fingerprint(self) -> tuple[int, str]:
        """(vocab_size, sha256 over every id's token string and added-token flags).

        Only the id <-> token mapping matters for drafter/target compatibility: both sides
        exchange ids, so differing merges or normalizers would not break verification.
        """
        vocab = sorted((i, tok) for tok, i in self._hf.get_vocab().items())
        added = sorted(
            (i, t.content, bool(t.special)) for i, t in self._hf.added_tokens_decoder.items()
        )
        canonical = json.dumps(
            {"vocab": vocab, "added": added}, ensure_ascii=False, separators=(",", ":")
        )
        return self.vocab_size, hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _eos_ids_from_configs(path: Path) -> set[int]:
    ids: set[int] = set()
    for name in _EOS_CONFIG_FILES:
        file = path / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def model_fingerprint(model_dir: str | Path) -> tuple[int, str]:
    """The fingerprint a model's services exchange: (config vocab_size, tokenizer hash).

    The vocabulary is the model's logit count, which proposals and q rows are sized
    by; the hash is "" when the tokenizer's length differs from it (a padded
    embedding, as Qwen2 has), since ids past the tokenizer are then never produced.
    """
    from specdec.models.config import ModelConfig

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    size, digest = Tokenizer.from_dir(model_dir).fingerprint()
    return vocab, digest if size == vocab else ""

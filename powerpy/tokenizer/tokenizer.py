"""The :class:`Tokenizer`: a GGUF vocabulary's text <-> token ids, matching llama.cpp.

Two vocabulary types are supported, selected by ``tokenizer.ggml.model``:

* ``"gpt2"``: byte-level BPE. Text is split into words by the pre-tokenizer regexes that
  llama.cpp uses for ``tokenizer.ggml.pre``, each word's UTF-8 bytes are mapped to printable
  characters (GPT-2 byte-to-unicode table) and merged by merge rank.
* ``"llama"``: SentencePiece-style BPE. Spaces become U+2581, a space is prefixed to each text
  fragment at the start or after a special token (``add_space_prefix``), adjacent symbols are
  merged by token score, and characters missing from the vocabulary fall back to ``<0xXX>`` byte
  tokens.

Special tokens (CONTROL, USER_DEFINED and UNKNOWN types) are cut out of the text before the
pre-tokenizer runs, longest token first, like llama.cpp's ``tokenizer_st_partition``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from powerpy.errors import TokenizerError
from powerpy.tokenizer.merges import SPM_SPACE, bpe_merge, spm_merge
from powerpy.tokenizer.metadata import as_list, as_str, tokenizer_args
from powerpy.tokenizer.pieces import clean_spaces, make_piece
from powerpy.tokenizer.pretokenize import PRE_TYPES, Split, pretokenize, splits_for
from powerpy.tokenizer.specials import (
    HIDDEN_ATTRS,
    ROLE_KEYS,
    SPECIAL_ATTRS,
    TYPE_TO_ATTR,
    TokenAttr,
    detect_special,
    partition,
)
from powerpy.tokenizer.stream import StreamDecoder
from powerpy.tokenizer.unicode import SURROGATES, byte_encode, utf8

log = logging.getLogger(__name__)

__all__ = ["Tokenizer"]


class Tokenizer:
    """Text <-> token ids for a GGUF vocabulary, matching llama.cpp.

    Build one with :meth:`from_gguf_kv`. Attributes: ``model`` ("gpt2" or "llama"), ``pre``,
    ``vocab_size``, ``bos_id``, ``eos_id``, ``unk_id``, ``pad_id``, ``eot_id``, ``eom_id`` (``None``
    when absent), ``eog_ids`` (frozenset), ``add_bos``, ``add_eos``, ``add_space_prefix``,
    ``clean_spaces`` and ``chat_template``.
    """

    _CACHE_LIMIT = 200_000

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        scores: Sequence[float] | None = None,
        merges: Sequence[str] | None = None,
        pre: str | None = None,
        special_ids: Mapping[str, int] | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
        add_space_prefix: bool | None = None,
        model_name: str = "",
        chat_template: str | None = None,
    ) -> None:
        """Build a tokenizer from already-decoded vocabulary data.

        Most callers want :meth:`from_gguf_kv`.

        Args:
            model: ``tokenizer.ggml.model``: "gpt2" or "llama".
            tokens: token texts, index = id.
            token_types: ``TokenType`` per token (all NORMAL when missing).
            scores: per-token scores (SPM merge priorities); zeros when missing.
            merges: "left right" merge rules in rank order (required for "gpt2").
            pre: ``tokenizer.ggml.pre`` (gpt2 only); missing means llama.cpp's "default".
            special_ids: ids from metadata keyed by role ("bos", "eos", "unk", "pad", "eot",
                "eom", "sep", "mask", "fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep",
                "fim_sep").
            add_bos: ``tokenizer.ggml.add_bos_token`` (``None``: llama.cpp's default).
            add_eos: ``tokenizer.ggml.add_eos_token`` (``None``: false).
            add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (``None``: true for llama).
            model_name: ``general.name``; llama.cpp adjusts a few token attributes by it.
            chat_template: ``tokenizer.chat_template``.

        Raises:
            TokenizerError: unsupported tokenizer model or pre-tokenizer, or missing merges.
        """
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {model!r}: need 'gpt2' or 'llama'; "
                "convert the model with a BPE (gpt2) or SentencePiece (llama) vocabulary"
            )
        self.model = model
        self.chat_template = chat_template
        n = len(tokens)
        self.vocab_size = n

        texts: list[str] = []
        for i, t in enumerate(tokens):
            t = as_str(t)
            if not t:
                log.warning("empty token at index %d", i)
                t = f"[EMPTY_{i}]"
            texts.append(t)
        self._texts = texts
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(texts)}

        if scores is None:
            self._scores = [0.0] * n
        else:
            self._scores = [float(s) for s in as_list(scores)[:n]]
            if len(self._scores) < n:
                raise TokenizerError(f"{len(self._scores)} scores for {n} tokens")
        if token_types is None:
            attrs = [TokenAttr.NORMAL] * n
        else:
            tt = [int(x) for x in as_list(token_types)[:n]]
            if len(tt) < n:
                raise TokenizerError(f"{len(tt)} token types for {n} tokens")
            attrs = [TYPE_TO_ATTR.get(t, TokenAttr.UNDEFINED) for t in tt]
        self._attrs: list[TokenAttr] = attrs

        ids = dict(special_ids or {})
        if model == "llama":
            self.pre = None
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            self.add_bos = True
            self.add_space_prefix = True
            self.clean_spaces = False
            self._ignore_merges = False
            self._splits: tuple[Split, ...] = ()
            self._ranks: dict[tuple[str, str], int] = {}
        else:
            if pre is None or pre == "":
                log.warning("missing tokenizer.ggml.pre: using llama.cpp's 'default' pre-tokenizer")
                pre = "default"
            spec = PRE_TYPES.get(pre)
            if spec is None:
                raise TokenizerError(
                    f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(sorted(PRE_TYPES))}"
                )
            self.pre = pre
            defaults = {"bos": 11, "eos": 11}
            if spec.no_bos:
                defaults.pop("bos")
            self.add_bos = spec.add_bos
            self.add_space_prefix = False
            self.clean_spaces = spec.clean_spaces
            self._ignore_merges = spec.ignore_merges
            self._splits = splits_for(spec.split)
            if merges is None:
                raise TokenizerError(
                    "gpt2 tokenizer needs tokenizer.ggml.merges; re-convert the model"
                )
            self._ranks = {}
            for rank, line in enumerate(merges):
                line = as_str(line)
                pos = line.find(" ", 1)
                pair = (line[:pos], line[pos + 1 :]) if pos >= 0 else ("", "")
                self._ranks.setdefault(pair, rank)
        self.add_eos = False
        if add_bos is not None:
            self.add_bos = bool(add_bos)
        if add_eos is not None:
            self.add_eos = bool(add_eos)
        if add_space_prefix is not None:
            self.add_space_prefix = bool(add_space_prefix)

        role_ids: dict[str, int | None] = {}
        for role in ROLE_KEYS:
            rid = defaults.get(role)
            if rid is not None and rid >= n:
                rid = None
            new = ids.get(role)
            if new is not None:
                if 0 <= int(new) < n:
                    rid = int(new)
                else:
                    log.warning("special token %s = %s is out of range; ignored", role, new)
            role_ids[role] = rid
        self.eog_ids: frozenset[int] = detect_special(
            self._attrs, texts, self._token_to_id, role_ids, model_name
        )

        self.bos_id: int | None = role_ids["bos"]
        self.eos_id: int | None = role_ids["eos"]
        self.unk_id: int | None = role_ids["unk"]
        self.pad_id: int | None = role_ids["pad"]
        self.eot_id: int | None = role_ids["eot"]
        self.eom_id: int | None = role_ids["eom"]
        self.special_ids: dict[str, int | None] = role_ids

        special = [i for i in range(n) if self._attrs[i] & SPECIAL_ATTRS]
        special.sort(key=lambda i: -len(utf8(self._texts[i])))
        self._special_order = special

        self._pieces: list[bytes | None] = [None] * n
        self._bpe_cache: dict[str, tuple[int, ...]] = {}

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_gguf_kv(cls, kv: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata.

        Args:
            kv: metadata mapping as produced by ``powerpy.formats.gguf_reader.read_gguf(path).kv``:
                strings as ``str`` (``bytes`` accepted), arrays as lists or numpy arrays.

        Returns:
            The tokenizer.

        Raises:
            TokenizerError: metadata missing, malformed (wrong type or length, special-token id
                outside the vocabulary) or of an unsupported tokenizer kind.
        """
        return cls(**tokenizer_args(kv))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build the tokenizer from a GGUF/PWRI file's metadata.

        Args:
            path: model file.

        Returns:
            The tokenizer.
        """
        from powerpy.formats.gguf_reader import read_gguf

        gf = read_gguf(path)
        try:
            return cls.from_gguf_kv(gf.kv)
        finally:
            gf.close()

    # --- queries -------------------------------------------------------------------------------
    def is_eog(self, token_id: int) -> bool:
        """Whether ``token_id`` ends generation (EOS, EOT, <|im_end|>, ...).

        Args:
            token_id: token id.

        Returns:
            True for end-of-generation tokens.
        """
        return token_id in self.eog_ids

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary text of a token (byte-level or U+2581-escaped as stored).

        Args:
            token_id: token id.

        Returns:
            The stored token text.
        """
        return self._texts[token_id]

    def token_attr(self, token_id: int) -> TokenAttr:
        """The token's attributes after llama.cpp's adjustments.

        Args:
            token_id: token id.

        Returns:
            The attribute flags.
        """
        return self._attrs[token_id]

    def token_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is exactly ``text``.

        Args:
            text: raw token text.

        Returns:
            The id, or None.
        """
        return self._token_to_id.get(text)

    # --- encoding ------------------------------------------------------------------------------
    def encode(
        self,
        text: str,
        *,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool = False,
    ) -> list[int]:
        """Tokenize ``text`` like ``llama_tokenize``.

        Args:
            text: the text. Lone surrogates stand for undecodable bytes (``surrogateescape``):
                byte-level vocabularies see U+FFFD for them, as llama.cpp does for invalid
                UTF-8, SPM ones fall back to the original bytes.
            add_bos: prepend BOS; ``None`` uses ``tokenizer.ggml.add_bos_token`` (llama.cpp
                default when absent: true for "llama" vocabularies and the llama3-style
                pre-tokenizers, false for other "gpt2" vocabularies).
            parse_special: recognise control tokens written in the text (``<|im_start|>``);
                user-defined tokens are recognised either way.
            add_eos: append EOS when the vocabulary asks for it (``add_eos_token``), like
                llama.cpp's ``add_special``; off by default.

        Returns:
            Token ids.

        Raises:
            ValueError: BOS/EOS requested but the vocabulary has none.
        """
        want_bos = self.add_bos if add_bos is None else add_bos
        out: list[int] = []
        if want_bos:
            if self.bos_id is None:
                raise ValueError("BOS requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        if self.model == "gpt2" and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # llama.cpp reads undecodable bytes as U+FFFD
                text = SURROGATES.sub("\ufffd", text)
        fragments = partition(text, self._special_order, self._attrs, self._texts, parse_special)
        if self.model == "llama":
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                escaped = frag.replace(" ", SPM_SPACE)
                out.extend(spm_merge(escaped, self._token_to_id, self._scores, self.unk_id))
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    out.append(frag)
                else:
                    for word in pretokenize(frag, self._splits):
                        out.extend(self._bpe_word(word))
        if add_eos and self.add_eos:
            if self.eos_id is None:
                raise ValueError("EOS requested but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return out

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        cached = self._bpe_cache.get(word)
        if cached is not None:
            return cached
        ids = bpe_merge(byte_encode(word), self._ranks, self._token_to_id, self._ignore_merges)
        if len(self._bpe_cache) >= self._CACHE_LIMIT:
            self._bpe_cache.clear()
        self._bpe_cache[word] = ids
        return ids

    # --- decoding ------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes one token stands for, like ``llama_token_to_piece`` (no space stripping).

        Args:
            token_id: token id.
            special: render control/unknown tokens as their text (else they give ``b""``).

        Returns:
            The piece's bytes (possibly an incomplete UTF-8 sequence).

        Raises:
            IndexError: id out of range.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if not special and self._attrs[token_id] & HIDDEN_ATTRS:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = make_piece(self._texts[token_id], self._attrs[token_id], self.model)
            self._pieces[token_id] = piece
        return piece

    def decode_bytes(
        self, ids: Sequence[int], *, remove_special: bool = False, unparse_special: bool = True
    ) -> bytes:
        """Detokenize to bytes exactly like ``llama_detokenize``.

        Args:
            ids: token ids.
            remove_special: drop a leading BOS / trailing EOS the vocabulary would add.
            unparse_special: render control/unknown tokens as their text.

        Returns:
            The bytes (may end in an incomplete UTF-8 sequence).
        """
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for tid in ids:
            piece = self.token_to_piece(tid, special=unparse_special)
            if remove_space and piece[:1] == b" ":
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        out = b"".join(parts)
        if self.clean_spaces:
            out = clean_spaces(out)
        return out

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Detokenize to text.

        Same as ``llama_detokenize(remove_special=skip_special, unparse_special=not
        skip_special)``, decoded as UTF-8 with invalid bytes replaced by U+FFFD.

        Args:
            ids: token ids.
            skip_special: hide control/unknown tokens (BOS, EOS, <|im_end|>, ...).

        Returns:
            The text.
        """
        raw = self.decode_bytes(ids, remove_special=skip_special, unparse_special=not skip_special)
        return raw.decode("utf-8", errors="replace")

    def stream_decoder(
        self, *, skip_special: bool = False, strip_leading_space: bool | None = None
    ) -> StreamDecoder:
        """A decoder that turns tokens into text one at a time.

        Args:
            skip_special: hide control/unknown tokens.
            strip_leading_space: drop one leading space of the first token's piece, as
                :meth:`decode` does for SPM vocabularies; ``None`` uses ``add_space_prefix``.
                Pass False when streaming a continuation of an already-decoded prompt.

        Returns:
            A fresh :class:`StreamDecoder`.
        """
        strip = self.add_space_prefix if strip_leading_space is None else strip_leading_space
        return StreamDecoder(self, skip_special=skip_special, strip_leading_space=strip)

"""Tokenizer built only from GGUF metadata, following llama.cpp's behaviour.

Modules, along the way text takes:

* :mod:`~powerpy.tokenizer.tokenizer`: :class:`Tokenizer` (``from_gguf_kv``, encode, decode,
  special tokens, end of generation);
* :mod:`~powerpy.tokenizer.metadata`: the ``tokenizer.*`` GGUF keys read and checked;
* :mod:`~powerpy.tokenizer.specials`: token attributes, special-token detection, partitioning;
* :mod:`~powerpy.tokenizer.pretokenize`: the pre-tokenizer regexes per ``tokenizer.ggml.pre``;
* :mod:`~powerpy.tokenizer.unicode`: character classes, the GPT-2 byte map, UTF-8 helpers;
* :mod:`~powerpy.tokenizer.merges`: pair merging for BPE (merge rank) and SPM (token score);
* :mod:`~powerpy.tokenizer.pieces`: token bytes and the decode-time space clean-up;
* :mod:`~powerpy.tokenizer.stream`: :class:`StreamDecoder`, streaming whole characters.
"""

from __future__ import annotations

from powerpy.tokenizer.pretokenize import supported_pre_tokenizers
from powerpy.tokenizer.specials import TokenAttr
from powerpy.tokenizer.stream import StreamDecoder
from powerpy.tokenizer.tokenizer import Tokenizer

__all__ = ["StreamDecoder", "TokenAttr", "Tokenizer", "supported_pre_tokenizers"]

"""One pipeline stage's view of a model file: layers [first, end) as a model of their own.

A model split by layer range (``powerpy.cluster``) runs each range as a stage, which loads,
places and runs only its own layers. :func:`stage_file` gives a stage a view of the open file in
which its layers are ``blk.0`` .. ``blk.{n-1}``, the per-layer keys (dense layers, cuts, windowed
layers) are its own, and the embeddings (first stage) and the output norm and head (last stage)
appear only where the stage runs them. The loader, the placement and the GPU index then see an
ordinary, smaller model; the ``Model`` built from it takes the residual stream (T, n_embd) where
it has no embeddings and returns it where it has no head (``Model._run``).

The view shares the file's mapping: no tensor is copied, and the pages of the other layers are
never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from powerpy.config import ModelArgs
from powerpy.errors import ModelConfigError
from powerpy.formats.constants import GPUIDX_SUFFIX, GGUFValueType, Keys, Names, bias_name
from powerpy.formats.gguf_reader import GGUFFile

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_EMBED = {Names.TOKEN_EMBD, Names.POS_EMBD}
_HEAD = {Names.OUTPUT_NORM, bias_name(Names.OUTPUT_NORM), Names.OUTPUT, bias_name(Names.OUTPUT)}
# the keys that hold one value per layer, or name layers: rewritten for the stage
_LAYER_KEYS = (Keys.DENSE_LAYERS, Keys.FFN_DOWN_THRESHOLD, Keys.SLIDING_WINDOW_PATTERN)
HASH_CHUNK = 64 << 20


def layer_span(layers: range) -> str:
    """``layers`` as users write them: first-last, inclusive (``range(40, 80)`` is "40-79")."""
    return f"{layers.start}-{layers.stop - 1}"


def check_layers(layers: range, n_layer: int, source: str = "model") -> None:
    """Raises ValueError unless ``layers`` is a non-empty run of the model's layers."""
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= n_layer:
        raise ValueError(
            f"{source}: layers {layers.start}-{layers.stop - 1} are not a range of the model's "
            f"{n_layer} layers (0-{n_layer - 1})"
        )


def stage_args(args: ModelArgs, layers: range) -> ModelArgs:
    """The hyperparameters of layers [first, end) as a model of their own, renumbered from 0:
    their count, and the per-layer lists (dense layers, cuts, windowed layers) cut to them."""
    check_layers(layers, args.n_layer)
    a = layers.start

    def own(ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(l - a for l in ids if l in layers)

    cuts = args.down_thresholds[layers.start : layers.stop]
    cuts = cuts if any(cuts) else ()  # all 0: no cut, as a file without the key reads
    return dataclasses.replace(
        args,
        n_layer=len(layers),
        dense_layers=own(args.dense_layers),
        down_thresholds=cuts,
        swa_layers=own(args.swa_layers),
    )


class StageFile(GGUFFile):
    """An open GGUF/PWRI file seen as the model of one layer range (see the module's text).

    Attributes:
        base: the whole file; it owns the mapping (closing the view leaves it open).
        layers: the range of the file's layers the view holds.
        ends: (the embeddings, the head) are in the view: the first and the last stage.
    """

    def __init__(self, base: GGUFFile, args: ModelArgs, layers: range) -> None:
        # the view shares every attribute of the open file, then narrows the header
        self.__dict__.update(base.__dict__)
        self.base, self.layers = base, layers
        self.ends = (layers.start == 0, layers.stop == args.n_layer)
        own = stage_args(args, layers)
        kv, types, items = dict(base.kv), dict(base.kv_types), dict(base.kv_array_types)
        for key in _LAYER_KEYS:
            for k in (key, key.format(arch=args.arch)):
                kv.pop(k, None), types.pop(k, None), items.pop(k, None)
        for key, spec in own.to_gguf_kv(vocab_size=True).items():
            kv[key], types[key] = spec[0], spec[1]
            if spec[1] is GGUFValueType.ARRAY:
                items[key] = spec[2]
        self.kv, self.kv_types, self.kv_array_types = kv, types, items
        embed, head = self.ends
        tied = Names.OUTPUT not in base.tensors and args.family.tied_output
        tensors = {}
        for name, t in base.tensors.items():
            m = _BLOCK.fullmatch(name)
            if m is not None:
                if int(m.group(1)) in layers:
                    new = f"blk.{int(m.group(1)) - layers.start}.{m.group(2)}"
                    tensors[new] = dataclasses.replace(t, name=new)
                continue
            if name == Names.TOKEN_EMBD and (embed or (head and tied)):
                tensors[name] = t
            elif (name in _EMBED and embed) or (name in _HEAD and head):
                tensors[name] = t
            elif name not in _EMBED and name not in _HEAD:
                tensors[name] = t  # RoPE factors and the like: every stage's
        self.tensors = tensors
        found = ModelArgs.from_gguf(self)
        if found != own:
            diff = [
                f.name
                for f in dataclasses.fields(own)
                if getattr(found, f.name) != getattr(own, f.name)
            ]
            raise ModelConfigError(
                f"{base.path}: layers {layer_span(layers)} do not read back as a model of their "
                f"own ({', '.join(diff)} differ); this architecture cannot be split there"
            )

    def close(self) -> None:
        """Nothing: the whole file owns the mapping."""

    def digest(self) -> str:
        """SHA-256 of the file's header (every key and tensor record) and of this stage's
        tensor bytes, in the view's order: two copies of a model give the same digest for a
        stage exactly when the header and that stage's tensors are the same bytes."""
        h = hashlib.sha256()
        h.update(self._data[: self.data_offset])  # the header: keys and tensor records
        for name in self.tensors:
            data = self.raw(name).reshape(-1)
            for s in range(0, data.size, HASH_CHUNK):
                h.update(data[s : s + HASH_CHUNK])
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"StageFile({self.path.name!r}, layers {layer_span(self.layers)})"


def stage_file(gf: GGUFFile, layers: range, args: ModelArgs | None = None) -> StageFile:
    """The view of ``gf`` holding layers ``layers`` (see :class:`StageFile`).

    Raises:
        ValueError: the range is not within the model's layers.
        ModelConfigError: the layers do not read back as a model (an architecture whose
            hyperparameters depend on the layer count in a way the keys cannot carry).
    """
    args = args or ModelArgs.from_gguf(gf)
    check_layers(layers, args.n_layer, str(gf.path))
    return StageFile(gf, args, layers)


def stage_index_path(model_path: str | os.PathLike[str], layers: range) -> Path:
    """Where a stage's GPU index lives: ``<model>.layers-A-B.generated.gpuidx`` beside the
    model (the whole model's is ``<model>.generated.gpuidx``)."""
    return Path(f"{os.fspath(model_path)}.layers-{layer_span(layers)}{GPUIDX_SUFFIX}")


@contextlib.contextmanager
def stage_activations(directory: str | os.PathLike[str], layers: range) -> Iterator[Path]:
    """A directory whose ``activation_{i}.pt`` are ``directory``'s files of the stage's layers
    (links, renumbered from 0), for the placement of one stage; ``directory`` itself when it
    does not exist (the placement then says so)."""
    src = Path(directory)
    if not src.is_dir():
        yield src
        return
    with tempfile.TemporaryDirectory(prefix="powerpy-stage-") as tmp:
        for i, l in enumerate(layers):
            target = src / f"activation_{l}.pt"
            if target.exists():
                os.symlink(target.resolve(), Path(tmp) / f"activation_{i}.pt")
        yield Path(tmp)

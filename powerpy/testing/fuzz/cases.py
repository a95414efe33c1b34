"""Structure-aware mutations of whole model inputs, for the load-path fuzzer (issue 13).

A case is ``(mutation, seed)``; a mutation belongs to one family (``FAMILIES``). ``prepare``
writes the case's files into a directory: a tiny model built with ``powerpy.testing`` and
``write_gguf`` (raw bytes written here when the writer refuses the mutation), plus a
``.generated.gpuidx`` or an ``activation/`` directory for the placement families. ``run``
takes them through read -> ``powerpy.load`` -> two generated tokens -> detokenize and returns
the outcome: ``"ok"``, ``"PowerpyError"`` or ``"NonFiniteError"``. Any other exception is a
library bug and propagates (``run_case`` is both).

The drafts and the raw writer are in ``files``, the model-file mutations in ``mutations``, the
gpuidx/statistics mutations and the issue's seed cases in ``side_files``, the Falcon and OPT
mutations (family "arch", on drafts of those families) and their seed cases in ``archs``, Gemma's
and Phi-3's in ``windowed``, the mixtures of experts' (family "moe") in ``experts`` and
``routing`` (DeepSeek-style routings and layer layouts), ``latent`` (DeepSeek-2's latent
attention, YaRN) and ``oss`` (GPT-OSS's sinks, biases, window and MXFP4 stacks). Used by
``tests/test_fuzz_path.py`` (hypothesis), ``tests/test_cli_errors.py`` and ``tools/fuzz.py``
(subprocesses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import powerpy.testing.fuzz.mutations  # noqa: F401 - registers the model-file mutations
from powerpy.testing.fuzz.archs import ARCH_SEED_CASES, SEED_ARCHS
from powerpy.testing.fuzz.experts import MOE_SEED_CASES, SEED_MOE_ARCHS, moe_draft
from powerpy.testing.fuzz.files import (
    BUDGET_GIB,
    FAMILIES,
    MODEL_FAMILIES,
    MUTATIONS,
    OUTCOMES,
    PROMPT,
    SPEC,
    Draft,
    arch_draft,
    base_draft,
    pick,
    write_draft,
)
from powerpy.testing.fuzz.latent import LATENT_SEEDS
from powerpy.testing.fuzz.oss import OSS_SEEDS
from powerpy.testing.fuzz.routing import ROUTING_SEEDS
from powerpy.testing.fuzz.side_files import SEED_CASES as SIDE_SEED_CASES
from powerpy.testing.fuzz.windowed import WINDOWED_SEED_ARCHS, WINDOWED_SEED_CASES

_MORE_MOE = {**ROUTING_SEEDS, **LATENT_SEEDS, **OSS_SEEDS}  # name -> (arch, fn)
ROUTING_SEED_CASES = {name: ("moe", fn) for name, (_, fn) in _MORE_MOE.items()}
SEED_CASES = {
    **SIDE_SEED_CASES,
    **ARCH_SEED_CASES,
    **WINDOWED_SEED_CASES,
    **MOE_SEED_CASES,
    **ROUTING_SEED_CASES,
}
SEED_MOE = {**SEED_MOE_ARCHS, **{name: arch for name, (arch, _) in _MORE_MOE.items()}}
SEED_DRAFTS = {**SEED_ARCHS, **WINDOWED_SEED_ARCHS}  # name -> (arch, draft seed)


class GeneratorError(Exception):
    """The generator itself failed to build a case (a bug here, not in the library)."""


PROMPTS = (PROMPT, PROMPT, "<s> a</s>", "日本語 ok\n", "  ", "\udcff\x00x")


# --- cases ----------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """The files of one case and how to load them; ``run`` fills ``errors``."""

    family: str
    mutation: str
    seed: int
    description: str
    model: Path
    load: dict[str, Any]
    index: Path | None = None  # .gpuidx written
    activation: Path | None = None  # activation dir written
    errors: list[str] = field(default_factory=list)  # messages of the PowerpyErrors raised
    prompt: str = PROMPT


def finish(d: Draft, family: str, name: str, seed: int, what: str, workdir: Path) -> Prepared:
    """Write draft ``d`` (and its side files) into ``workdir``; the case to ``run``."""
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / ("model.powerinfer.gguf" if d.sparse else "model.gguf")
    write_draft(model, d)
    p = Prepared(family, name, seed, what, model, dict(d.load))
    if d.gpuidx is not None:
        p.index = Path(str(model) + ".generated.gpuidx")
        d.gpuidx(model, p.index)
    if d.stats is not None:
        p.activation = workdir / "activation"
        d.stats(p.activation)
    if p.activation is not None or "vram_budget" in p.load:
        p.load.setdefault("activation_dir", workdir / "activation")
    return p


def prepare(name: str, seed: int, workdir: Path) -> Prepared:
    """Write the files of mutation ``name`` (a key of ``MUTATIONS``) with ``seed``."""
    family, fn = MUTATIONS[name]
    rng = np.random.default_rng(seed)
    sparse = family in ("predictor", "gpuidx", "stats") or bool(rng.random() < 0.7)
    archs = getattr(fn, "archs", None)  # the "arch" family's: the families it mutates
    experts = getattr(fn, "moe_archs", None)  # the "moe" family's
    if experts is not None:
        d = moe_draft(pick(rng, experts), seed=seed % 4, quantized=bool(rng.random() < 0.3))
        archs = experts
    elif archs is None:
        d = base_draft(sparse, seed=seed % 4)
    else:
        d = arch_draft(pick(rng, archs), sparse, seed=seed % 4)
    what = fn(d, rng)
    if archs is not None:
        what = f"{d.arch} {'PWRI' if d.sparse else 'GGUF'}: {what}"
    if (family in MODEL_FAMILIES or archs is not None) and rng.random() < 0.2:  # one more
        other = pick(rng, [m for m, (f, _) in MUTATIONS.items() if f in MODEL_FAMILIES])
        try:
            what += f" + {other}: {MUTATIONS[other][1](d, rng)}"
        except (StopIteration, ValueError, KeyError, IndexError, TypeError, OverflowError):
            what += f" + {other} (not applicable)"  # e.g. predictor edits on a dense model
    if family in ("tensors", "predictor", "alignment", "arch") and rng.random() < 0.3:
        d.load = {"vram_budget": BUDGET_GIB, "device": "cpu"}
        what += " (placed)"
    if "vram_budget" in d.load and rng.random() < 0.3:
        d.load["vram_budget"] = pick(rng, (0.0, 0.00005, 0.0002, 1.0))
        what += f" budget {d.load['vram_budget']} GiB"
    if not d.load and rng.random() < 0.2:
        d.load = pick(rng, ({"weight_format": "f32"}, {"dense": True}))
        what += f" {d.load}"
    p = finish(d, family, name, seed, what, workdir)
    p.prompt = pick(rng, PROMPTS)
    return p


def prepare_seed_case(name: str, workdir: Path) -> Prepared:
    """Write the files of one of the issue's seed cases (``SEED_CASES``)."""
    family, fn = SEED_CASES[name]
    arch = SEED_DRAFTS.get(name)  # (arch, seed) of the "arch" family's cases
    d = base_draft(True) if arch is None else arch_draft(arch[0], True, seed=arch[1])
    if name in SEED_MOE:
        d = moe_draft(SEED_MOE[name])
    fn(d)
    return finish(d, family, name, 0, name, workdir)


def run(p: Prepared) -> str:
    """read -> load -> two tokens -> detokenize; returns the outcome (see ``OUTCOMES``).

    Raises:
        Exception: anything that is not a ``PowerpyError`` (a library bug).
    """
    from powerpy import api
    from powerpy.errors import NonFiniteError, PowerpyError
    from powerpy.formats.gguf_reader import read_gguf

    side = None
    try:  # the side files on their own: they may only be refused with a PowerpyError
        if p.index is not None:
            from powerpy.formats.gpuidx import GpuIndex

            GpuIndex.read(p.index, n_layer=SPEC.n_layer, n_ff=SPEC.n_ff)
        if p.activation is not None:
            from powerpy.formats.stats import load_activation_stats

            load_activation_stats(p.activation, SPEC.n_layer, SPEC.n_ff)
    except PowerpyError as e:
        side = "PowerpyError"
        p.errors.append(str(e))
    try:
        with read_gguf(p.model):
            pass
        llm = api.load(p.model, **p.load)
        try:
            ids = [r.token for r in llm.stream(p.prompt, 2, temperature=0.8, seed=p.seed)]
            llm.detokenize(ids)
        finally:
            llm.file.close()
    except NonFiniteError as e:
        p.errors.append(str(e))
        return "NonFiniteError"
    except PowerpyError as e:
        p.errors.append(str(e))
        return "PowerpyError"
    return side or "ok"


def run_case(name: str, seed: int, workdir: Path) -> tuple[str, str]:
    """(outcome, description) of one case; other exceptions propagate with the description
    added as a note."""
    try:
        p = prepare(name, seed, workdir)
    except Exception as e:
        raise GeneratorError(f"{name} seed {seed}: {type(e).__name__}: {e}") from e
    try:
        return run(p), p.description
    except Exception as e:
        e.add_note(f"fuzz case {name} seed {seed}: {p.description}")
        raise


def families() -> dict[str, list[str]]:
    """family -> its mutation names."""
    out: dict[str, list[str]] = {f: [] for f in FAMILIES}
    for name, (family, _) in MUTATIONS.items():
        out[family].append(name)
    return out


__all__ = [
    "BUDGET_GIB",
    "FAMILIES",
    "MUTATIONS",
    "OUTCOMES",
    "SEED_CASES",
    "GeneratorError",
    "Prepared",
    "arch_draft",
    "base_draft",
    "families",
    "finish",
    "prepare",
    "prepare_seed_case",
    "run",
    "run_case",
]

"""The load-path fuzzer (issue 13): structure-aware mutations of tiny models, ``.gpuidx`` and
activation statistics files, and the harness that takes each case through read ->
``powerpy.load`` -> two generated tokens -> detokenize (``cases``). The drafts and the raw
writer are in ``files``, the model-file mutations in ``mutations``, the side-file mutations and
the issue's seed cases in ``side_files``, the Falcon and OPT mutations and seed cases in
``archs``.

Used by ``tests/test_fuzz_path.py``, ``tests/test_cli_errors.py`` and ``tools/fuzz.py``. It
drives the public API, so it sits above it: nothing in the library imports it, and neither
``import powerpy`` nor ``import powerpy.testing`` does.
"""

from powerpy.testing.fuzz.cases import (
    BUDGET_GIB,
    FAMILIES,
    MUTATIONS,
    OUTCOMES,
    SEED_CASES,
    GeneratorError,
    Prepared,
    arch_draft,
    base_draft,
    families,
    finish,
    prepare,
    prepare_seed_case,
    run,
    run_case,
)

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

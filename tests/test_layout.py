"""The architecture, checked from the source: the import graph of ``powerpy/`` and ``solver/``.

Every ``import`` counts, including the ones inside functions and under ``TYPE_CHECKING``: a lazy
import is still an arrow between modules.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("powerpy", "solver")

# Layers along the data flow, lowest first; a module imports only its own layer or lower ones.
LAYERS = [
    ("powerpy._fs", "powerpy._html", "powerpy.errors", "powerpy.formats"),
    ("powerpy.config", "powerpy.families", "powerpy.testing"),
    ("powerpy.tokenizer",),
    ("powerpy.model",),
    ("powerpy.placement",),
    (
        "powerpy.sampling",
        "powerpy.generate",
        "powerpy.chat",
        "powerpy.scheduler",
        "powerpy.structured",
    ),
    ("powerpy.pipeline",),
    ("powerpy.benchmark",),
    ("powerpy.default_model", "powerpy.api", "powerpy.plot", "powerpy.serve"),
    ("powerpy.cluster",),  # stages, pipelines and replicas over Ray (Ray only inside)
    ("powerpy.testing.fuzz",),  # drives powerpy.load; nothing in the library imports it
    ("powerpy.commands", "powerpy.cli", "powerpy.__main__"),
]
TRAINING = {"powerpy.pipeline.train"}
# Size is a signal, not a design rule: a module past WARN_LINES is reported (cut it where its
# concerns part, if they do); past FAIL_LINES it is an error. Never fold code to fit.
WARN_LINES = 600
FAIL_LINES = 1000
CSRC = ROOT / "powerpy" / "model" / "csrc"  # the native kernels (a few translation units)
CSRC_WARN_LINES = 800
CSRC_FAIL_LINES = 1200


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports (a ``from pkg import mod`` names the module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
        for t in targets:
            root = t.split(".")[0]
            if root in ("torch", "powerpy") and root not in MODULES:
                found.add(root)
    # the externals that matter for the solver rule
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found.add("torch")
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    """The layer of the most specific prefix of ``name`` (``powerpy.testing.fuzz`` is not in
    ``powerpy.testing``'s layer)."""
    found = [
        (len(p), i)
        for i, prefixes in enumerate(LAYERS)
        for p in prefixes
        if name == p or name.startswith(p + ".")
    ]
    if found:
        return max(found)[1]
    if name == "powerpy":
        return len(LAYERS) - 1  # the package facade: lazy names only
    raise AssertionError(f"{name} is in no layer: add it to LAYERS")


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen or m not in GRAPH:
            continue
        seen.add(m)
        todo.extend(GRAPH[m])
    return seen


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(GRAPH.get(m, ())):
            if n not in GRAPH:
                continue
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n] if n in stack else [m, n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_lower_layers_never_import_higher_ones() -> None:
    bad = [
        f"{m} (layer {_layer(m)}) imports {n} (layer {_layer(n)})"
        for m, deps in GRAPH.items()
        if m.startswith("powerpy")
        for n in deps
        if n.startswith("powerpy.") and _layer(n) > _layer(m)
    ]
    assert not bad, "\n".join(bad)


def test_solver_imports_neither_torch_nor_powerpy() -> None:
    for m, deps in GRAPH.items():
        if m.startswith("solver") and m != "solver.__main__":
            assert not {d for d in deps if d.split(".")[0] in ("torch", "powerpy")}, (m, deps)


def test_generation_does_not_import_training() -> None:
    """Generation never imports the training code, not even lazily."""
    reach = _closure("powerpy.generate")
    assert "powerpy.model.transformer" in reach
    assert not reach & TRAINING, sorted(reach & TRAINING)


def test_load_and_generate_do_not_import_training() -> None:
    """``pipeline.research.train_predictors`` imports the training code lazily: loading a model and
    generating never do, nor does the ``infer`` command's module (in a fresh interpreter)."""
    import subprocess
    import sys

    model = ROOT / "models" / "kjv-relu" / "kjv-relu.powerinfer.gguf"
    code = (
        "import sys, powerpy, powerpy.commands.infer\n"
        f"llm = powerpy.load({str(model)!r})\n"
        "llm.generate('And God said', max_tokens=2, temperature=0)\n"
        f"print(sorted(m for m in {sorted(TRAINING)!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


RAY_MODULES = {"powerpy.cluster.actors", "powerpy.cluster.replicas"}


def test_only_the_cluster_runtime_imports_ray() -> None:
    """Ray (the ``cluster`` extra) is imported by the modules that start actors and replicas
    only; ``import powerpy``, the CLI's parser and a server on one machine never load it."""
    import subprocess
    import sys

    users = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "ray" or n.startswith("ray.") for n in names):
                users.add(name)
    assert users == RAY_MODULES, users
    for m in RAY_MODULES:  # and nobody imports them but the cluster package and the commands
        importers = {n for n, deps in GRAPH.items() if m in deps}
        assert all(n.startswith(("powerpy.cluster", "powerpy.commands")) for n in importers)
    model = ROOT / "models" / "kjv-relu" / "kjv-relu.powerinfer.gguf"
    code = (
        "import sys, powerpy, powerpy.cli, powerpy.cluster.plan, powerpy.cluster.pipeline\n"
        "from powerpy.scheduler import Scheduler\n"
        "from powerpy.serve import create_app\n"
        "powerpy.cli.build_parser()\n"
        f"llm = powerpy.load({str(model)!r})\n"
        "create_app(Scheduler(llm.model, llm.tokenizer, llm.options))\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_fuzzer_stays_out_of_the_library() -> None:
    """``powerpy.testing.fuzz`` drives the public API from above: no other module of the package
    imports it, so neither ``import powerpy`` nor ``import powerpy.testing`` loads it."""
    fuzz = "powerpy.testing.fuzz"
    users = [
        m
        for m, deps in GRAPH.items()
        if not (m == fuzz or m.startswith(fuzz + "."))
        and any(d == fuzz or d.startswith(fuzz + ".") for d in deps)
    ]
    assert not users, users
    assert "powerpy.api" in _closure(fuzz)
    assert _layer("powerpy.testing.fuzz.cases") > _layer("powerpy.api") > _layer("powerpy.testing")


def _sizes(paths: dict[str, Path]) -> dict[str, int]:
    return {name: len(p.read_text(encoding="utf-8").splitlines()) for name, p in paths.items()}


def _check_sizes(sizes: dict[str, int], warn: int, fail: int) -> None:
    large = {name: n for name, n in sizes.items() if n > warn}
    if large:
        warnings.warn(f"over {warn} lines (cut where concerns part): {large}", stacklevel=2)
    too_big = {name: n for name, n in sizes.items() if n > fail}
    assert not too_big, f"over {fail} lines: {too_big}"


def test_modules_are_not_huge() -> None:
    _check_sizes(_sizes(MODULES), WARN_LINES, FAIL_LINES)


def test_no_code_is_folded_to_fit() -> None:
    """No formatter escapes: the code reads as the formatter lays it out."""
    marker = "fmt: " + "skip"
    folded = [n for n, p in MODULES.items() if marker in p.read_text(encoding="utf-8")]
    assert not folded, folded


def test_kernel_sources_are_not_huge() -> None:
    paths = {p.name: p for p in sorted(CSRC.iterdir()) if p.is_file()}
    assert any(p.suffix == ".cpp" for p in paths.values()), sorted(paths)
    _check_sizes(_sizes(paths), CSRC_WARN_LINES, CSRC_FAIL_LINES)


def test_the_graph_is_real() -> None:
    """The parser sees the arrows it should (guards the tests above against a silent no-op)."""
    assert "powerpy.model.transformer" in GRAPH["powerpy.api"] | _closure("powerpy.api")
    assert "powerpy.formats.gguf_reader" in _closure("powerpy.api")
    assert "torch" in GRAPH["powerpy.model.transformer"]
    assert "powerpy.pipeline.train" in _closure("powerpy.commands.train_predictors")

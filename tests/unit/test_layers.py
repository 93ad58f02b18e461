r"""The package's layers, checked on its import graph (every import statement of every module
under ``src/fedseg``, at the top of a file, inside a function or under ``TYPE_CHECKING``).

The folders of ``src/fedseg`` are the layers, lowest first (``docs/architecture.md`` draws the tree):

0. ``foundation/`` — errors, seeding, arrays, messages, config, device: torch and the standard library only;
1. ``models/``, ``data/``, ``evaluation/``, ``privacy/`` — networks, datasets, metrics and secure
   aggregation's protocol, knowing no run;
2. ``site/`` — one site's runtime (``workload``, ``runtime``; no file I/O);
3. ``seams/`` — the algorithm base (server half + site half), the transport protocol, and the run's
   files (``checkpoint``: atomic writes, the commit protocol, best models, site state files); the
   checkpoint sits here because each best-model record it reads and writes is a
   ``seams.algorithm.Candidate``; no algorithm imports it (see :data:`ALGORITHM_MAY_IMPORT`);
4. ``algorithms/`` — the methods;
5. ``execution/`` — the round loop (``engine``), what both ways of hosting a run share (``federation``: a
   run's data and plan; ``results``: its results files);
6. ``simulation/`` and ``deployment/``, side by side, neither importing the other — one process (a
   simulated federation: the in-process transport and its vectorized executor) and many machines (the
   remote transport: wire format, ``[deploy]`` settings, reply checks; the site and server mains; NVIDIA
   FLARE);
7. ``apps/`` — ``studies/``, ``report/``, ``predict/``, …;
8. ``cli.py`` (the dispatcher) and ``commands/`` (one module per verb).

A module imports only modules of its own layer or below, and never in a cycle; no two folders
import each other, directly or round a loop, at any depth of the tree.  An algorithm
imports torch, the standard library, the foundation, the site and other algorithms, nothing
else (no MONAI, no file formats, no engine).  Imports sit at the top of a file except those of a
heavy optional dependency deferred on purpose (:data:`DEFERRED`).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS: list[tuple[str, ...]] = [
    ("fedseg.foundation",),
    ("fedseg.models", "fedseg.data", "fedseg.evaluation", "fedseg.privacy"),
    ("fedseg.site",),
    ("fedseg.seams",),
    ("fedseg.algorithms",),
    ("fedseg.execution",),
    ("fedseg.simulation", "fedseg.deployment"),
    ("fedseg.apps",),
    ("fedseg.cli", "fedseg.commands", "fedseg"),
]
"""One entry per layer, lowest first: the folders (and ``cli.py``) of ``src/fedseg``.  A module's layer is
its folder's, so a new module's layer follows from where it is put."""

ALGORITHM_MAY_IMPORT = (
    *LAYERS[0],  # the foundation
    *LAYERS[2],  # the site: its runtime and the task's networks (e.g. Workload.selector)
    "fedseg.seams.algorithm",  # the Algorithm base the methods implement
    "fedseg.seams.transport",  # the Transport protocol, for ServerContext
    "fedseg.privacy",  # secure aggregation's protocol, run by the methods that sum
    "fedseg.algorithms",
)
ALGORITHM_THIRD_PARTY = ("torch",)

DEFERRED = (
    "nvflare",
    "mlflow",
    "ray",  # the cluster extra: --launcher ray | slurm
    "submitit",
    "fedseg.deployment.flare",  # imports nvflare
    "matplotlib",
    "PIL",
    "sklearn",
    "scipy",
    "skimage",
    "tensorboard",
    "torch.utils.tensorboard",
    "psutil",
    "monai",
    "nibabel",
    "fedseg.models",  # imports MONAI's networks
    "opacus",
    "SimpleITK",  # fedseg prepare's readers ([prepare] extra)
    "pydicom",
    "highdicom",
    "cryptography",  # the privacy extra
    "Crypto",  # pycryptodome, the privacy extra
)
"""Heavy optional dependencies a function may import when it needs them (a CLI command that
does not plot never pays for matplotlib)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "fedseg").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _target(name: str, node: ast.ImportFrom | ast.Import, alias: ast.alias) -> str:
    if isinstance(node, ast.Import):
        return alias.name
    base = node.module or ""
    if node.level:
        pkg = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    full = f"{base}.{alias.name}"
    return full if full in MODULES else base


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    """``{module: [(imported module, line, at top level)]}``."""
    out: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        nested: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    out[name].append((_target(name, node, alias), node.lineno, id(node) not in nested))
    return out


IMPORTS = _imports()


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if _within(module, p) and len(p) > best:
                best, rank = len(p), i
    assert rank >= 0, f"{module} is in no layer of tests/unit/test_layers.py: add it"
    return rank


def _internal(target: str) -> str | None:
    """The fedseg module an import names (``from fedseg.x import y`` where y is a name → fedseg.x)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_every_module_has_a_layer():
    for m in MODULES:
        layer_of(m)


def test_no_import_cycles():
    """Importing ``a.b.c`` first runs the ``__init__`` of every package above it (``a``, ``a.b``), so an
    import of ``a.b.c`` from outside ``a`` is an edge to ``a`` and ``a.b`` too: a package whose ``__init__``
    re-exports its modules then shows up in a cycle, as it would fail at import time
    (``ImportError: ... partially initialized module``).  A module importing a sibling inside its own
    package adds no edge to that package (the package is already being imported)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for t, *_ in IMPORTS[m]:
            u = _internal(t)
            if u is None or u == m:
                continue
            graph[m].add(u)
            parts = u.split(".")
            for i in range(2, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in MODULES and not _within(m, pkg):
                    graph[m].add(pkg)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in graph:
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_go_down_the_layers():
    bad = []
    for m, items in IMPORTS.items():
        for target, line, _ in items:
            t = _internal(target)
            if t is None or _within(m, t) or _within(t, m):
                continue
            if layer_of(t) > layer_of(m):
                bad.append(f"{MODULES[m].relative_to(SRC)}:{line} imports {t} (layer {layer_of(t)} > {layer_of(m)})")
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)


def test_algorithms_import_only_torch_and_the_site_facing_core():
    stdlib = sys.stdlib_module_names
    bad = []
    for m, items in IMPORTS.items():
        if not _within(m, "fedseg.algorithms"):
            continue
        for target, line, _ in items:
            top = target.split(".")[0]
            if top == "fedseg":
                ok = any(_within(target, p) for p in ALGORITHM_MAY_IMPORT)
            else:
                ok = top in stdlib or top == "__future__" or top in ALGORITHM_THIRD_PARTY
            if not ok:
                bad.append(f"{MODULES[m].relative_to(SRC)}:{line} imports {target}")
    assert not bad, "algorithms reach past the site-facing core:\n" + "\n".join(bad)


def test_imports_are_at_the_top_unless_deferred_on_purpose():
    bad = []
    for m, items in IMPORTS.items():
        for target, line, top in items:
            if not top and not any(_within(target, d) for d in DEFERRED):
                bad.append(f"{MODULES[m].relative_to(SRC)}:{line} imports {target} inside a function")
    assert not bad, (
        "move these imports to the top of their files (or add a heavy dependency to DEFERRED):\n" + "\n".join(bad)
    )


def test_files_are_the_checkpoint_modules_not_the_sites_or_the_engines():
    """The site and the engine hand arrays + JSON to ``seams.checkpoint``; neither writes a file format itself."""
    file_io = ("safetensors", "json", "os", "shutil", "pickle")
    bad = [
        f"{MODULES[m].relative_to(SRC)}:{line} imports {target}"
        for m in ("fedseg.site.runtime", "fedseg.execution.engine", "fedseg.simulation.inprocess")
        for target, line, _ in IMPORTS[m]
        if target.split(".")[0] in file_io
    ]
    assert not bad, "file I/O outside fedseg.seams.checkpoint:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", ["fedseg.site.runtime", "fedseg.seams.algorithm"])
def test_the_layer_checker_sees_a_violation(module, monkeypatch):
    """The checker is not vacuous: an upward import added to a low module is reported."""
    fake = [*IMPORTS[module], ("fedseg.execution.engine", 1, True)]
    monkeypatch.setitem(IMPORTS, module, fake)
    with pytest.raises(AssertionError, match="go up a layer"):
        test_imports_go_down_the_layers()


def test_simulation_and_deployment_do_not_import_each_other():
    """The two ways of hosting a run stand side by side on one floor: what both need (the engine, a run's data,
    its results files) lives below them in ``fedseg.execution``, so neither imports the other, even inside a
    function or under ``TYPE_CHECKING``."""
    rooms = ("fedseg.simulation", "fedseg.deployment")
    bad = [
        f"{MODULES[m].relative_to(SRC)}:{line} imports {t}"
        for m, items in IMPORTS.items()
        for here, there in (rooms, rooms[::-1])
        if _within(m, here)
        for target, line, _ in items
        if (t := _internal(target)) is not None and _within(t, there)
    ]
    assert not bad, "simulation and deployment import each other:\n" + "\n".join(bad)


EXECUTORS = ("fedseg.site.calls", "fedseg.site.dpsgd", "fedseg.simulation.vectorize", "fedseg.simulation.inprocess")
"""The modules that answer a site's requests: they compute from the call alone."""


def test_executors_never_reach_back_into_the_site():
    """A call is a complete request: no executor imports the site's runtime (even under ``TYPE_CHECKING``), and no
    function of the package takes a site typed loosely as ``site: Any`` that the type checker cannot follow."""
    bad = [
        f"{MODULES[m].relative_to(SRC)}:{line} imports {t}"
        for m, items in IMPORTS.items()
        if any(_within(m, e) for e in EXECUTORS)
        for target, line, _ in items
        if (t := _internal(target)) is not None and _within(t, "fedseg.site.runtime")
    ]
    loose = [
        f"{path.relative_to(SRC)}:{n}"
        for path in MODULES.values()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "site: Any" in line
    ]
    assert not bad and not loose, "\n".join(bad + loose)


def test_the_side_by_side_check_sees_an_import(monkeypatch):
    """The check is not vacuous: the deployed server taking a name from the simulation's runner is reported."""
    fake = [*IMPORTS["fedseg.deployment.server"], ("fedseg.simulation.runner.simulate", 1, False)]
    monkeypatch.setitem(IMPORTS, "fedseg.deployment.server", fake)
    with pytest.raises(AssertionError, match="import each other"):
        test_simulation_and_deployment_do_not_import_each_other()


def _folder_graph(parent: str) -> dict[str, set[str]]:
    """Import edges between the direct children of package ``parent`` (folders and modules)."""
    depth = parent.count(".") + 2
    children = {".".join(m.split(".")[:depth]) for m in MODULES if _within(m, parent) and m.count(".") >= depth - 1}
    graph: dict[str, set[str]] = {c: set() for c in children}
    for m, items in IMPORTS.items():
        if not _within(m, parent) or m == parent:
            continue
        src = ".".join(m.split(".")[:depth])
        for target, *_ in items:
            t = _internal(target)
            if t is None or not _within(t, parent) or t == parent:
                continue
            dst = ".".join(t.split(".")[:depth])
            if dst != src:
                graph[src].add(dst)
    return graph


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Kosaraju, small graphs)."""
    order: list[str] = []
    seen: set[str] = set()

    def forward(v: str) -> None:
        seen.add(v)
        for w in graph[v]:
            if w not in seen:
                forward(w)
        order.append(v)

    for v in graph:
        if v not in seen:
            forward(v)
    reverse: dict[str, set[str]] = {v: set() for v in graph}
    for v, ws in graph.items():
        for w in ws:
            reverse[w].add(v)
    assigned: set[str] = set()
    out = []
    for v in reversed(order):
        if v in assigned:
            continue
        comp, stack = [], [v]
        assigned.add(v)
        while stack:
            x = stack.pop()
            comp.append(x)
            for w in reverse[x]:
                if w not in assigned:
                    assigned.add(w)
                    stack.append(w)
        if len(comp) > 1:
            out.append(sorted(comp))
    return out


PACKAGES = sorted(m for m, p in MODULES.items() if p.name == "__init__.py")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_two_folders_import_each_other(package):
    """Inside every package, its sub-folders and modules form no loop of imports (``apps.report`` and
    ``apps.studies`` may not use each other both ways; nor may two top-level folders)."""
    loops = _loops(_folder_graph(package))
    assert not loops, f"folders of {package} that import each other, directly or round a loop: {loops}"


def test_the_folder_checker_sees_a_loop(monkeypatch):
    """The loop check is not vacuous: an import of the site from the foundation closes a loop."""
    fake = [*IMPORTS["fedseg.foundation.config"], ("fedseg.site.runtime", 1, True)]
    monkeypatch.setitem(IMPORTS, "fedseg.foundation.config", fake)
    assert any({"fedseg.foundation", "fedseg.site"} <= set(loop) for loop in _loops(_folder_graph("fedseg")))


def test_every_folder_is_one_layer():
    """Each top-level folder of ``src/fedseg`` is named in exactly one layer, so the tree is the layer diagram."""
    top = {p.name for p in (SRC / "fedseg").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    named = [p.removeprefix("fedseg.") for layer in LAYERS for p in layer if p.startswith("fedseg.")]
    assert sorted(top) == sorted(n for n in named if n != "cli"), (top, named)
    assert len(named) == len(set(named))


MAX_LINES = 500
ONE_CONCEPT = {}
"""Modules over :data:`MAX_LINES` lines, each one concept (the reason beside it)."""


def test_modules_are_small_unless_one_concept():
    """No module over ~500 lines unless it is one concept, named in :data:`ONE_CONCEPT` with the reason."""
    long = {str(p.relative_to(SRC)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = {p: n for p, n in long.items() if p not in ONE_CONCEPT}
    assert not unexplained, f"modules over {MAX_LINES} lines: split them or say in ONE_CONCEPT why not: {unexplained}"
    stale = sorted(set(ONE_CONCEPT) - set(long))
    assert not stale, f"ONE_CONCEPT lists modules no longer over {MAX_LINES} lines: {stale}"

"""The import structure: no cycles, and no module imports one of a higher layer.

Every ``import`` statement counts, also those inside functions (a lazy import
is still a dependency) and under ``TYPE_CHECKING``. The layers, lowest first,
are written once here and drawn in docs/architecture.md; a module's layer is
that of the longest pattern matching its name. A failure names the edge that
breaks the order, so the fix is to move code down or to pass what it needs in.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own layer and any below.
LAYERS = (
    ("foundation", ("cgx.errors", "cgx.version", "cgx.config")),
    ("terminal, wire format, launch", ("cgx.console", "cgx.quant", "cgx.launch", "cgx.timeline",
                                       "cgx.stats")),
    ("kernels", ("cgx.kernels", "cgx.quant.cpu")),
    ("quantization", ("cgx.quant.codec", "cgx.rules")),
    ("transports", ("cgx.comm",)),
    ("compressors", ("cgx.compression",)),
    ("collectives", ("cgx.collectives", "cgx.sufficient_factors")),
    ("runtime", ("cgx.runtime", "cgx.process_sets")),
    ("session", ("cgx.session", "cgx.capabilities")),
    ("levels and planner", ("cgx.policy.update_rule", "cgx.policy.levels", "cgx.policy.planner")),
    ("trials", ("cgx.policy.trials",)),
    ("policy", ("cgx.policy",)),
    ("exchange", ("cgx.exchange", "cgx.ops")),
    ("elastic", ("cgx.elastic",)),
    ("local steps", ("cgx.diloco",)),
    ("adapters", ("cgx.torch", "cgx.tensorflow", "cgx")),
    ("integrations", ("cgx.integrations",)),
    ("benchmarks", ("benchmarks",)),
)


# Known departures, to remove as the code moves (docs/architecture.md lists them too).
# A new cycle or upward edge fails; so does an entry here that no longer exists.
KNOWN_CYCLES: tuple = ()
KNOWN_UPWARD: dict = {}


def _modules() -> dict[str, Path]:
    mods = {}
    for base, prefix in (("cgx", "cgx"), ("kernels", "cgx.kernels"), ("benchmarks", "benchmarks")):
        for path in (ROOT / base).rglob("*.py"):
            rel = path.relative_to(ROOT / base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([prefix, *parts])] = path
    return mods


def _layer(module: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{module} has no layer: add it to LAYERS and docs/architecture.md"
    return found


def _imports(module: str, path: Path, mods: dict) -> set[str]:
    """The modules of ``mods`` that ``module`` imports (a package's own parents excluded)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                out.add(name)
    return out


def _graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert sorted(_cycles(_graph())) == sorted(list(c) for c in KNOWN_CYCLES)


def test_no_module_imports_a_higher_layer():
    names = [name for name, _ in LAYERS]
    bad = collections.defaultdict(list)
    graph = _graph()
    for module, deps in graph.items():
        for dep in deps:
            if _layer(dep) > _layer(module) and dep not in KNOWN_UPWARD.get(module, ()):
                bad[module].append(f"{dep} ({names[_layer(dep)]})")
    for module, deps in KNOWN_UPWARD.items():
        gone = deps - graph.get(module, set())
        assert not gone, f"{module} no longer imports {gone}: remove it from KNOWN_UPWARD"
    assert not bad, "upward imports (module in its layer -> higher one):\n" + "\n".join(
        f"  {m} ({names[_layer(m)]}) -> {', '.join(sorted(d))}" for m, d in sorted(bad.items()))


def test_the_checker_sees_a_cycle_and_an_upward_edge():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    assert _layer("cgx.comm.base") < _layer("cgx.torch.optimizer")
    assert _layer("cgx.quant.wire") < _layer("cgx.kernels.quantize") < _layer("cgx.quant.codec")


def test_every_package_ships():
    """A package missing from setup.cfg works in the editable install and is
    absent from a wheel: every folder with an __init__.py must be listed."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cgx").rglob("__init__.py")}
    found |= {"cgx.kernels"}
    assert found == listed, f"setup.cfg [options] packages differs: add {sorted(found - listed)}, " \
                            f"remove {sorted(listed - found)}"

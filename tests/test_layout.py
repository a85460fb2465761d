"""The package's layers hold: no module imports a layer above its own, and the sans-I/O
modules import no asyncio, socket, thread or clock (``p2ptrain/__init__.py`` draws the
layers; ``../shared/STYLE.md`` rule 1 says why)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "p2ptrain"

# Bottom to top: a module may import its own layer and those before it.
LAYERS = ["base", "codecs", "net", "collective", "cluster", "trainer", "integrations", "tasks", "commands"]
BASE_MODULES = {"errors", "identity", "trace", "device", "taskset", "waiting", "switches", "jit"}

SANS_IO = {
    "p2ptrain.net.wire", "p2ptrain.net.auth", "p2ptrain.net.beacon",
    "p2ptrain.collective.ring", "p2ptrain.collective.linkpace",
    "p2ptrain.cluster.membership", "p2ptrain.cluster.roundmsg", "p2ptrain.cluster.rounds", "p2ptrain.cluster.member",
    "p2ptrain.cluster.ending", "p2ptrain.cluster.refusals", "p2ptrain.cluster.takeover", "p2ptrain.cluster.used",
    "p2ptrain.cluster.leader", "p2ptrain.cluster.lineage", "p2ptrain.cluster.snapshot",
    "p2ptrain.cluster.fingerprint", "p2ptrain.cluster.settings", "p2ptrain.cluster.worth", "p2ptrain.cluster.silence", "p2ptrain.cluster.sync_every", "p2ptrain.trainer.pacing", "p2ptrain.trainer.solo",
} | {f"p2ptrain.codecs.{p.stem}" for p in (PACKAGE / "codecs").glob("*.py") if p.stem != "__init__"}
IO_MODULES = {"asyncio", "socket", "selectors", "threading", "concurrent", "time", "datetime", "uvloop"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(module: str) -> bool:
    """A subpackage's ``__init__``: judged by the modules an import names in it, not as one."""
    return MODULES[module].name == "__init__.py"


def layer_of(module: str) -> str | None:
    """The layer of ``p2ptrain.X...``; None for the package root (``__init__``, ``__main__``)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return None
    return "base" if parts[1] in BASE_MODULES else parts[1]


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module an import statement names, nested imports included, as (line, name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from p2ptrain.net import wire` names the module p2ptrain.net.wire.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if f"{node.module}.{alias.name}" in MODULES]
    return found


def test_every_module_sits_in_a_known_layer():
    unknown = {name for name in MODULES if layer_of(name) not in LAYERS + [None]}
    assert not unknown, f"modules outside the layers of p2ptrain/__init__.py: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer_of(n) is not None))
def test_no_module_imports_a_layer_above_its_own(name):
    own = LAYERS.index(layer_of(name))
    upward = [f"line {line}: {target}" for line, target in imports_of(MODULES[name])
              if target.startswith("p2ptrain.") and layer_of(target) is not None
              and LAYERS.index(layer_of(target)) > own]
    assert not upward, f"{name} ({LAYERS[own]}) imports a higher layer: {upward}"


@pytest.mark.parametrize("name", sorted(SANS_IO))
def test_sans_io_modules_import_no_io_and_no_clock(name):
    bad = [f"line {line}: {target}" for line, target in imports_of(MODULES[name])
           if target.split(".")[0] in IO_MODULES
           or (target.startswith("p2ptrain.") and target in MODULES and target not in SANS_IO
               and layer_of(target) != "base" and not is_package(target))]
    assert not bad, f"{name} is sans-I/O but imports {bad}"


def test_the_rules_catch_a_violation(tmp_path):
    """The checks above can fail: an upward import and a clock are both found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import time\ndef f():\n    from p2ptrain.trainer.peer import AsyncPeer\n")
    found = dict((target, line) for line, target in imports_of(bad))
    assert found == {"time": 1, "p2ptrain.trainer.peer": 3}
    assert LAYERS.index(layer_of("p2ptrain.trainer.peer")) > LAYERS.index(layer_of("p2ptrain.net.wire"))


# -- no import cycle, no module too long ------------------------------------------------------------------------

def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Each module's p2ptrain modules it imports, those under ``if TYPE_CHECKING:`` and inside
    functions included (a cycle hidden from the interpreter is one a reader still follows)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # (``from p2ptrain.x import y`` imports the module p2ptrain.x.y where there is one,
                # else a name of p2ptrain.x)
                subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                targets |= subs or {node.module}
                if len(subs) < len(node.names):
                    targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: the strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    """No module reaches itself through imports, ``TYPE_CHECKING`` ones included: each part can be
    read, and tested, from the modules below it."""
    cycles = cycles_of(import_graph(MODULES))
    assert not cycles, f"import cycles (break them with a module below both): {cycles}"


def test_the_cycle_check_finds_a_cycle_hidden_under_type_checking(tmp_path):
    files = {"p2ptrain.trainer.a": "from p2ptrain.trainer import b\n",
             "p2ptrain.trainer.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from p2ptrain.trainer.c import C\n",
             "p2ptrain.trainer.c": "def f():\n    from p2ptrain.trainer.a import A\n",
             "p2ptrain.trainer.d": "from p2ptrain.trainer import a\n"}
    modules = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        modules[name] = path
    assert cycles_of(import_graph(modules)) == [["p2ptrain.trainer.a", "p2ptrain.trainer.b", "p2ptrain.trainer.c"]]


MAX_LINES = 500  # a module past this is probably two things (STYLE.md rule 11)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_over_500_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines: split it (at most {MAX_LINES})"

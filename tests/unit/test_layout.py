"""The house rules of the layout (README "Layout"): dependencies point one way, with no import
loop, not even one closed by an import inside a function; the kernels know nothing of the
runtime; the trial runner's child process imports only public names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"tunecache": ROOT / "tunecache", "tunecache_kernels": ROOT / "kernels"}


def modules(package: str) -> dict[str, Path]:
    base = PACKAGES[package]
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def imported_names(path: Path, module: str) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for every import statement anywhere in the file:
    module level, inside functions, under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(target, a.name) for a in node.names]
    return out


def graph(package: str) -> dict[str, set[str]]:
    mods = modules(package)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for target, name in imported_names(path, m):
            for cand in (f"{target}.{name}" if name else None, target):
                if cand in mods and cand != m:
                    # importing a module of one's own package runs that package's __init__ too,
                    # but an __init__ that only names its modules is no loop: count what is named
                    edges[m].add(cand)
                    break
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_loop_closed_inside_a_function(tmp_path):
    """The check itself can fail: a loop whose one edge is an import inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import thing\n")
    (pkg / "c.py").write_text("from . import a\n")
    PACKAGES["pkg"] = pkg
    try:
        assert cycles(graph("pkg")) == [["pkg.a", "pkg.b"]]
    finally:
        del PACKAGES["pkg"]


def test_tunecache_has_no_import_loop():
    assert cycles(graph("tunecache")) == []


def test_the_kernels_have_no_import_loop():
    assert cycles(graph("tunecache_kernels")) == []


def test_the_trial_runners_child_imports_only_public_names():
    """`python -m tunecache.tuning.isolated_main` is a separate program: it may lean only on what
    the modules it imports offer everyone, not on their private helpers."""
    path = PACKAGES["tunecache"] / "tuning" / "isolated_main.py"
    private = [
        f"{target}.{name}"
        for target, name in imported_names(path, "tunecache.tuning.isolated_main")
        if target.startswith("tunecache") and name and name.startswith("_")
    ]
    assert private == []


def test_both_sides_of_the_fleet_offer_every_action_with_the_protocols_signature():
    """Every action of `Fleet` is implemented by the service's client and by a store reached
    directly, with the parameters the protocol declares (names, order, defaults)."""
    import inspect

    from tunecache.fleet.client import FleetClient
    from tunecache.fleet.protocol import Fleet
    from tunecache.fleet.store_fleet import StoreFleet

    actions = [n for n, v in vars(Fleet).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"publish", "claim", "heartbeat", "complete", "fail", "retry", "drop_job", "purge", "sync"} <= set(actions)

    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    for side in (FleetClient, StoreFleet):
        for name in actions:
            assert params(getattr(side, name)) == params(getattr(Fleet, name)), f"{side.__name__}.{name}"
        assert isinstance(side.where, property), f"{side.__name__}.where"


def test_the_kernels_import_nothing_from_tunecache():
    """`tunecache_kernels` is the layer below: settings reach it as arguments, so a kernel file
    is importable (and compiled, and versioned) without the runtime."""
    found = [
        f"{module} imports {target}"
        for module, path in modules("tunecache_kernels").items()
        for target, _ in imported_names(path, module)
        if target == "tunecache" or target.startswith("tunecache.")
    ]
    assert found == []

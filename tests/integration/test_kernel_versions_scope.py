"""Which kernel versions a kernels file moves: every backend's, for every shared module.

A kernel version hashes the backend's file and the kernels modules its globals reference
(tunecache's `_kernel_sources`, one level). So the modules the Gluon backends share are cut
by what they hold: one architecture's code (gluon_hopper, gluon_launch; gluon_blackwell), one
op's (gluon_matmul, gluon_dgrad, gluon_wgrad, gluon_packed_taps; dgrad_phases, which the portable
dgrad runs too), the code every Gluon backend runs (gluon_host, gluon_device, gluon_split_k),
and the portable backends' (portable_rules, portable_tiles). Here: each module is in exactly the
source sets it should be; every module a backend's code imports, directly or not, is in its
set (or is one that shapes the key rather than the kernel); and a real edit to a copy of the
kernels moves exactly the expected versions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("triton")

from support import ROOT, versions_after_edit
from tunecache.backends import _kernel_sources, backend_module
from tunecache.shapes import OPS
from tunecache_kernels.spaces import BACKENDS

KERNELS = ROOT / "kernels"
ALL = [f"{op}.{b}" for op in OPS for b in BACKENDS]
GLUON = [k for k in ALL if not k.endswith(".portable")]

# the backends each shared module's code runs in: an edit to it moves these versions, no others
SCOPE = {
    "gluon_hopper.py": {k for k in ALL if k.endswith(".hopper")},
    "gluon_launch.py": {k for k in ALL if k.endswith(".hopper")},
    "gluon_blackwell.py": {k for k in ALL if k.endswith(".blackwell")},
    "gluon_host.py": set(GLUON),
    "gluon_device.py": set(GLUON),
    "gluon_split_k.py": set(GLUON),
    "gluon_matmul.py": {k for k in GLUON if k.startswith("matmul.")},
    "gluon_dgrad.py": {k for k in GLUON if k.startswith("conv2d_dgrad.")},
    "gluon_wgrad.py": {k for k in GLUON if k.startswith("conv2d_wgrad.")},
    "gluon_packed_taps.py": {k for k in GLUON if k.startswith(("conv2d_fprop.", "conv2d_wgrad."))},
    "portable_rules.py": {k for k in ALL if k.endswith(".portable")},
    "portable_tiles.py": {f"{op}.portable" for op in ("matmul", "conv2d_fprop", "conv2d_dgrad")},
    "dgrad_phases.py": {k for k in ALL if k.startswith("conv2d_dgrad.")},
}

# Modules a backend may import without its version covering them: they shape the key's problem
# (problems, geometry: a problem's fields are in the key itself; geometry also holds the integer
# rounding, pow2_at_least, that the portable and Gluon rules share), are data the version covers
# otherwise (spaces: their fingerprint), or are hardware facts (hardware: fixed per architecture,
# and the device class is in the key).
NOT_KERNEL_CODE = {"problems.py", "geometry.py", "hardware.py", "spaces/__init__.py"} | {
    f"spaces/{b}.py" for b in BACKENDS
}


def _sources(kernel: str) -> set[str]:
    op, _, backend = kernel.partition(".")
    files = _kernel_sources(backend_module(op, backend))
    return {Path(f).resolve().relative_to(KERNELS.resolve()).as_posix() for f in files}


def _file(parts: list[str]) -> str | None:
    """The kernels file of module path `parts` (relative to the package), if it is one."""
    if parts and KERNELS.joinpath(*parts).with_suffix(".py").exists():
        return "/".join(parts) + ".py"
    if KERNELS.joinpath(*parts, "__init__.py").exists():
        return "/".join([*parts, "__init__.py"])
    return None


def _imports(rel: str) -> set[str]:
    """The kernels files `rel` imports (the package's relative imports, resolved)."""
    here = list(Path(rel).parent.parts)
    out = set()
    for node in ast.walk(ast.parse((KERNELS / rel).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:  # `from . import x`: x may be a module, else it is a name in one
                out.add(_file([*base, alias.name]) or _file(base))
    return out - {None}


def _closure(rel: str) -> set[str]:
    seen, todo = {rel}, [rel]
    while todo:
        for dep in _imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("module", sorted(SCOPE))
def test_a_shared_module_is_in_the_versions_of_exactly_the_backends_that_run_it(module):
    assert {k for k in ALL if module in _sources(k)} == SCOPE[module]


@pytest.mark.parametrize("kernel", ALL)
def test_a_version_covers_every_kernels_module_its_backend_runs(kernel):
    """The registry hashes one level of references: a module a backend reaches only through
    another (gluon_split_k through gluon_wgrad, say) must still be among its sources."""
    op, _, backend = kernel.partition(".")
    runs = _closure(f"{op}_{backend}.py") - NOT_KERNEL_CODE
    assert runs <= _sources(kernel), sorted(runs - _sources(kernel))


def test_every_shared_kernels_module_has_a_stated_scope():
    """A new module beside the backends says here which versions its edits move."""
    backends = {f"{k.replace('.', '_')}.py" for k in ALL}
    shared = {p.name for p in KERNELS.glob("*.py")} - backends - NOT_KERNEL_CODE - {"__init__.py", "backend.py"}
    assert shared == set(SCOPE)


# ---- a real edit, versions computed by a fresh process over a copy of the kernels ---------------


@pytest.fixture(scope="module")
def versions_after(tmp_path_factory):
    """edit (a file name, or None) -> every backend's version over a copy with that file edited."""
    return versions_after_edit(tmp_path_factory.mktemp("kernels"), ALL)


@pytest.mark.parametrize("edited", ["gluon_hopper.py", "gluon_dgrad.py"])
def test_an_edit_to_a_copy_moves_exactly_its_scope(versions_after, edited):
    before, after = versions_after(None), versions_after(edited)
    assert before.keys() == after.keys() == set(ALL)
    assert {k for k in ALL if before[k] != after[k]} == SCOPE[edited]

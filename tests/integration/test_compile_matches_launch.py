"""What the tuner compiles ahead (in its compile workers, for an explicit target) is what a
launch runs: the same Triton cache key, so a candidate's first launch loads the binary instead
of compiling it again in the trial runner, one at a time. Checked on the CPU for every Gluon
backend: each launch goes through the JIT's own argument binder and `_pack_args` up to the
point of compiling, and its source and options must hash as the backend's compile_specs do."""

from __future__ import annotations

import types

import pytest
import torch
from triton.compiler.compiler import ASTSource, make_backend
from triton.experimental.gluon import GluonASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature

from tunecache.tuning.compile import arch_of, device_for, spec_source, target_of
from tunecache_kernels import (
    conv2d_dgrad_blackwell,
    conv2d_dgrad_hopper,
    conv2d_fprop_blackwell,
    conv2d_fprop_hopper,
    conv2d_wgrad_blackwell,
    conv2d_wgrad_hopper,
    matmul_blackwell,
    matmul_hopper,
    problems,
)
from tunecache_kernels import gluon_host as gh
from tunecache_kernels import gluon_launch as direct
from tunecache_kernels import gluon_split_k as sk
from tunecache_kernels import gluon_wgrad as gwg

HOPPER = (matmul_hopper, conv2d_fprop_hopper, conv2d_wgrad_hopper, conv2d_dgrad_hopper)
BLACKWELL = (matmul_blackwell, conv2d_fprop_blackwell, conv2d_wgrad_blackwell, conv2d_dgrad_blackwell)


def _problems(op: str):
    if op == "matmul":
        yield problems.matmul_problem(torch.empty(256, 512), torch.empty(512, 384)) | {"dtype": "bfloat16"}
        yield problems.matmul_problem(torch.empty(77, 64), torch.empty(96, 64).t()) | {"dtype": "float16"}
        # decode: swapped on Hopper (c^T = b^T a^T), a row-major and a transposed weight
        yield problems.matmul_problem(torch.empty(1, 512), torch.empty(512, 384)) | {"dtype": "bfloat16"}
        yield problems.matmul_problem(torch.empty(16, 512), torch.empty(384, 512).t()) | {"dtype": "float16"}
        return
    # batch 1 at 7x7: few tiles, so the convs' SPLIT_K 0 launches the split binary and its reduction
    shapes = [(2, 9, 9, 64, 64, 3, 3, 1, 1), (2, 8, 8, 32, 96, 1, 1, 2, 0), (1, 7, 7, 512, 512, 3, 3, 1, 1)]
    if op == "conv2d_dgrad":  # the pointwise (tiled A, TMA store), a strided 3x3, the stem (Ci = 3)
        shapes += [(2, 8, 8, 64, 32, 1, 1, 1, 0), (2, 14, 14, 64, 64, 3, 3, 2, 1), (2, 16, 16, 3, 64, 7, 7, 2, 3)]
    else:  # few input channels: the packed-taps kernels (the stem; Ci = 4, Co padded for TMA)
        shapes += [(2, 16, 16, 3, 64, 7, 7, 2, 3), (1, 12, 12, 4, 40, 3, 3, 1, 1)]
    if op == "conv2d_wgrad":  # few output channels: the few-Co kernels (an image head; strided, Ci padded)
        shapes += [(1, 24, 24, 64, 3, 3, 3, 1, 1), (2, 16, 16, 36, 4, 3, 3, 2, 1)]
    for N, H, W, Ci, Co, R, S, st, pd in shapes:
        x = torch.empty(N, H, W, Ci, dtype=torch.bfloat16)
        if op == "conv2d_dgrad":
            P, Q = problems.out_size(H, R, st, pd), problems.out_size(W, S, st, pd)
            g = torch.empty(N, P, Q, Co, dtype=torch.bfloat16)
            yield problems.conv2d_dgrad_problem(g, torch.empty(Co, R, S, Ci, dtype=torch.bfloat16), H, W, st, pd)
        elif op == "conv2d_fprop":
            yield problems.conv2d_fprop_problem(x, torch.empty(Co, R, S, Ci, dtype=torch.bfloat16), st, pd)
        else:
            P, Q = problems.out_size(H, R, st, pd), problems.out_size(W, S, st, pd)
            yield problems.conv2d_wgrad_problem(x, torch.empty(N, P, Q, Co, dtype=torch.bfloat16), R, S, st, pd)


@pytest.fixture
def launches(monkeypatch):
    """Each JIT launch's (function, args, kwargs), stopped before it compiles; the device
    queries a launch makes answered as an H100 would (this host has no GPU)."""
    seen: list = []

    def run(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, kwargs))
        return None

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(direct, "direct_launch_enabled", lambda: False)
    monkeypatch.setattr(gh, "num_sms", lambda device=None: 132)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(sk, "zeroed_counters", lambda dev, stream, n: torch.zeros(max(n, 1), dtype=torch.int32))
    return seen


def _launch_keys(seen: list, arch: str) -> list[tuple[str, str, str]]:
    backend = make_backend(target_of(arch))
    keys = []
    for fn, args, kwargs in seen:
        kwargs = dict(kwargs, debug=False)
        bound, specialization, opts = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
        src = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, signature, constexprs, attrs)
        keys.append((fn.__name__, src.hash(), options.hash()))
    return keys


def _spec_keys(specs, arch: str) -> list[tuple[str, str, str]]:
    backend = make_backend(target_of(arch))
    keys = []
    for spec in specs:
        src, options = spec_source(spec, arch)
        keys.append((spec.fn.__name__, src.hash(), backend.parse_options(dict(options, **src.parse_options())).hash()))
    return keys


@pytest.mark.parametrize("mod", HOPPER + BLACKWELL, ids=lambda m: m.KERNEL)
def test_a_launch_finds_what_the_tuner_compiled(mod, launches, monkeypatch):
    device = device_for("sm_90a" if mod in HOPPER else "sm_100a")
    monkeypatch.setattr(gh, "num_sms", lambda dev=None: gh.sm_count_of(device))  # the compile's SMs
    arch = arch_of(device)
    checked = splits = 0
    for p in _problems(mod.OP):
        candidates = mod.prune(mod.config_space(p, device), p, device)
        # a spread of the candidates, every kind of launch among them (split-K and stream-K too)
        few_co = [c for c in candidates if mod.OP == "conv2d_wgrad" and gwg.runs_few_co(p, c, mod.FEW_CO_NARROWEST)]
        split = [c for c in candidates if c.get("SPLIT_K") == 0][:2]
        for config in candidates[:: max(1, len(candidates) // 8)] + candidates[-3:] + few_co[:2] + few_co[-2:] + split:
            launches.clear()
            mod.launch(config, *mod.inputs(p, "cpu"))
            assert _launch_keys(launches, arch) == _spec_keys(mod.compile_specs(p, config, device), arch), config
            checked += 1
            splits += len(launches) > 1  # a second launch: the split reduction
    assert checked >= 8
    if mod.OP in ("conv2d_fprop", "conv2d_dgrad"):
        assert splits, "no split launch (the kernel and its reduction) was checked"

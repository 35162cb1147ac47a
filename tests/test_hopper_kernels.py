"""The Hopper (sm_90a) Gluon backends: their spaces and pruning on the CPU, a sample of their
configs compiled for sm_90a on the CPU, and, on an sm_90 GPU, their results against PyTorch
over grids like the seeds' tests (strides 1-3, paddings 0-1, filters 1x1 to 5x5, odd channel
counts, batch 1 and 128, asymmetric stride; matmul with odd M/N/K and both layouts)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tunecache.key import DeviceClass
from tunecache_kernels import conv2d_fprop_hopper as fprop
from tunecache_kernels import conv2d_wgrad_hopper as wgrad
from tunecache_kernels import gluon_host as gh
from tunecache_kernels import gluon_launch as direct
from tunecache_kernels import matmul_hopper as mm
from tunecache_kernels import problems
from tunecache_kernels.spaces import space_for

H100 = DeviceClass("sm_90", 132, "NVIDIA H100 80GB HBM3")
B200 = DeviceClass("sm_100", 148, "NVIDIA B200")
MODULES = (mm, fprop, wgrad)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _problems():
    """A few problems per op, meta tensors only (shapes are all the CPU tests need)."""
    yield mm, problems.matmul_problem(_meta(4096, 4096), _meta(4096, 4096))
    yield mm, problems.matmul_problem(_meta(128, 8192), _meta(8192, 8192))
    yield mm, problems.matmul_problem(_meta(77, 33, dtype=torch.float16), _meta(65, 33, dtype=torch.float16).t())
    for (N, H, W, Ci, Co, R, S, st, pd) in [(128, 56, 56, 64, 64, 3, 3, 1, 1), (128, 14, 14, 1024, 256, 1, 1, 1, 0),
                                            (3, 15, 17, 5, 7, 5, 5, (2, 1), (1, 0))]:
        x = _meta(N, H, W, Ci)
        yield fprop, problems.conv2d_fprop_problem(x, _meta(Co, R, S, Ci), st, pd)
        sh, sw = st if isinstance(st, tuple) else (st, st)
        ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
        P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
        yield wgrad, problems.conv2d_wgrad_problem(x, _meta(N, P, Q, Co), R, S, st, pd)


PROBLEMS = list(_problems())


# ---- CPU: spaces, pruning, defaults --------------------------------------------------------------


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.KERNEL)
def test_space_is_registered_plain_data(mod):
    space = space_for(mod.KERNEL)
    assert len(space) > 0
    for cfg in space:
        for v in cfg.values():
            assert type(v) in (int, bool, str)
        assert "num_warps" in cfg and "num_stages" in cfg


@pytest.mark.parametrize("mod,p", PROBLEMS, ids=lambda x: getattr(x, "KERNEL", None))
def test_pruned_configs_fit_shared_memory_and_stay_in_space(mod, p):
    space = space_for(mod.KERNEL)
    kept = mod.prune(mod.config_space(p, H100), p, H100)
    assert kept, f"every config pruned for {p}"
    for c in kept:
        space.check(c)
        assert mod.smem_bytes(c) <= gh.SMEM_LIMIT_BYTES
        # the accumulator must fit the register file without spilling
        assert c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"]) <= 128


@pytest.mark.parametrize("mod,p", PROBLEMS, ids=lambda x: getattr(x, "KERNEL", None))
def test_default_config_is_in_space_and_survives_pruning(mod, p):
    c = mod.default_config(p, H100)
    space_for(mod.KERNEL).check(c)
    assert c in mod.prune([c], p, H100)


def test_prune_rejects_configs_over_shared_memory():
    p = PROBLEMS[0][1]
    big = {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 6}
    assert mm.smem_bytes(big) > gh.SMEM_LIMIT_BYTES
    assert mm.prune([big], p, H100) == []


def test_prune_keeps_the_seed_hopper_config():
    # the tutorial's best Hopper matmul: 128x256x64, 3 buffers, 8 warps (~208 KB of smem)
    p = PROBLEMS[0][1]
    c = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    assert mm.prune([c], p, H100) == [c]


@pytest.mark.parametrize("mod,p", PROBLEMS, ids=lambda x: getattr(x, "KERNEL", None))
def test_supports_only_sm90_half_precision(mod, p):
    assert mod.supports(p, H100)
    assert not mod.supports(p, B200)
    assert not mod.supports({**p, "dtype": "float32"}, H100)
    assert not mod.supports(p, DeviceClass("cpu", 0))


def test_wgrad_split_plan_never_launches_empty_splits():
    for k_iters, split in itertools.product((1, 5, 63, 64, 65, 1000), (1, 2, 4, 8, 16, 32)):
        active, per = gh.split_k_plan(k_iters, split)
        assert 1 <= active <= split
        assert active * per >= k_iters > (active - 1) * per


def _seed_wgrad_problem():
    # the seeds' 384-channel 64x64 3x3 layer at batch 128: 81 output tiles of 128x128
    return problems.conv2d_wgrad_problem(_meta(128, 64, 64, 384), _meta(128, 64, 64, 384), 3, 3, 1, 1)


def test_wgrad_auto_split_fills_whole_waves():
    # one split leaves 51 of 132 SMs idle and two leave a 30-unit second wave: SPLIT_K=0 picks
    # a count whose units fill the SMs' waves at least 95%
    c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 0, "num_warps": 8, "num_stages": 4}
    w = wgrad.Work.of(_seed_wgrad_problem(), c, 132)
    units = w.tiles * w.splits
    assert w.tiles == 81 and w.splits > 1
    assert units / (-(-units // 132) * 132) >= 0.95


@pytest.mark.parametrize("sms", [132, 114, 7])
def test_wgrad_stream_k_gives_every_cta_an_equal_run(sms):
    p = problems.conv2d_wgrad_problem(_meta(128, 7, 7, 512), _meta(128, 7, 7, 512), 3, 3, 1, 1)
    for bn in (64, 128, 256):
        c = {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": wgrad.STREAM_K, "num_warps": 8,
             "num_stages": 4}
        w = wgrad.Work.of(p, c, sms)
        total = w.tiles * w.k_steps
        assert w.stream and w.ctas <= sms and w.splits == 1
        assert w.ctas * w.per >= total > (w.ctas - 1) * w.per  # every CTA has work, all work is covered
        assert w.per - total / w.ctas < 1 + total / w.ctas / 100  # balanced to about 1%


def test_im2col_geometry_limits():
    # corners within the descriptor's signed 8-bit range; element strides 1..8
    assert gh.im2col_ok(56, 56, 56, 56, (1, 1), (1, 1))
    assert not gh.im2col_ok(64, 64, 7, 7, (9, 9), (0, 0))
    lower, upper = gh.im2col_pixel_box(16, 16, 8, 8, (2, 2), (1, 1))
    assert lower == [-1, -1] and upper == [7 * 2 + 1 - 16 - 1] * 2


def test_descriptor_signatures_parse():
    from triton.language import str_to_ty

    t = str_to_ty(gh.desc_sig("bfloat16", [128, 64]), None)
    assert list(t.block_type.shape) == [128, 64]
    t = str_to_ty(gh.im2col_desc_sig("float16", [64, 32]), None)
    assert list(t.block_type.shape) == [64, 32] and len(t.shape_type.types) == 4


# ---- CPU: a sample of configs compiles for sm_90a (the CI test compiles them all) ---------------


def _sample(mod, p, n=3):
    kept = mod.prune(mod.config_space(p, H100), p, H100)
    picks = [mod.default_config(p, H100), kept[0], kept[-1], kept[len(kept) // 2]]
    out = []
    for c in picks:
        if c not in out:
            out.append(c)
    return out[:n + 1]


@pytest.mark.parametrize("mod,p", [PROBLEMS[0], PROBLEMS[2], PROBLEMS[3], PROBLEMS[4], PROBLEMS[5]],
                         ids=lambda x: getattr(x, "KERNEL", None))
def test_sample_configs_compile_for_sm90a(mod, p):
    from tunecache.compile import compile_in_fresh_processes

    jobs, is_reduce = [], []
    for c in _sample(mod, p, n=1):
        for i, spec in enumerate(mod.compile_specs(p, c, H100)):
            jobs.append((mod, p, c, i))
            is_reduce.append(spec.fn is gh.split_k_reduce_kernel)
    # fresh processes: earlier tests may have run the CPU interpreter in this one
    for (_, _, c, _), reduce, out in zip(jobs, is_reduce, compile_in_fresh_processes(jobs, H100, "sm_90a")):
        assert out["shared"] <= gh.SMEM_LIMIT_BYTES, (c, out["shared"])
        if not reduce:
            assert "wgmma.mma_async" in out["asm"]["ptx"], c


# ---- GPU: results against PyTorch --------------------------------------------------------------

_has_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
gpu = pytest.mark.skipif(not _has_sm90, reason="needs a CUDA sm_90 GPU (H100/H200)")


def _rel_err(out, ref):
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item()


def _poison(numel, dtype):
    """Leave NaNs where the next allocation of this size will land, so an element the kernel
    never writes shows up as NaN instead of a stale right answer."""
    t = torch.full((numel,), float("nan"), device="cuda", dtype=dtype)
    del t


def _check(out, ref, tol):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "unwritten (NaN) output elements"
    err = _rel_err(out, ref)
    assert err < tol, f"relative error {err:.3g}"


MATMUL_CASES = [
    (256, 256, 256), (1000, 1000, 2000), (333, 517, 129), (77, 65, 33), (1, 4096, 64), (4096, 8, 256),
    (2049, 1023, 1536), (128, 8192, 512),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layouts", ["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("M,N,K", MATMUL_CASES)
def test_matmul_matches_torch(M, N, K, layouts, dtype):
    torch.manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    if layouts[0] == "c":
        a = a.t().contiguous().t()
    if layouts[1] == "c":
        b = b.t().contiguous().t()
    p = mm.problem(a, b)
    ref = (a.float() @ b.float())
    dev = DeviceClass("sm_90", gh.num_sms(0))
    configs = [mm.default_config(p, dev),
               {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}]
    for c in configs:
        _poison(M * gh.round_up(N, 8), dtype)
        _check(mm.launch(c, a, b), ref, 1e-2)


# the seeds' grid: batch 1 and 128, two spatial sizes, three channel pairings, four filters,
# strides 1-3, paddings 0-1 (the batch-128 half on the smaller channel pairing)
CONV_GRID = [
    (N, H, W, Ci, Co, R, S, st, pd)
    for N in (1, 128)
    for H, W in ((64, 64), (64, 32))
    for Ci, Co in (((128, 128), (384, 384), (128, 384)) if N == 1 else ((128, 128),))
    for R, S in ((1, 1), (2, 2), (3, 3), (1, 3))
    for st in (1, 2, 3)
    for pd in (0, 1)
]
CONV_EXTRA = [
    (16, 32, 32, 5, 96, 3, 3, 1, 1),  # Ci padded for TMA
    (3, 15, 17, 5, 7, 3, 3, 2, 1),  # odd everything
    (4, 20, 12, 40, 200, 5, 5, (1, 2), (1, 0)),  # 5x5, asymmetric stride and padding
    (16, 1, 8, 96, 128, 1, 2, (1, 2), 0),  # asymmetric stride, one-row image
    (16, 2, 2, 512, 768, 2, 2, (2, 2), 0),  # small spatial
    (2, 9, 9, 3, 13, 5, 5, 1, 1),  # 5x5 over 3 channels
    (128, 14, 14, 1024, 256, 1, 1, 1, 0),  # 1x1 pointwise (tiled, no im2col)
]


def _conv_ids(case):
    return "x".join(str(v).replace(" ", "") for v in case)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CONV_GRID + CONV_EXTRA, ids=_conv_ids)
def test_conv2d_fprop_matches_torch(case):
    N, H, W, Ci, Co, R, S, st, pd = case
    torch.manual_seed(hash(case) % 1000)
    x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16)
    p = fprop.problem(x, w, st, pd)
    dev = DeviceClass("sm_90", gh.num_sms(0))
    ref = fprop.reference(x.float(), w.float(), st, pd)
    configs = [fprop.default_config(p, dev)]
    if case in CONV_EXTRA or (N == 1 and R == 3 and Ci == 128 and Co == 384):
        configs += [c for c in ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4,
                                 "num_stages": 2},
                                {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8,
                                 "num_stages": 3}) if fprop.resources_ok(c)]
    for c in configs:
        _poison(p["gemm_M"] * gh.round_up(Co, 8), torch.bfloat16)
        _check(fprop.launch(c, x, w, st, pd), ref, 1e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", CONV_GRID + CONV_EXTRA, ids=_conv_ids)
def test_conv2d_wgrad_matches_torch(case):
    N, H, W, Ci, Co, R, S, st, pd = case
    torch.manual_seed(hash(case) % 1000 + 1)
    x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
    sh, sw = st if isinstance(st, tuple) else (st, st)
    ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
    P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
    g = torch.randn(N, P, Q, Co, device="cuda", dtype=torch.bfloat16)
    p = wgrad.problem(x, g, R, S, st, pd)
    dev = DeviceClass("sm_90", gh.num_sms(0))
    ref = wgrad.reference(x.float(), g.float(), R, S, st, pd)
    base = wgrad.default_config(p, dev)
    configs = [base, dict(base, SPLIT_K=1), dict(base, SPLIT_K=wgrad.STREAM_K)]
    if case in CONV_EXTRA:
        small = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}
        configs += [small, dict(small, SPLIT_K=wgrad.STREAM_K)]
    for c in configs:
        _poison(Co * R * S * gh.round_up(Ci, 8), torch.bfloat16)
        _check(wgrad.launch(c, x, g, R, S, st, pd), ref, 1e-2)


@gpu
@pytest.mark.gpu
def test_wgrad_split_k_is_deterministic():
    torch.manual_seed(0)
    x = torch.randn(32, 28, 28, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(32, 28, 28, 128, device="cuda", dtype=torch.bfloat16)
    for split in (16, wgrad.STREAM_K):
        c = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}
        first = wgrad.launch(c, x, g, 3, 3, 1, 1)
        for _ in range(3):
            assert torch.equal(wgrad.launch(c, x, g, 3, 3, 1, 1), first)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_conv_fp16_and_bf16(dtype):
    torch.manual_seed(1)
    x = torch.randn(8, 20, 20, 64, device="cuda", dtype=dtype)
    w = torch.randn(96, 3, 3, 64, device="cuda", dtype=dtype)
    dev = DeviceClass("sm_90", gh.num_sms(0))
    p = fprop.problem(x, w, 2, 1)
    y = fprop.launch(fprop.default_config(p, dev), x, w, 2, 1)
    assert y.dtype == dtype
    _check(y, fprop.reference(x.float(), w.float(), 2, 1), 1e-2)
    g = torch.randn_like(y)
    pw = wgrad.problem(x, g, 3, 3, 2, 1)
    gw = wgrad.launch(wgrad.default_config(pw, dev), x, g, 3, 3, 2, 1)
    assert gw.dtype == dtype
    _check(gw, wgrad.reference(x.float(), g.float(), 3, 3, 2, 1), 1e-2)


# ---- direct launches: a (config, problem)'s second and later launches skip JITFunction.run ------


def test_plan_key_parts_reject_what_pair_must_check():
    assert direct.int_pair_key(2) == (2, 2) and direct.int_pair_key((1, 2)) == (1, 2)
    for v in (True, [1, 2], (1,), (1, 2, 3), (1.0, 2), (True, 1), "1"):
        assert direct.int_pair_key(v) is None, v
    assert direct.config_key({"a": 1, "b": 2}) != direct.config_key({"a": 1, "b": 3})


def _no_jit(monkeypatch, *fns):
    """Make JITFunction.run fail for `fns`: a launch must then go through its plan."""
    def boom(*a, **k):
        raise AssertionError("JITFunction.run called on a planned launch")
    for fn in fns:
        monkeypatch.setattr(fn, "run", boom)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layouts", ["rr", "cc"])
def test_matmul_direct_launch_matches_torch_on_new_data(monkeypatch, layouts):
    M, N, K = 333, 517, 129  # N padded for TMA: the output is sliced
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}

    def operands(seed):
        torch.manual_seed(seed)
        a = torch.randn(M, K, device="cuda", dtype=torch.float16)
        b = torch.randn(K, N, device="cuda", dtype=torch.float16)
        if layouts[0] == "c":
            a = a.t().contiguous().t()
        if layouts[1] == "c":
            b = b.t().contiguous().t()
        return a, b

    a, b = operands(0)
    _check(mm.launch(c, a, b), a.float() @ b.float(), 1e-2)  # JIT: builds the plan
    _no_jit(monkeypatch, mm.matmul_kernel)
    for seed in (1, 2, 3):
        del a, b  # the next operands may land at the freed addresses: cached maps stay right
        a, b = operands(seed)
        _poison(M * gh.round_up(N, 8), torch.float16)
        _check(mm.launch(c, a, b), a.float() @ b.float(), 1e-2)
    # a plan built on aligned operands, then a base address TMA cannot take: copied, still right
    if layouts == "rr":
        a2 = torch.randn(256, 256, device="cuda", dtype=torch.float16)
        b2 = torch.randn(256, 256, device="cuda", dtype=torch.float16)
        monkeypatch.undo()
        mm.launch(c, a2, b2)
        _no_jit(monkeypatch, mm.matmul_kernel)
        flat = torch.randn(256 * 256 + 1, device="cuda", dtype=torch.float16)
        a3 = flat[1:].view(256, 256)  # 2 bytes past a 16-byte boundary
        assert a3.data_ptr() % 16
        _check(mm.launch(c, a3, b2), a3.float() @ b2.float(), 1e-2)
    # another config of the same problem has no plan yet: it goes to the JIT (here: fails)
    with pytest.raises(AssertionError, match="planned launch"):
        mm.launch(dict(c, GROUP_M=8), a, b)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("case", [(3, 15, 17, 5, 7, 3, 3, 2, 1), (4, 20, 12, 40, 200, 5, 5, (1, 2), (1, 0)),
                                  (8, 14, 14, 64, 96, 1, 1, 1, 0)], ids=_conv_ids)
def test_conv_direct_launch_matches_torch_on_new_data(monkeypatch, case):
    N, H, W, Ci, Co, R, S, st, pd = case
    cf = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    cw = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}
    cw1 = dict(cw, SPLIT_K=1)
    cws = dict(cw, SPLIT_K=wgrad.STREAM_K)

    def data(seed):
        torch.manual_seed(seed)
        x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16)
        y = fprop.reference(x.float(), w.float(), st, pd)
        g = torch.randn(y.shape, device="cuda", dtype=torch.bfloat16)
        return x, w, g

    def check_all(x, w, g):
        _check(fprop.launch(cf, x, w, st, pd), fprop.reference(x.float(), w.float(), st, pd), 1e-2)
        ref_w = wgrad.reference(x.float(), g.float(), R, S, st, pd)
        _check(wgrad.launch(cw, x, g, R, S, st, pd), ref_w, 1e-2)
        _check(wgrad.launch(cw1, x, g, R, S, st, pd), ref_w, 1e-2)
        _check(wgrad.launch(cws, x, g, R, S, st, pd), ref_w, 1e-2)

    check_all(*data(0))  # JIT: builds the plans
    _no_jit(monkeypatch, fprop.conv2d_fprop_kernel, wgrad.conv2d_wgrad_kernel, gh.split_k_reduce_kernel)
    for seed in (1, 2):
        check_all(*data(seed))
    # the same problem with stride given as a tuple shares the plan; a bool stride still raises
    x, w, g = data(3)
    sh, sw = st if isinstance(st, tuple) else (st, st)
    ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
    _check(fprop.launch(cf, x, w, (sh, sw), (ph, pw)), fprop.reference(x.float(), w.float(), st, pd), 1e-2)
    with pytest.raises((TypeError, AssertionError)):
        fprop.launch(cf, x, w, True, pd)


@gpu
@pytest.mark.gpu
def test_direct_launch_off_switch_and_hooks_use_the_jit(monkeypatch):
    from triton import knobs

    a = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    mm.launch(c, a, b)
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda md: seen.append(md))
    _check(mm.launch(c, a, b), a.float() @ b.float(), 1e-2)
    assert seen, "a launch hook must see the launch (JIT path)"

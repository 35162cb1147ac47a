"""The Hopper (sm_90a) Gluon backends on an sm_90 GPU: their results against PyTorch over grids
like the seeds' tests (strides 1-3, paddings 0-1, filters 1x1 to 5x5, odd channel counts, batch
1 and 128, asymmetric stride; matmul with odd M/N/K and both layouts), and direct launches. Their
spaces, pruning and compiles on the CPU are in tests/integration/test_hopper_spaces.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from tunecache.key import DeviceClass
from tunecache_kernels import conv2d_dgrad_hopper as dgrad
from tunecache_kernels import conv2d_fprop_hopper as fprop
from tunecache_kernels import conv2d_wgrad_hopper as wgrad
from tunecache_kernels import gluon_host as gh
from tunecache_kernels import gluon_launch as direct
from tunecache_kernels import gluon_packed_taps as gpt
from tunecache_kernels import gluon_split_k as sk
from tunecache_kernels import gluon_wgrad as gwg
from tunecache_kernels import matmul_hopper as mm
from tunecache_kernels import problems

# ---- GPU: results against PyTorch --------------------------------------------------------------

_has_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_sm90, reason="needs a CUDA sm_90 GPU (H100/H200)")]


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


@pytest.fixture
def dev() -> DeviceClass:
    """The GPU's device class as the ops key it: sm_90 and its SM count."""
    return DeviceClass("sm_90", gh.num_sms(0))


MATMUL_CASES = [
    (256, 256, 256),
    (1000, 1000, 2000),
    (333, 517, 129),
    (77, 65, 33),
    (1, 4096, 64),
    (4096, 8, 256),
    (2049, 1023, 1536),
    (128, 8192, 512),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layouts", ["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("M,N,K", MATMUL_CASES)
def test_matmul_matches_torch(M, N, K, layouts, dtype, dev):
    torch.manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    if layouts[0] == "c":
        a = a.t().contiguous().t()
    if layouts[1] == "c":
        b = b.t().contiguous().t()
    p = mm.problem(a, b)
    ref = a.float() @ b.float()
    configs = [
        mm.default_config(p, dev),
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2},
        # swapped (c^T = b^T a^T), unsplit and split the model's way: any M, not only decode's
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1, "SWAP_AB": 1, "num_warps": 4}
        | {"num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 0, "SWAP_AB": 1, "num_warps": 4}
        | {"num_stages": 3},
    ]
    for c in configs:
        _poison(M * gh.round_up(N, 8), dtype)
        _check(mm.launch(c, a, b), ref, 1e-2)


@pytest.mark.parametrize("layouts", ["rr", "rc"])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 14336), (16, 2816, 2048), (77, 520, 1000), (1, 8, 4160)])
def test_matmul_split_k_matches_torch_and_its_planned_launch(M, N, K, layouts, monkeypatch):
    """Decode-sized GEMMs split K over the SMs: every split count, the model's (0) included,
    gives torch's answer through the JIT and then through the planned launch (one kernel: the
    last split of each tile sums the partials), the same bits each time, and the tiles'
    arrival counters are left at zero for the next launch."""
    torch.manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = (
        torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        if layouts[1] == "r"
        else torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    )
    ref = a.float() @ b.float()
    for split, swap in itertools.product((0, 2, 3, 8), (0, 1)):
        c = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": split, "num_warps": 4}
        c |= {"num_stages": 4, "SWAP_AB": swap}
        _poison(M * gh.round_up(N, 8), torch.bfloat16)
        first = mm.launch(c, a, b)  # JIT, builds the plan
        _check(first, ref, 1e-2)
        with monkeypatch.context() as m:
            _no_jit(m, mm.matmul_kernel)
            _no_jit(m, sk.split_k_reduce_kernel)
            _poison(M * gh.round_up(N, 8), torch.bfloat16)
            planned = mm.launch(c, a, b)
            _check(planned, ref, 1e-2)
        assert torch.equal(first, planned), "split-K sums must not depend on which split arrives last"
        stream = torch.cuda.current_stream().cuda_stream
        assert not sk.zeroed_counters(a.device, stream, 1).any(), "a launch left a tile counter set"


def test_small_split_workspaces_are_kept_per_stream_and_bounded():
    """gluon_launch.stream_workspace: one buffer a stream for the small ones (no allocation a
    call), a fresh one past KEPT_WORKSPACE_BYTES, and no more than KEPT_STREAMS kept while a
    program makes streams as it goes."""
    like = torch.empty(1, device="cuda")
    here = torch.cuda.current_stream().cuda_stream
    kept = direct.stream_workspace(like, here, (4, 100, 64))
    assert direct.stream_workspace(like, here, (2, 100, 64)).data_ptr() == kept.data_ptr()
    big = direct.stream_workspace(like, here, (direct.KEPT_WORKSPACE_BYTES // 4 + 1,))
    assert big.data_ptr() != kept.data_ptr()
    for _ in range(2 * sk.KEPT_STREAMS):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert direct.stream_workspace(like, side.cuda_stream, (8,)).data_ptr() != kept.data_ptr()
    assert len(direct._WORKSPACES) <= sk.KEPT_STREAMS


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
    (1, 7, 7, 512, 512, 3, 3, 1, 1),  # ResNet-50 layer4 at batch 1: 49 pixels, split-K
    (1, 64, 64, 512, 8, 3, 3, 1, 1),  # a VAE's conv_out: 8 channels out (padded for TMA), split-K
    (2, 40, 24, 128, 3, 3, 3, 1, 1),  # an image head: 3 channels out, a 16-wide N tile
]


def _conv_ids(case):
    return "x".join(str(v).replace(" ", "") for v in case)


def _fprop_data(case, seed: int):
    """(x, w, the reference output) of a conv case, random from `seed`."""
    N, H, W, Ci, Co, R, S, st, pd = case
    torch.manual_seed(seed)
    x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16)
    return x, w, fprop.reference(x.float(), w.float(), st, pd)


def _wgrad_data(case, seed: int):
    """(x, grad_out, the reference grad_w) of a conv case, random from `seed`."""
    N, H, W, Ci, Co, R, S, st, pd = case
    sh, sw = st if isinstance(st, tuple) else (st, st)
    ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
    P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
    torch.manual_seed(seed)
    x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(N, P, Q, Co, device="cuda", dtype=torch.bfloat16)
    return x, g, wgrad.reference(x.float(), g.float(), R, S, st, pd)


def _wgrad_jit_then_planned(monkeypatch, case, configs, kernel):
    """Every config against torch through the JIT (which builds the plans), then on new data
    through its plan alone (`kernel` and the split-K reduce barred from the JIT); the last
    (x, grad_out)."""
    N, H, W, Ci, Co, R, S, st, pd = case
    for seed in (0, 1):
        x, g, ref = _wgrad_data(case, seed)
        for c in configs:
            _poison(Co * R * S * Ci, torch.bfloat16)
            _check(wgrad.launch(c, x, g, R, S, st, pd), ref, 1e-2)
        _no_jit(monkeypatch, kernel, sk.split_k_reduce_kernel)
    return x, g


# few input channels (Ci <= 8): the packed-taps kernel, K = R*S*Ci gathered through pointers
CONV_PACKED = [
    (4, 224, 224, 3, 64, 7, 7, 2, 3),  # the ResNet stem
    (1, 64, 64, 4, 512, 3, 3, 1, 1),  # SD VAE decoder.conv_in
    (2, 33, 17, 1, 24, 3, 3, 1, 1),  # one channel
    (3, 15, 17, 5, 7, 3, 3, 2, 1),  # odd everything, Co padded for TMA
    (2, 20, 12, 8, 200, 5, 5, (1, 2), (1, 0)),  # Ci = 8: no weight padding; asymmetric
    (2, 9, 9, 6, 13, 1, 1, 3, 0),  # strided 1x1
    (1, 7, 7, 2, 16, 7, 7, 1, 3),  # the window as large as the image
]
PACKED_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
]


@pytest.mark.parametrize("case", CONV_PACKED, ids=_conv_ids)
def test_conv2d_fprop_packed_taps_match_torch(monkeypatch, case, dev):
    N, H, W, Ci, Co, R, S, st, pd = case
    x, w, _ = _fprop_data(case, 0)
    p = fprop.problem(x, w, st, pd)
    assert gpt.packs_taps(p)
    configs = [fprop.default_config(p, dev)] + PACKED_CONFIGS
    # x 2 bytes past a 16-byte boundary (a batch slice of an odd-sized image): never a plan's
    x_odd = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view(x.shape)
    x_odd.copy_(x)
    for seed in (0, 1):  # JIT (builds the plans), then the planned launches on new data
        x, w, ref = _fprop_data(case, seed)
        for c in configs:
            _poison(p["gemm_M"] * gh.round_up(Co, 8), torch.bfloat16)
            _check(fprop.launch(c, x, w, st, pd), ref, 1e-2)
            if seed == 0:
                x_odd.copy_(x)
                _check(fprop.launch(c, x_odd, w, st, pd), ref, 1e-2)
        _no_jit(monkeypatch, fprop.conv2d_fprop_packed_kernel)


@pytest.mark.parametrize("case", CONV_GRID + CONV_EXTRA, ids=_conv_ids)
def test_conv2d_fprop_matches_torch(case, dev):
    N, H, W, Ci, Co, R, S, st, pd = case
    x, w, ref = _fprop_data(case, hash(case) % 1000)
    p = fprop.problem(x, w, st, pd)
    configs = [fprop.default_config(p, dev)]
    if case in CONV_EXTRA or (N == 1 and R == 3 and Ci == 128 and Co == 384):
        configs += [
            c
            for c in (
                {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
                {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
                # split-K where the model splits (few tiles; otherwise the unsplit launch)
                {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 4}
                | {"num_stages": 4},
                # narrow N tiles (all of a few output channels in one tile), split or not
                {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 8}
                | {"num_stages": 4},
                {"BLOCK_M": 256, "BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4}
                | {"num_stages": 6},
            )
            if fprop.resources_ok(c)
        ]
    for c in configs:
        _poison(p["gemm_M"] * gh.round_up(Co, 8), torch.bfloat16)
        _check(fprop.launch(c, x, w, st, pd), ref, 1e-2)
        _check(fprop.launch(c, x, w, st, pd), ref, 1e-2)  # the planned launch


@pytest.mark.parametrize("case", CONV_GRID + CONV_EXTRA, ids=_conv_ids)
def test_conv2d_wgrad_matches_torch(case, dev):
    N, H, W, Ci, Co, R, S, st, pd = case
    x, g, ref = _wgrad_data(case, hash(case) % 1000 + 1)
    p = wgrad.problem(x, g, R, S, st, pd)
    base = wgrad.default_config(p, dev)
    configs = [base, dict(base, SPLIT_K=1), dict(base, SPLIT_K=wgrad.STREAM_K)]
    if case in CONV_EXTRA:
        small = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}
        configs += [small, dict(small, SPLIT_K=wgrad.STREAM_K)]
    for c in configs:
        _poison(Co * R * S * gh.round_up(Ci, 8), torch.bfloat16)
        _check(wgrad.launch(c, x, g, R, S, st, pd), ref, 1e-2)


PACKED_WGRAD_CONFIGS = [
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 0, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 8, "num_stages": 3},
]


@pytest.mark.parametrize("case", CONV_PACKED, ids=_conv_ids)
def test_conv2d_wgrad_packed_taps_match_torch(monkeypatch, case, dev):
    N, H, W, Ci, Co, R, S, st, pd = case
    x, g, _ = _wgrad_data(case, 0)
    p = wgrad.problem(x, g, R, S, st, pd)
    assert gpt.packs_taps(p)
    configs = [wgrad.default_config(p, dev)] + [c for c in PACKED_WGRAD_CONFIGS if wgrad.resources_ok(c, p)]
    _wgrad_jit_then_planned(monkeypatch, case, configs, wgrad.conv2d_wgrad_packed_kernel)


CONV_FEW_CO = [
    (1, 64, 64, 128, 3, 3, 3, 1, 1),  # the SD VAE decoder's conv_out (at 64x64)
    (2, 33, 17, 24, 1, 3, 3, 1, 1),  # one output channel
    (3, 15, 17, 12, 5, 3, 3, 2, 1),  # odd everything, x's channels padded for TMA
    (2, 20, 12, 40, 4, 5, 5, (1, 2), (1, 0)),  # 5x5, asymmetric stride and padding
    (2, 16, 16, 64, 3, 7, 7, 1, 3),  # 7x7: 147 columns, a 256-wide B tile
    (2, 9, 9, 16, 8, 1, 1, 3, 0),  # strided 1x1, 8 channels out
    (1, 8, 8, 300, 2, 3, 3, 1, 1),  # three Ci blocks, the last overhanging
    (4, 28, 28, 96, 6, 2, 2, 2, 0),  # a 2x2 stride-2 filter: every x pixel meets one tap
]
FEW_CO_CONFIGS = [  # BLOCK_N set to the problem's few-Co width
    {"BLOCK_M": 64, "BLOCK_K": 32, "SPLIT_K": 0, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 5},
    {"BLOCK_M": 64, "BLOCK_K": 64, "SPLIT_K": 16, "num_warps": 4, "num_stages": 4},
]


@pytest.mark.parametrize("case", CONV_FEW_CO, ids=_conv_ids)
def test_conv2d_wgrad_few_output_channels_match_torch(monkeypatch, case, dev):
    """The few-Co kernel (grad_out gathered per tap, x read once): the configs whose BLOCK_N is
    its B tile's width run it (gluon_wgrad.runs_few_co), through the JIT and then its plan."""
    N, H, W, Ci, Co, R, S, st, pd = case
    x, g, _ = _wgrad_data(case, 0)
    p = wgrad.problem(x, g, R, S, st, pd)
    width = gwg.few_co_width(p, wgrad.FEW_CO_NARROWEST)
    tuned = [c for c in wgrad.prune(wgrad.config_space(p, dev), p, dev) if c["BLOCK_N"] == width]
    configs = [dict(c, BLOCK_N=width) for c in FEW_CO_CONFIGS] + tuned[-1:]
    configs = [c for c in configs if wgrad.resources_ok(c, p)]
    assert len(configs) >= 3 and all(gwg.runs_few_co(p, c, wgrad.FEW_CO_NARROWEST) for c in configs)
    configs.append(wgrad.default_config(p, dev))  # either kernel, as an untuned call runs it
    x, g = _wgrad_jit_then_planned(monkeypatch, case, configs, wgrad.conv2d_wgrad_few_co_kernel)
    # a grad_out that is not contiguous (a channels slice) is read through a copy, not a plan
    g2 = torch.randn(*g.shape[:3], Co + 1, device="cuda", dtype=torch.bfloat16)[..., :Co]
    monkeypatch.undo()
    _check(wgrad.launch(configs[0], x, g2, R, S, st, pd), wgrad.reference(x.float(), g2.float(), R, S, st, pd), 1e-2)


DGRAD_EXTRA = [
    (32, 14, 14, 512, 512, 3, 3, 2, 1),  # ResNet-50's strided 3x3: four phases of 4, 2, 2, 1 taps
    (8, 56, 56, 256, 512, 1, 1, 2, 0),  # strided 1x1: three phases no tap reaches (zeros)
    (2, 32, 32, 3, 64, 7, 7, 2, 3),  # the stem: Ci = 3 (w's rows padded for TMA)
    (2, 16, 16, 128, 3, 3, 3, 1, 1),  # Co = 3 (grad_out's channels padded)
    (4, 17, 17, 160, 160, 7, 1, 1, (3, 0)),  # Inception's 7x1
    (2, 11, 13, 24, 40, 5, 5, 3, 2),  # stride 3: nine phases, odd sizes
    (1, 64, 64, 4, 512, 3, 3, 1, 1),  # the SD VAE decoder's conv_in: 32 tiles, K = 4608: split-K
    (2, 7, 7, 200, 512, 3, 3, 1, 1),  # 7x7 images, odd Ci: split-K over 32-wide tiles
]


@pytest.mark.parametrize("case", CONV_GRID + CONV_EXTRA + DGRAD_EXTRA, ids=_conv_ids)
def test_conv2d_dgrad_matches_torch(case, dev):
    """grad_x in one launch over every phase, w read in place, written in place: against torch's."""
    N, H, W, Ci, Co, R, S, st, pd = case
    torch.manual_seed(hash(case) % 1000 + 2)
    sh, sw = st if isinstance(st, tuple) else (st, st)
    ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
    P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
    g = torch.randn(N, P, Q, Co, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16)
    p = dgrad.problem(g, w, H, W, st, pd)
    if not dgrad.supports(p, dev):
        pytest.skip("TMA im2col cannot walk this geometry")
    ref = dgrad.reference(g.float(), w.float(), H, W, st, pd)
    configs = [dgrad.default_config(p, dev)]
    if case in CONV_EXTRA + DGRAD_EXTRA:
        configs += [
            {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
            {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},
            # a narrow tile, two CTAs per SM (every CTA's epilogue beside another's WGMMAs)
            {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "CTAS_PER_SM": 2, "num_warps": 4}
            | {"num_stages": 3},
            {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "CTAS_PER_SM": 2, "num_warps": 4}
            | {"num_stages": 3},
            # split-K where the model splits (stride 1 and few tiles; otherwise the unsplit launch)
            {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 0, "num_warps": 4}
            | {"num_stages": 4},
            {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 0, "num_warps": 8}
            | {"num_stages": 4},
        ]
    for c in configs:
        _poison(N * H * W * Ci, torch.bfloat16)
        _check(dgrad.launch(c, g, w, H, W, st, pd), ref.to(torch.bfloat16), 1e-2)
        _check(dgrad.launch(c, g, w, H, W, st, pd), ref.to(torch.bfloat16), 1e-2)  # the planned launch


def test_wgrad_split_k_is_deterministic():
    torch.manual_seed(0)
    x = torch.randn(32, 28, 28, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(32, 28, 28, 128, device="cuda", dtype=torch.bfloat16)
    for split in (16, wgrad.STREAM_K):
        c = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": split, "num_warps": 4, "num_stages": 4}
        first = wgrad.launch(c, x, g, 3, 3, 1, 1)
        for _ in range(3):
            assert torch.equal(wgrad.launch(c, x, g, 3, 3, 1, 1), first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_conv_fp16_and_bf16(dtype, dev):
    torch.manual_seed(1)
    x = torch.randn(8, 20, 20, 64, device="cuda", dtype=dtype)
    w = torch.randn(96, 3, 3, 64, device="cuda", dtype=dtype)
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


def _no_jit(monkeypatch, *fns):
    """Make JITFunction.run fail for `fns`: a launch must then go through its plan."""

    def boom(*a, **k):
        raise AssertionError("JITFunction.run called on a planned launch")

    for fn in fns:
        monkeypatch.setattr(fn, "run", boom)


@pytest.mark.parametrize("layouts", ["rr", "cc"])
def test_matmul_direct_launch_matches_torch_on_new_data(monkeypatch, layouts):
    M, N, K = 333, 517, 129  # N padded for TMA: the output is sliced
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}

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


@pytest.mark.parametrize(
    "case",
    [(3, 15, 17, 5, 7, 3, 3, 2, 1), (4, 20, 12, 40, 200, 5, 5, (1, 2), (1, 0)), (8, 14, 14, 64, 96, 1, 1, 1, 0)],
    ids=_conv_ids,
)
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
    _no_jit(monkeypatch, fprop.conv2d_fprop_kernel, fprop.conv2d_fprop_packed_kernel)
    _no_jit(monkeypatch, wgrad.conv2d_wgrad_kernel, wgrad.conv2d_wgrad_packed_kernel, sk.split_k_reduce_kernel)
    for seed in (1, 2):
        x, w, g = data(seed)
        check_all(x, w, g)
        w.normal_()  # new weights at the same address: a packed copy of the old ones is not read
        _check(fprop.launch(cf, x, w, st, pd), fprop.reference(x.float(), w.float(), st, pd), 1e-2)
    # the same problem with stride given as a tuple shares the plan; a bool stride still raises
    x, w, g = data(3)
    sh, sw = st if isinstance(st, tuple) else (st, st)
    ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
    _check(fprop.launch(cf, x, w, (sh, sw), (ph, pw)), fprop.reference(x.float(), w.float(), st, pd), 1e-2)
    with pytest.raises((TypeError, AssertionError)):
        fprop.launch(cf, x, w, True, pd)


def test_direct_launch_off_switch_and_hooks_use_the_jit(monkeypatch):
    from triton import knobs

    a = torch.randn(128, 64, device="cuda", dtype=torch.float16)
    b = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    mm.launch(c, a, b)
    seen = []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda md: seen.append(md))
    _check(mm.launch(c, a, b), a.float() @ b.float(), 1e-2)
    assert seen, "a launch hook must see the launch (JIT path)"

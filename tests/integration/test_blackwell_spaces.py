"""The Blackwell kernels schedule as the Hopper ones do: a decode GEMM splits K, a wgrad whose
tiles leave SMs idle takes the work model's split count or stream-K, and a capped tune sees the
unsplit and modeled schedules before the explicit ones. Rules only (CPU, no compile): that
each schedule compiles for sm_100a is test_compile_targets' and test_blackwell_ptx's to show,
and that it computes the right answer needs a Blackwell GPU, which no host here has."""

from __future__ import annotations

import pytest
import torch

from tunecache.key import DeviceClass
from tunecache_kernels import conv2d_fprop_blackwell as fprop
from tunecache_kernels import conv2d_wgrad_blackwell as wgrad
from tunecache_kernels import gluon_matmul as gmm
from tunecache_kernels import gluon_wgrad as gwg
from tunecache_kernels import matmul_blackwell as mm
from tunecache_kernels import problems
from tunecache_kernels.spaces import space_for

B200 = DeviceClass("sm_100", 148, "NVIDIA B200")


def _meta(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


def _wgrad_problem(N, H, W, Ci, Co, R, S, st, pd):
    P, Q = problems.out_size(H, R, st, pd), problems.out_size(W, S, st, pd)
    return problems.conv2d_wgrad_problem(_meta(N, H, W, Ci), _meta(N, P, Q, Co), R, S, st, pd)


@pytest.mark.parametrize(
    "M,N,K,splits",
    [(1, 4096, 14336, True), (16, 2816, 2048, True), (1, 8192, 8192, True), (8192, 8192, 4096, False)],
)
def test_a_decode_gemm_splits_k_by_default_and_a_prefill_gemm_does_not(M, N, K, splits):
    p = {"M": M, "N": N, "K": K, "dtype": "bfloat16", "a_layout": "row", "b_layout": "col"}
    c = mm.default_config(p, B200)
    n, _ = gmm.matmul_splits(p, c, 148)
    assert (n > 1) is splits
    assert gmm.split_binary(c, n) is splits
    names = [spec.name for spec in mm.compile_specs(p, c, B200)]
    assert names == ["matmul_kernel"]  # a split launch sums its own partials: no second kernel
    pruned = mm.prune(mm.config_space(p, B200), p, B200)
    assert any(x["SPLIT_K"] != 1 for x in pruned) is splits
    assert any(x["SWAP_AB"] for x in pruned) is (M <= gmm.SWAP_MAX_M)
    assert all(space_for(mm.KERNEL).contains(x) for x in pruned + [c])


def test_a_capped_matmul_tune_sees_every_tile_unsplit_or_modeled_before_an_explicit_split():
    p = {"M": 16, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "col"}
    pruned = mm.prune(mm.config_space(p, B200), p, B200)
    explicit = [i for i, c in enumerate(pruned) if c["SPLIT_K"] not in (0, 1)]
    assert explicit and min(explicit) == len(pruned) - len(explicit)


def test_the_seeds_wgrad_layer_takes_the_modeled_split_that_fills_whole_waves():
    # the seeds' 384-channel 64x64 3x3 layer at batch 128: 81 tiles of 128x128 on 148 SMs
    p = _wgrad_problem(128, 64, 64, 384, 384, 3, 3, 1, 1)
    c = wgrad.default_config(p, B200)
    assert c["SPLIT_K"] == 0
    w = gwg.WgradWork.of(p, c, 148)
    units = w.tiles * w.splits
    assert w.splits > 1 and units / (-(-units // 148) * 148) >= 0.95
    assert [s.name for s in wgrad.compile_specs(p, c, B200)] == ["conv2d_wgrad_kernel", "split_k_reduce"]


def test_a_layer_of_few_tiles_and_a_short_reduction_has_stream_k_candidates_that_fill_the_ring():
    # ResNet-50's 512-channel 3x3 layer at 7x7, batch 32: 144 tiles of 128x128, 25 k-steps
    p = _wgrad_problem(32, 7, 7, 512, 512, 3, 3, 1, 1)
    space = wgrad.prune(wgrad.config_space(p, B200), p, B200)
    stream = [c for c in space if c["SPLIT_K"] == gwg.STREAM_K]
    assert stream
    for c in stream:
        w = gwg.WgradWork.of(p, c, 148)
        assert w.stream and w.ctas <= 148 and w.per >= c["NUM_BUFFERS"]
        assert w.ctas * w.per >= w.tiles * w.k_steps > (w.ctas - 1) * w.per
    assert {s.name for s in wgrad.compile_specs(p, stream[0], B200)} == {"conv2d_wgrad_kernel"}
    # the unsplit and modeled schedules come first: a capped tune cuts stream-K and explicit splits
    first_other = next(i for i, c in enumerate(space) if c["SPLIT_K"] not in (0, 1))
    assert all(c["SPLIT_K"] not in (0, 1) for c in space[first_other:])


def test_a_wgrad_whose_tiles_fill_the_gpu_is_not_split():
    # 2048 channels, 3x3: 1152 tiles of 128x256, 2304 of 128x128: splitting only adds traffic
    p = _wgrad_problem(8, 14, 14, 2048, 2048, 3, 3, 1, 1)
    splits = {c["SPLIT_K"] for c in wgrad.config_space(p, B200)}
    assert 1 in splits and not splits - {1, gwg.STREAM_K}


def _capped_problems():
    yield mm, {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "row"}
    yield mm, {"M": 16, "N": 4096, "K": 4096, "dtype": "float16", "a_layout": "row", "b_layout": "col"}
    x = _meta(32, 56, 56, 64)
    yield fprop, problems.conv2d_fprop_problem(x, _meta(64, 3, 3, 64), 1, 1)
    yield fprop, problems.conv2d_fprop_problem(_meta(1, 224, 224, 3), _meta(64, 7, 7, 3), 2, 3)
    yield wgrad, _wgrad_problem(32, 7, 7, 512, 512, 3, 3, 1, 1)
    yield wgrad, _wgrad_problem(128, 56, 56, 64, 64, 1, 1, 1, 0)


@pytest.mark.parametrize("mod,p", list(_capped_problems()), ids=lambda x: getattr(x, "KERNEL", None))
def test_a_capped_tune_sees_every_tile_at_its_deepest_ring(mod, p):
    """The tuner times the first TUNECACHE_MAX_CANDIDATES (48) of prune()'s order: every tile
    shape (and unsplit / modeled schedule) at the deepest ring that fits it, GROUP_M 8, is among
    them, 128-row tiles included."""
    pruned = mod.prune(mod.config_space(p, B200), p, B200)
    first = pruned[:48]

    def tile(c):
        return (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c.get("SPLIT_K", 1))

    deepest = {}
    for c in pruned:
        if c.get("GROUP_M", 8) == 8 and c.get("SPLIT_K", 1) in (0, 1):
            deepest[tile(c)] = max(deepest.get(tile(c), 0), c["NUM_BUFFERS"])
    assert len(deepest) <= 48
    seen = {(tile(c), c["NUM_BUFFERS"]) for c in first if c.get("GROUP_M", 8) == 8}
    assert all((t, n) in seen for t, n in deepest.items()), sorted(set(deepest.items()) - seen)
    assert any(c["BLOCK_M"] == 128 for c in first) == any(c["BLOCK_M"] == 128 for c in pruned)


@pytest.mark.parametrize("channels,lead", [(160, 32), (128, 64)])
def test_a_conv_whose_taps_64_does_not_divide_leads_with_k_steps_of_32(channels, lead):
    """The Hopper convs' rule (gluon_host.tap_k_step), kept in step: a capped tune of a conv
    over 160 channels times steps of 32 before steps of 64 that pad each tap to 192."""
    from tunecache_kernels import conv2d_dgrad_blackwell as dgrad

    x = torch.empty(32, 17, 17, channels, dtype=torch.bfloat16, device="meta")
    w = torch.empty(channels, 7, 1, channels, dtype=torch.bfloat16, device="meta")
    for mod, p in (
        (fprop, problems.conv2d_fprop_problem(x, w, 1, (3, 0))),
        (dgrad, problems.conv2d_dgrad_problem(x, w, 17, 17, 1, (3, 0))),
    ):
        ordered = mod.prune(mod.config_space(p, B200), p, B200)
        assert ordered[0]["BLOCK_K"] == lead, (mod.KERNEL, ordered[0])

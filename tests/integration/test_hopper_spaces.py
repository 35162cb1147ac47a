"""The Hopper (sm_90a) Gluon backends on the CPU: their spaces and pruning, the host-side plans
(split-K, stream-K, im2col geometry, direct-launch keys), and a sample of their configs compiled
for sm_90a in fresh processes. Their results against PyTorch on an sm_90 GPU are in
tests/gpu/test_hopper_kernels.py."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from tunecache.key import DeviceClass
from tunecache_kernels import conv2d_dgrad_hopper as dgrad
from tunecache_kernels import conv2d_fprop_hopper as fprop
from tunecache_kernels import conv2d_wgrad_hopper as wgrad
from tunecache_kernels import gluon_host as gh
from tunecache_kernels import gluon_launch as direct
from tunecache_kernels import gluon_matmul as gmm
from tunecache_kernels import gluon_packed_taps as gpt
from tunecache_kernels import gluon_split_k as sk
from tunecache_kernels import gluon_wgrad as gwg
from tunecache_kernels import matmul_hopper as mm
from tunecache_kernels import problems
from tunecache_kernels.gluon_hopper import accumulator_per_thread
from tunecache_kernels.hardware import HOPPER
from tunecache_kernels.spaces import space_for

H100 = DeviceClass("sm_90", 132, "NVIDIA H100 80GB HBM3")
B200 = DeviceClass("sm_100", 148, "NVIDIA B200")
MODULES = (mm, fprop, wgrad, dgrad)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _problems():
    """A few problems per op, meta tensors only (shapes are all the CPU tests need)."""
    yield mm, problems.matmul_problem(_meta(4096, 4096), _meta(4096, 4096))
    yield mm, problems.matmul_problem(_meta(128, 8192), _meta(8192, 8192))
    yield mm, problems.matmul_problem(_meta(77, 33, dtype=torch.float16), _meta(65, 33, dtype=torch.float16).t())
    for N, H, W, Ci, Co, R, S, st, pd in [
        (128, 56, 56, 64, 64, 3, 3, 1, 1),
        (128, 14, 14, 1024, 256, 1, 1, 1, 0),
        (3, 15, 17, 5, 7, 5, 5, (2, 1), (1, 0)),
        (8, 224, 224, 3, 64, 7, 7, 2, 3),  # the stem: few channels, the packed-taps kernels
    ]:
        x = _meta(N, H, W, Ci)
        yield fprop, problems.conv2d_fprop_problem(x, _meta(Co, R, S, Ci), st, pd)
        sh, sw = st if isinstance(st, tuple) else (st, st)
        ph, pw = pd if isinstance(pd, tuple) else (pd, pd)
        P, Q = problems.out_size(H, R, sh, ph), problems.out_size(W, S, sw, pw)
        yield wgrad, problems.conv2d_wgrad_problem(x, _meta(N, P, Q, Co), R, S, st, pd)
    # dgrad (after the others: tests pick problems by index): ResNet-50's strided 3x3, its
    # pointwise 1x1, the stem (Ci = 3), an odd geometry at stride 3
    for N, H, W, Ci, Co, R, S, st, pd in [
        (32, 14, 14, 512, 512, 3, 3, 2, 1),
        (128, 14, 14, 1024, 256, 1, 1, 1, 0),
        (8, 224, 224, 3, 64, 7, 7, 2, 3),
        (3, 15, 17, 5, 7, 5, 5, 3, 2),
    ]:
        P, Q = problems.out_size(H, R, st, pd), problems.out_size(W, S, st, pd)
        yield dgrad, problems.conv2d_dgrad_problem(_meta(N, P, Q, Co), _meta(Co, R, S, Ci), H, W, st, pd)


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
        # shared memory within the limit, the accumulator in the register file without spilling
        # (a conv's shared memory depends on whether the launch splits: on the device's SMs)
        assert mod.resources_ok(c, p, H100.sm_count)
        assert accumulator_per_thread(c) <= 128


@pytest.mark.parametrize("mod,p", PROBLEMS, ids=lambda x: getattr(x, "KERNEL", None))
def test_default_config_is_in_space_and_survives_pruning(mod, p):
    c = mod.default_config(p, H100)
    space_for(mod.KERNEL).check(c)
    assert c in mod.prune([c], p, H100)


def test_prune_rejects_configs_over_shared_memory():
    p = PROBLEMS[0][1]
    big = {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 8, "num_stages": 6}
    assert mm.smem_bytes(big) > HOPPER.smem_per_block
    assert mm.prune([big], p, H100) == []


def test_prune_keeps_the_seed_hopper_config():
    # the tutorial's best Hopper matmul: 128x256x64, 3 buffers, 8 warps (~208 KB of smem)
    p = PROBLEMS[0][1]
    c = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 8, "num_stages": 3}
    assert mm.prune([c], p, H100) == [c]


def test_a_capped_tune_sees_every_tile_of_the_quick_subset():
    """The default cap (48 candidates) cuts a subset that is too long in its split variants, not
    in its tiles: ResNet-50's 3x3 wgrad at 28x28 was won by a 128x128 one-warpgroup tile that
    the narrow tiles' splits had pushed past the cap (H100: 0.924x the exhaustive best)."""
    from tunecache import settings

    x = _meta(128, 28, 28, 128)
    p = problems.conv2d_wgrad_problem(x, _meta(128, 28, 28, 128), 3, 3, 1, 1)
    capped = wgrad.prune(wgrad.config_space(p, H100), p, H100)[: settings.max_candidates()]
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) for c in capped}
    assert (128, 128, 64, 4) in tiles and (128, 128, 64, 8) in tiles
    unsplit = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]) for c in capped if c["SPLIT_K"] == 0}
    assert unsplit >= {t for t in tiles if t[2] == 64}


@pytest.mark.parametrize("M,N,K", [(128, 8192, 8192), (4096, 4096, 4096), (16384, 1024, 4096)])
def test_a_capped_tune_takes_deep_rings_before_narrow_k_steps(M, N, K):
    """After the quick subset, a capped tune's candidates are each tile's deepest rings with K
    steps of 64 or 128, not the space's 64x64x32 two-stage rings: 128x8192x8192's exhaustive
    winner (64x128x128, four stages) was past the cap (H100: 0.973x the exhaustive best)."""
    from tunecache import settings

    p = {"M": M, "N": N, "K": K, "dtype": "bfloat16", "a_layout": "row", "b_layout": "row"}
    ordered = mm.prune(mm.config_space(p, H100), p, H100)
    capped, past = ordered[: settings.max_candidates()], ordered[settings.max_candidates() :]
    if any(c["BLOCK_K"] == 32 and c["BLOCK_M"] + c["BLOCK_N"] < 384 for c in capped):
        assert not any(c["BLOCK_K"] >= 64 and c["GROUP_M"] == 8 for c in past)
    deepest = {}
    for c in ordered:
        k = _tile(c)
        deepest[k] = max(deepest.get(k, 0), c["num_stages"])
    shallow_in = [c for c in capped if c["num_stages"] < deepest[_tile(c)] - 1]
    deep_out = [c for c in past if c["num_stages"] == deepest[_tile(c)] and c["BLOCK_K"] >= 64 and c["GROUP_M"] == 8]
    assert not (shallow_in and deep_out), (shallow_in[:3], deep_out[:3])
    if M == 128:
        want = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
        assert any(dict(want, SPLIT_K=s, SWAP_AB=0) in capped for s in (0, 1))


def test_a_capped_tune_sees_the_k_step_that_keeps_a_wide_or_narrow_tile_deep():
    """A K step of 64 leaves a 128x256 tile's ring 3 stages deep and a 64x128 tile's one stage
    half full: ResNet-50's 512-channel 3x3 fprop at 7x7 was won by 128x256x32 (six stages), its
    1x1 wgrad at 14x14 by 64x128x128, both past the cap (H100: 0.978x and 0.979x the exhaustive
    best)."""
    from tunecache import settings

    n = settings.max_candidates()
    x = _meta(128, 7, 7, 512)
    p = problems.conv2d_fprop_problem(x, _meta(512, 3, 3, 512), 1, 1)
    wide = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 1, "num_warps": 8}
    wide["num_stages"] = 6
    assert wide in fprop.prune(fprop.config_space(p, H100), p, H100)[:n]
    x, g = _meta(128, 14, 14, 1024), _meta(128, 14, 14, 256)
    p = problems.conv2d_wgrad_problem(x, g, 1, 1, 1, 0)
    narrow = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 0, "num_warps": 4, "num_stages": 4}
    assert narrow in wgrad.prune(wgrad.config_space(p, H100), p, H100)[:n]


@pytest.mark.parametrize(
    "M,N,K,splits",
    [(1, 4096, 14336, True), (16, 2816, 2048, True), (1, 8192, 8192, True), (4096, 4096, 4096, False)],
)
def test_a_decode_gemm_runs_swapped_by_default_and_may_split_and_a_prefill_gemm_neither(M, N, K, splits):
    """A decode GEMM (M <= 16) runs untuned as c^T = b^T a^T, N on the MMA's 64-row side and M
    on an 8- or 16-wide one; M = 1 x N = 4096 is then 64 tiles on 132 SMs, so split candidates
    (K streamed by more SMs) are tuned too. 4096^3 fills the GPU with tiles: neither."""
    p = {"M": M, "N": N, "K": K, "dtype": "bfloat16", "a_layout": "row", "b_layout": "col"}
    c = mm.default_config(p, H100)
    launched, q = gmm.matmul_as_launched(c, p)
    assert c["SWAP_AB"] == splits and (launched["BLOCK_N"] == 8 if M == 1 else True)
    assert (q["M"], q["N"]) == ((N, M) if splits else (M, N))
    pruned = mm.prune(mm.config_space(p, H100), p, H100)
    assert any(x["SPLIT_K"] != 1 for x in pruned) is splits
    assert any(x["SWAP_AB"] for x in pruned) is splits
    assert all(space_for(mm.KERNEL).contains(x) for x in pruned + [c])


def test_swapped_configs_are_tried_once_per_narrow_tile_and_only_for_decode():
    """Swapped, BLOCK_N does not shape the launch (the tile over M follows M): only its 64 is
    kept; M = 33 is no longer decode-sized."""
    space = list(space_for(mm.KERNEL))
    for m, narrow in ((1, 8), (16, 16), (32, 32)):
        p = {"M": m, "N": 4096, "K": 4096, "dtype": "float16", "a_layout": "row", "b_layout": "row"}
        kept = [c for c in mm.prune(mm.config_space(p, H100), p, H100) if c["SWAP_AB"]]
        assert kept and {c["BLOCK_N"] for c in kept} == {64}
        assert {gmm.matmul_as_launched(c, p)[0]["BLOCK_N"] for c in kept} == {narrow}
    p = {"M": 33, "N": 4096, "K": 4096, "dtype": "float16", "a_layout": "row", "b_layout": "row"}
    assert not any(c["SWAP_AB"] and mm.worth_trying(c, p, 132) for c in space)


def test_a_split_decode_gemm_is_one_launch_whose_last_split_sums_the_partials():
    """No second kernel: each split counts in on its tile's counter (acq_rel at GPU scope),
    and the last one reads the partials past L1 and zeroes the counter for the next launch."""
    from tunecache.tuning.compile_pool import compile_in_fresh_processes

    p = {"M": 1, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "row"}
    c = dict(mm.default_config(p, H100), SPLIT_K=0)
    assert gmm.matmul_splits(p, c, 132)[0] > 1
    assert [spec.name for spec in mm.compile_specs(p, c, H100)] == ["matmul_kernel"]
    (out,) = compile_in_fresh_processes([(mm, p, c, 0)], H100, "sm_90a")
    ptx = out["asm"]["ptx"]
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx) and re.search(r"ld\.global\.cg", ptx)
    assert re.search(r"atom\.global\.gpu\.relaxed\.exch", ptx)


def _tile(c: dict) -> tuple:
    return (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], c["SPLIT_K"], c["num_warps"])


@pytest.mark.parametrize("mod,p", PROBLEMS, ids=lambda x: getattr(x, "KERNEL", None))
def test_supports_only_sm90_half_precision(mod, p):
    assert mod.supports(p, H100)
    assert not mod.supports(p, B200)
    assert not mod.supports({**p, "dtype": "float32"}, H100)
    assert not mod.supports(p, DeviceClass("cpu", 0))


def test_wgrad_split_plan_never_launches_empty_splits():
    for k_iters, split in itertools.product((1, 5, 63, 64, 65, 1000), (1, 2, 4, 8, 16, 32)):
        active, per = sk.split_k_plan(k_iters, split)
        assert 1 <= active <= split
        assert active * per >= k_iters > (active - 1) * per


def _seed_wgrad_problem():
    # the seeds' 384-channel 64x64 3x3 layer at batch 128: 81 output tiles of 128x128
    return problems.conv2d_wgrad_problem(_meta(128, 64, 64, 384), _meta(128, 64, 64, 384), 3, 3, 1, 1)


def test_wgrad_auto_split_fills_whole_waves():
    # one split leaves 51 of 132 SMs idle and two leave a 30-unit second wave: SPLIT_K=0 picks
    # a count whose units fill the SMs' waves at least 95%
    c = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 0, "num_warps": 8, "num_stages": 4}
    w = gwg.WgradWork.of(_seed_wgrad_problem(), c, 132)
    units = w.tiles * w.splits
    assert w.tiles == 81 and w.splits > 1
    assert units / (-(-units // 132) * 132) >= 0.95


@pytest.mark.parametrize("sms", [132, 114, 7])
def test_wgrad_stream_k_gives_every_cta_an_equal_run(sms):
    p = problems.conv2d_wgrad_problem(_meta(128, 7, 7, 512), _meta(128, 7, 7, 512), 3, 3, 1, 1)
    for bn in (64, 128, 256):
        c = {"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 64, "SPLIT_K": wgrad.STREAM_K, "num_warps": 8, "num_stages": 4}
        w = gwg.WgradWork.of(p, c, sms)
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
    return out[: n + 1]


@pytest.mark.parametrize(
    "mod,p", [PROBLEMS[0], PROBLEMS[2], PROBLEMS[3], PROBLEMS[4], PROBLEMS[5]], ids=lambda x: getattr(x, "KERNEL", None)
)
def test_sample_configs_compile_for_sm90a(mod, p):
    from tunecache.tuning.compile_pool import compile_in_fresh_processes

    jobs, is_reduce = [], []
    for c in _sample(mod, p, n=1):
        for i, spec in enumerate(mod.compile_specs(p, c, H100)):
            jobs.append((mod, p, c, i))
            is_reduce.append(spec.fn is sk.split_k_reduce_kernel)
    # fresh processes: earlier tests may have run the CPU interpreter in this one
    for (_, _, c, _), reduce, out in zip(jobs, is_reduce, compile_in_fresh_processes(jobs, H100, "sm_90a")):
        assert out["shared"] <= HOPPER.smem_per_block, (c, out["shared"])
        if not reduce:
            assert "wgmma.mma_async" in out["asm"]["ptx"], c


def test_a_small_output_split_many_ways_is_summed_with_the_warps_over_the_splits():
    """ResNet-50's first 1x1 at batch 32 has a 64x64 grad_w and 100352 pixels to sum: split 32
    ways, its reduction ran 4 CTAs of 1024 outputs, 8 splits a pass (6 us, H100). Where the wide
    CTAs would not give every SM one, a CTA holds 128 outputs and its warps load 32 splits a
    pass; a large output keeps the wide CTAs. The launch compiles what the tuner compiled."""
    from tunecache.tuning.compile_pool import compile_in_fresh_processes

    assert sk.split_k_reduce_block(64 * 64, 132) == 128
    assert sk.split_k_reduce_block(6272 * 512, 132) == 1024
    p = problems.conv2d_wgrad_problem(_meta(32, 56, 56, 64), _meta(32, 56, 56, 64), 1, 1, 1, 0)
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 32, "num_warps": 4, "num_stages": 4}
    *_, reduce = wgrad.compile_specs(p, c, H100)
    assert reduce.fn is sk.split_k_reduce_kernel and reduce.constexprs["BLOCK"] == 128
    (out,) = compile_in_fresh_processes([(wgrad, p, c, 1)], H100, "sm_90a")
    assert out["shared"] <= HOPPER.smem_per_block


# ---- direct launches: the keys of their plans ----------------------------------------------------


def test_plan_key_parts_reject_what_pair_must_check():
    assert direct.int_pair_key(2) == (2, 2) and direct.int_pair_key((1, 2)) == (1, 2)
    for v in (True, [1, 2], (1,), (1, 2, 3), (1.0, 2), (True, 1), "1"):
        assert direct.int_pair_key(v) is None, v
    assert direct.config_key({"a": 1, "b": 2}) != direct.config_key({"a": 1, "b": 3})


# ---- few input channels: the packed-taps kernels' host side ---------------------------------------


@pytest.mark.parametrize("ci", [1, 3, 4, 8, 9, 16])
def test_a_conv_of_at_most_8_input_channels_takes_the_packed_taps_kernels(ci):
    x = _meta(2, 16, 16, ci)
    p_f = problems.conv2d_fprop_problem(x, _meta(32, 3, 3, ci), 1, 1)
    p_w = problems.conv2d_wgrad_problem(x, _meta(2, 16, 16, 32), 3, 3, 1, 1)
    packed = ci <= 8
    for mod, p in ((fprop, p_f), (wgrad, p_w)):
        assert gpt.packs_taps(p) == packed
        names = {s.name for s in mod.compile_specs(p, mod.default_config(p, H100), H100)}
        assert (f"{mod.OP}_packed_kernel" in names) == packed, names


@pytest.mark.parametrize("ci,r", [(3, 7), (4, 3), (8, 3), (1, 1)])
def test_packed_weights_are_the_filter_as_rows_of_k_zero_padded_to_16_bytes(ci, r):
    w = torch.randn(5, r, r, ci, dtype=torch.bfloat16)
    packed = gpt.packed_weights(w)
    k = r * r * ci
    assert packed.shape == (5, gh.round_up(k, 8)) and packed.is_contiguous()
    assert torch.equal(packed[:, :k], w.reshape(5, k)) and not packed[:, k:].any()
    if k % 8 == 0:
        assert packed.data_ptr() == w.data_ptr()  # already TMA-ready: no copy


@pytest.mark.parametrize("npq", [1, 1000, 50_000, 1_605_632])
@pytest.mark.parametrize("split_k", [0, 4])
def test_the_packed_wgrad_splits_its_pixels_until_the_sms_are_busy_and_never_runs_an_empty_split(npq, split_k):
    c = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": split_k}
    tiles, k_steps, splits, per = gwg.packed_wgrad_work(64, 147, npq, c, 132)
    assert tiles == 3 and k_steps == -(-npq // 64)
    assert (splits - 1) * per < k_steps <= splits * per  # every split has at least one step
    # as many splits as keep PACKED_WGRAD_CTAS_PER_SM CTAs on each SM (or SPLIT_K, if fewer),
    # (rounding the steps per split may leave fewer, never half of them or less)
    cap = -(-gwg.PACKED_WGRAD_CTAS_PER_SM * 132 // tiles)
    cap = min(cap, split_k) if split_k else cap
    assert splits <= min(k_steps, cap)
    if k_steps >= cap:
        assert 2 * splits > cap


def test_a_per_stream_buffer_is_shared_on_its_stream_grown_and_bounded():
    """gluon_split_k.per_stream (the planned launches' kept workspaces and split counters): one
    buffer a stream, shared while it is large enough, remade larger, another stream's its own,
    and no more than KEPT_STREAMS kept while streams come and go."""
    kept: dict = {}
    cpu = torch.device("cpu")
    first = sk.per_stream(kept, cpu, 1, 10, torch.zeros)
    assert sk.per_stream(kept, cpu, 1, 8, torch.zeros) is first
    grown = sk.per_stream(kept, cpu, 1, 20, torch.zeros)
    assert grown is not first and grown.numel() == 20
    assert sk.per_stream(kept, cpu, 2, 4, torch.zeros) is not grown
    for stream in range(3, 3 + 2 * sk.KEPT_STREAMS):
        mine = sk.per_stream(kept, cpu, stream, 4, torch.zeros)
        assert kept[(cpu, stream)] is mine
        assert len(kept) <= sk.KEPT_STREAMS


@pytest.mark.parametrize("mod", [fprop, dgrad], ids=["fprop", "dgrad"])
def test_a_capped_tune_of_a_160_channel_conv_times_k_steps_of_32(mod):
    """Steps of 64 pad each tap of 160 channels to 192 (gluon_host.tap_k_step): Inception's 7x1
    conv was won by 256x64x32 (H100: 16.1 us; the capped tune's pick 17.4 us, 0.84x cuDNN's
    dgrad), a config past the cap until the step of 32 led the order."""
    from tunecache import settings

    x, w = _meta(32, 17, 17, 160), _meta(160, 7, 1, 160)
    if mod is fprop:
        p = problems.conv2d_fprop_problem(x, w, 1, (3, 0))
    else:
        p = problems.conv2d_dgrad_problem(x, w, 17, 17, 1, (3, 0))
    capped = mod.prune(mod.config_space(p, H100), p, H100)[: settings.max_candidates()]
    tiles = {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]) for c in capped}
    assert (256, 64, 32, 4, 6) in tiles
    assert gh.tap_k_step(160) == 32 and gh.tap_k_step(128) == gh.tap_k_step(192) == gh.tap_k_step(32) == 64

"""Spaces of the Hopper (sm_90a) Gluon kernels: TMA loads, async WGMMA, persistent grids.

`num_stages` is the depth of the kernel's own shared-memory ring (Gluon does not pipeline
for us); `num_warps` is 4 (one warpgroup) or 8 (two warpgroups splitting the tile).
"""

from . import ConfigSpace

_STAGES = (2, 3, 4, 5, 6)


def _space(block_n: tuple, block_k: tuple, schedule: dict, num_stages: tuple = _STAGES) -> ConfigSpace:
    """A Hopper kernel's space: BLOCK_M and the warps are every kernel's (one or two
    warpgroups over 64 to 256 rows); the rest is the op's."""
    return ConfigSpace(
        {
            "BLOCK_M": (64, 128, 256),
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            **schedule,
            "num_warps": (4, 8),
            "num_stages": num_stages,
        }
    )


SPACES = {
    # c[M, N] = a[M, K] @ b[K, N]; persistent over tiles in grouped order. SPLIT_K > 1 cuts each
    # tile's K that many ways into fp32 partials, summed in split order by the tile's last split
    # to arrive; 0 takes the split count a work model finds fastest; 1 never splits. SWAP_AB 1: a
    # decode GEMM (M <= 32) runs as c^T = b^T a^T, M on the MMA's narrow side
    # (gluon_matmul.matmul_as_launched)
    "matmul": _space((64, 128, 256), (32, 64, 128), {"GROUP_M": (1, 8), "SPLIT_K": (0, 1, 2, 4, 8), "SWAP_AB": (0, 1)}),
    # implicit GEMM: M = N*P*Q output pixels (TMA im2col), N = Co, K = R*S*Ci. SPLIT_K 0: where
    # the tiles leave SMs idle (batch 1, few output channels), the k-steps split the work
    # model's number of ways into fp32 partials summed by a deterministic second pass (1 never
    # splits; the packed-taps kernel never does). BLOCK_N 16 and 32: a few output channels (an
    # image head's 3 or 8), whose MMAs a 64-wide tile would run mostly on zeros
    "conv2d_fprop": _space((16, 32, 64, 128, 256), (16, 32, 64), {"GROUP_M": (1, 8), "SPLIT_K": (0, 1)}),
    # grad_W[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci]. SPLIT_K > 0 splits
    # the N*P*Q reduction that many ways into fp32 partials summed by a deterministic second
    # pass; 0 takes the split count a work model finds fastest (whole waves of CTAs on the
    # SMs); -1 is stream-K: every CTA runs an equal share of the (tile, k-step) iterations and
    # the CTA that finishes a tile shared between CTAs sums its pieces in CTA order.
    "conv2d_wgrad": _space(
        (16, 32, 64, 128, 256),
        (32, 64, 128),
        {"SPLIT_K": (-1, 0, 1, 2, 4, 8, 16, 32)},
        num_stages=(*_STAGES, 8, 10, 12),
    ),
    # grad_x by output phase: each phase's implicit GEMM is M = its pixels (TMA im2col of
    # grad_out), N = Ci, K = its taps * Co; every phase's tiles in one persistent grid of
    # CTAS_PER_SM CTAs per SM: at 2, one CTA's epilogue runs beside the other's WGMMAs (a
    # strided dgrad's phases have a few k-steps per tile, so its epilogues are a large share of
    # the time). BLOCK_N 32: few input channels (an image
    # layer's 3 or 4) or Ci in 32s. SPLIT_K 0: where the tiles leave SMs idle, a stride-1
    # dgrad's k-steps split the work model's number of ways into fp32 partials summed by a
    # deterministic second pass (1 never splits).
    "conv2d_dgrad": _space(
        (32, 64, 128, 256), (16, 32, 64), {"GROUP_M": (1, 8), "CTAS_PER_SM": (1, 2), "SPLIT_K": (0, 1)}
    ),
}

"""Spaces of the Blackwell (sm_100a) Gluon kernels: tcgen05 MMA into tensor memory.

Starting points are the reference designs in shared/seeds (conv fprop 004, conv wgrad 000,
persistent matmul 001), widened where the hardware allows:
- BLOCK_M 64 or 128: the single-CTA tcgen05 instruction shapes (M=256 needs a 2-CTA pair);
- BLOCK_N up to 256, the largest MMA N; NUM_ACC=2 accumulators of 256 fp32 columns fill
  the 512 columns of tensor memory exactly (NUM_ACC stays a parameter, at 2: a single
  accumulator serializes the epilogue with the next tile's main loop and frees nothing
  another CTA could use; it compiled and fit, and cost CI time for no candidate);
- NUM_BUFFERS 2..6 operand stages (the wgrad's also 8, 10, 12): the seed figures show
  Blackwell still gaining at 4, and small tiles leave room for more in the 227 KiB of shared
  memory;
- GROUP_M (grouped tile order for L2 reuse) and SPLIT_K are runtime arguments of the
  kernels: they change the schedule, not the code, so configs that differ only in them
  share one compiled kernel (the matmul's split launches share one binary of their own, its
  unsplit launches another).
`num_warps` is the epilogue partition's warps; the load and MMA partitions have one warp
each. The seeds run Blackwell at 4 (the persistent-matmul figures show 8 slower there).

Not every config fits: `prune()` in each kernel module drops the ones that exceed shared
or tensor memory, and tests/integration/test_compile_targets.py checks those rules against the
compiler over the whole space.
"""

from . import ConfigSpace

_STAGES = (2, 3, 4, 5, 6)


def _space(block_n: tuple, block_k: tuple, schedule: dict, buffers: tuple = _STAGES) -> ConfigSpace:
    """A Blackwell kernel's space: BLOCK_M, the accumulators and the epilogue's warps are every
    kernel's (see above); the rest is the op's."""
    return ConfigSpace(
        {
            "BLOCK_M": (64, 128),
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "NUM_BUFFERS": buffers,
            "NUM_ACC": (2,),
            **schedule,
            "num_warps": (4,),
        }
    )


SPACES = {
    # c[M, N] = a[M, K] @ b[K, N]; SPLIT_K as the Hopper matmul's: > 1 cuts each tile's K that
    # many ways into fp32 partials summed in split order by the tile's last split, 0 takes the split
    # count gluon_host's work model finds fastest, 1 never splits; SWAP_AB as the Hopper matmul's
    # (gluon_matmul.matmul_as_launched)
    "matmul": _space((64, 128, 256), (64, 128), {"GROUP_M": (1, 8), "SPLIT_K": (0, 1, 2, 4, 8), "SWAP_AB": (0, 1)}),
    # implicit GEMM: M = N*P*Q output pixels (TMA im2col rows), N = Co, K = R*S*Ci; SPLIT_K and
    # BLOCK_N 16 as the Hopper fprop's: 0 splits the k-steps the work model's number of ways
    # where the tiles leave SMs idle (batch 1), 1 never splits; a 16-wide tile for an image head
    "conv2d_fprop": _space((16, 32, 64, 128, 256), (32, 64, 128), {"GROUP_M": (1, 4, 8), "SPLIT_K": (0, 1)}),
    # grad_W[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci]:
    # M = Co, N = Ci at one filter tap (r, s), K = N*P*Q split SPLIT_K ways and reduced
    # deterministically by a second kernel; 0 takes the split count gluon_host's work model
    # finds fastest; -1 is stream-K (every CTA an equal run of (tile, k-step) iterations, the
    # tiles CTAs share summed in CTA order): the Hopper wgrad's schedules. Rings up to 12 deep
    # as the Hopper wgrad's: a 1x1 over many pixels waits on memory, and cuBLAS ran ResNet-50's
    # on an H100 with 8 and 13 stages of K 64 (the packed-taps and few-Co kernels keep 4)
    "conv2d_wgrad": _space(
        (64, 128, 256), (64, 128), {"SPLIT_K": (-1, 0, 1, 2, 4, 8, 16, 32)}, buffers=(*_STAGES, 8, 10, 12)
    ),
    # grad_x by output phase (conv2d_dgrad_hopper's schedule): M = a phase's pixels (TMA im2col
    # of grad_out), N = Ci, K = its taps * Co; every phase's tiles in one persistent grid.
    # SPLIT_K as the Hopper dgrad's: 0 splits a stride-1 dgrad's k-steps the work model's number
    # of ways where its tiles leave SMs idle, 1 never splits
    "conv2d_dgrad": _space((32, 64, 128, 256), (32, 64, 128), {"GROUP_M": (1, 4, 8), "SPLIT_K": (0, 1)}),
}

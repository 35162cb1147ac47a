"""Spaces of the portable `triton.language` kernels (any CUDA GPU, and the CPU interpreter).

Wide on purpose: the static rules in portable_rules.py cut each to a few dozen candidates
for a given problem and device (about a minute of tuning on a GPU)."""

from . import ConfigSpace

_BLOCKS = (16, 32, 64, 128)


def _space(schedule: dict, num_stages: tuple = (2, 3, 4)) -> ConfigSpace:
    """Every portable kernel's tiles and warps; what differs is its schedule parameter (GROUP_M
    or SPLIT_K) and how deep its loads pipeline."""
    return ConfigSpace(
        {
            "BLOCK_M": _BLOCKS,
            "BLOCK_N": _BLOCKS + (256,),
            "BLOCK_K": (16, 32, 64),
            **schedule,
            "num_warps": (2, 4, 8),
            "num_stages": num_stages,
        }
    )


SPACES = {
    "matmul": _space({"GROUP_M": (8,)}, num_stages=(2, 3, 4, 5)),
    # implicit GEMM: M = N*P*Q output pixels, N = Co, K = R*S*Ci
    "conv2d_fprop": _space({"GROUP_M": (8,)}),
    # grad_W[Co, R*S*Ci] = grad_out^T[Co, N*P*Q] @ im2col(x)[N*P*Q, R*S*Ci], split along N*P*Q
    "conv2d_wgrad": _space({"SPLIT_K": (1, 2, 4, 8, 16, 32)}),
    # grad_x by output phase (program ids phase-major): M = a phase's pixels, N = Ci, K = its taps * Co
    "conv2d_dgrad": _space({"GROUP_M": (8,)}),
}

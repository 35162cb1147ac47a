"""What the portable backends share on the host: their pruning (plain data in, bool out), their
default configs fitted to a problem, and the keyword arguments of a launch. A backend states
only its own: the problem's extent along each tile dimension (`sizes`), its implicit GEMM, its
default tiles and the arguments of its kernel."""

from __future__ import annotations

from typing import Callable

from .geometry import pow2_at_least
from .hardware import HOPPER
from .spaces.portable import SPACES


def supports(p: dict, device) -> bool:
    """A portable kernel runs every problem of its op, on any GPU Triton supports and on the
    CPU interpreter."""
    return True


def interpreter_ok(c: dict, sizes: dict[str, int], fixed: dict) -> bool:
    """On the CPU interpreter only tile shapes matter: warps and stages change nothing, and a
    tile far larger than the problem only costs time. Keep one value of each fixed knob."""
    if any(c[k] != v for k, v in fixed.items() if k in c):
        return False
    if any(c[b] > max(16, pow2_at_least(n)) for b, n in sizes.items()):
        return False
    return c["BLOCK_M"] * c["BLOCK_N"] <= 64 * 64


def gpu_ok(c: dict, sizes: dict[str, int], itemsize: int, smem_limit: int = HOPPER.smem_per_block) -> bool:
    """Static rules for a GPU: the pipelined tiles fit in shared memory; no tile dimension is
    more than twice the problem's, nor 16 where the problem is large; large problems get
    large tiles; warps match the tile (2 up to 64x64, 4 up to 128x128, 8 from 128x128); the
    fp32 accumulator stays within ~128 registers per thread. `smem_limit`: by default the
    Hopper part's per-block limit, which these rules were written against, on every GPU."""
    smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * itemsize
    if smem > smem_limit:
        return False
    for b, n in sizes.items():
        if c[b] > max(16, 2 * pow2_at_least(n)) or (c[b] == 16 and n > 32):
            return False
    tile = c["BLOCK_M"] * c["BLOCK_N"]
    if min(sizes["BLOCK_M"], sizes["BLOCK_N"]) >= 512 and tile < 64 * 128:
        return False
    warps = c["num_warps"]
    if (warps == 8 and tile < 128 * 128) or (warps == 4 and tile > 128 * 128) or (warps == 2 and tile > 64 * 64):
        return False
    return tile // (32 * warps) <= 128


def default(cpu: dict, gpu: dict, sizes: dict[str, int], device) -> dict:
    """The default config for the device (`cpu` on the interpreter, `gpu` elsewhere) shrunk to a
    small problem, so that the pruning keeps it: no tile dimension past the largest the rules
    allow for the problem's (`interpreter_ok` on the CPU, `gpu_ok` on a GPU), and warps to match
    the smaller tile."""
    c = dict(cpu if device.arch == "cpu" else gpu)
    for b, n in sizes.items():
        c[b] = min(c[b], max(16, pow2_at_least(n) if device.arch == "cpu" else 2 * pow2_at_least(n)))
    if device.arch != "cpu" and c["num_warps"] == 8 and c["BLOCK_M"] * c["BLOCK_N"] < 128 * 128:
        c["num_warps"] = 4
    return c


INTERPRETER_FIXED = {"num_warps": 4, "num_stages": 3, "GROUP_M": 8}


# a config's parameters the host reads itself; the kernel takes the rest as keyword arguments
HOST_PARAMS = ("SPLIT_K",)


def launch_options(config: dict, t, kind: str) -> dict:
    """A portable kernel's keyword arguments under config: its meta-parameters and launch
    options (all of config but HOST_PARAMS), UPCAST for operands like t, and its dot's input
    precision: torch's for float32 products of this `kind` ("matmul" or "conv"), the key's too."""
    from .problems import dot_precision

    options = {k: v for k, v in config.items() if k not in HOST_PARAMS}
    return {**options, "UPCAST": interpreter_upcast(t), "INPUT_PRECISION": dot_precision(t, kind)}


def interpreter_upcast(t) -> bool:
    """The CPU interpreter computes tl.dot in numpy, which has no bfloat16 (it multiplies the
    raw bits as integers): upcast the operands there. On a GPU, bf16 goes to the tensor cores."""
    import torch

    return t.device.type == "cpu" and t.dtype == torch.bfloat16


# the portable kernels' candidates on a GPU: they run what the Gluon kernels do not take (and
# GPUs they are not written for), where the vendor's op competes too (tuner), so a few of the
# best-ranked bound a first call's tune to seconds (40 made a float32 matmul's 49 s)
GPU_TOP_K = 16


def ranked(configs: list[dict], gemm: tuple[int, int, int], sm_count: int, k: int = GPU_TOP_K) -> list[dict]:
    """Keep the k configs a simple performance model likes best (as triton.autotune's
    `perf_model` + `top_k`): little padding, full waves of tiles, large tiles for reuse.
    The benchmark then decides among them; this only bounds tuning time to about a minute."""
    M, N, _ = gemm
    sms = max(1, sm_count)

    def score(c: dict) -> float:
        bm, bn, split = c["BLOCK_M"], c["BLOCK_N"], c.get("SPLIT_K", 1)
        tm, tn = -(-M // bm), -(-N // bn)
        pad = (M * N) / (tm * bm * tn * bn)
        tiles = tm * tn * split
        waves = -(-tiles // sms)
        fill = tiles / (waves * sms)
        reuse = min(1.0, (bm * bn / (bm + bn)) / 64)
        return pad * fill * reuse

    order = sorted(range(len(configs)), key=lambda i: (-score(configs[i]), i))
    return [configs[i] for i in order[:k]]  # best first: a caller may cut the list shorter


def prune(
    configs: list[dict], p: dict, device, sizes: dict[str, int], gemm: tuple[int, int, int], gpu_extra=None
) -> list[dict]:
    """The portable kernels' pruning: interpreter rules on the CPU; on a GPU the static rules
    (plus the kernel's own `gpu_extra(config)`), then the best-ranked few."""
    if device.arch == "cpu":
        return [c for c in configs if interpreter_ok(c, sizes, INTERPRETER_FIXED)]
    itemsize = 4 if p["dtype"] == "float32" else 2
    kept = [c for c in configs if gpu_ok(c, sizes, itemsize) and (gpu_extra is None or gpu_extra(c))]
    return ranked(kept, gemm, device.sm_count)


def host_rules(op: str, extents: Callable[[dict], tuple], cpu: tuple, gpu: tuple) -> tuple:
    """A portable backend's (supports, config_space, prune, default_config), from what is its own:
    `extents(p)`, the problem's extent along (BLOCK_M, BLOCK_N, BLOCK_K) and its implicit GEMM's
    (M, N, K), and its default (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) on the CPU interpreter
    (`cpu`) and on a GPU (`gpu`), GROUP_M 8 and 3 stages."""

    def sizes(p: dict) -> dict[str, int]:
        return dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), extents(p)[0]))

    def config_space(p: dict, device) -> list[dict]:
        return list(SPACES[op])

    def prune_space(configs: list[dict], p: dict, device) -> list[dict]:
        return prune(configs, p, device, sizes(p), extents(p)[1])

    def default_config(p: dict, device) -> dict:
        cpu_c, gpu_c = ({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "num_warps": w, "num_stages": 3}
                        for m, n, k, w in (cpu, gpu))  # fmt: skip
        return default(cpu_c, gpu_c, sizes(p), device)

    return supports, config_space, prune_space, default_config

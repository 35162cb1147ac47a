"""The launcher picks blackwell on capability 10.x, hopper on 9.0, portable elsewhere —
decided from device facts alone, so a CPU host can key (and pre-tune for) any device."""

from __future__ import annotations

import pytest

from tunecache import backends
from tunecache.key import DeviceClass, TuneKey

BF16_MM = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16", "a_layout": "row", "b_layout": "row"}
CONV = {
    "N": 128,
    "H": 56,
    "W": 56,
    "Ci": 64,
    "Co": 64,
    "R": 3,
    "S": 3,
    "stride_h": 1,
    "stride_w": 1,
    "pad_h": 1,
    "pad_w": 1,
    "P": 56,
    "Q": 56,
    "dtype": "bfloat16",
    "gemm_M": 128 * 56 * 56,
    "gemm_N": 64,
    "gemm_K": 576,
}


@pytest.mark.parametrize(
    "arch,expected",
    [("sm_100", "blackwell"), ("sm_103", "blackwell"), ("sm_90", "hopper"), ("sm_80", "portable"), ("cpu", "portable")],
)
def test_backend_by_capability(arch, expected):
    dev = DeviceClass(arch, 148)
    assert backends.backend_for("matmul", dev, BF16_MM).BACKEND == expected
    assert backends.backend_for("conv2d_fprop", dev, CONV).BACKEND == expected


def test_fp32_falls_back_to_portable_on_hopper():
    p = dict(BF16_MM, dtype="float32")
    assert backends.backend_for("matmul", DeviceClass("sm_90", 132), p).BACKEND == "portable"


def test_sm_count_separates_device_classes():
    sxm = TuneKey("matmul.hopper", "v", "3.9.0", "sm_90", 132, BF16_MM)
    pcie = TuneKey("matmul.hopper", "v", "3.9.0", "sm_90", 114, BF16_MM)
    assert sxm.digest != pcie.digest


def test_device_facts_can_be_given(monkeypatch):
    import torch

    from tunecache.key import device_of

    monkeypatch.setenv("TUNECACHE_DEVICE", "sm_100:148:NVIDIA B200")
    dev = device_of(torch.empty(1))
    assert (dev.arch, dev.sm_count, dev.capability) == ("sm_100", 148, (10, 0))
    with pytest.raises(ValueError, match="ARCH:SM_COUNT"):
        DeviceClass.parse("sm_90")


def test_kernel_version_tracks_source_and_space():
    mod = backends.backend_module("matmul", "portable")
    v = backends.kernel_version(mod)
    assert len(v) == 16 and v == backends.kernel_version(mod)
    assert v != backends.kernel_version(backends.backend_module("conv2d_fprop", "portable"))


SMALL_AND_ODD = {
    "matmul": [
        {"M": 5, "N": 4, "K": 6, "dtype": "float32"},
        {"M": 1, "N": 4096, "K": 4096, "dtype": "bfloat16"},
        {"M": 3, "N": 17, "K": 9, "dtype": "float16", "a_layout": "col"},
    ],
    "conv2d_fprop": [
        {"N": 2, "H": 7, "W": 7, "Ci": 3, "Co": 5, "R": 3, "S": 3, "stride": 2, "padding": 1, "dtype": "float32"},
        {"N": 1, "H": 224, "W": 224, "Ci": 3, "Co": 64, "R": 7, "S": 7, "stride": 2, "padding": 3, "dtype": "bfloat16"},
    ],
    "conv2d_wgrad": [
        {"N": 2, "H": 7, "W": 7, "Ci": 3, "Co": 5, "R": 3, "S": 3, "stride": 2, "padding": 1, "dtype": "float32"},
        {"N": 1, "H": 9, "W": 9, "Ci": 1, "Co": 3, "R": 1, "S": 1, "stride": 3, "padding": 0, "dtype": "float16"},
    ],
}


@pytest.mark.parametrize("arch", ["cpu", "sm_80"])
@pytest.mark.parametrize("op", sorted(SMALL_AND_ODD))
def test_an_untuned_call_runs_the_portable_kernel_on_small_and_odd_shapes(op, arch):
    """The default config (what policy `default` launches before a worker tunes) fits the
    problem: the backend's own pruning keeps it, rather than sending the call to PyTorch."""
    from tunecache.tuning.compile import canonical_problem

    mod = backends.backend_module(op, "portable")
    dev = DeviceClass(arch, 0 if arch == "cpu" else 108)
    for given in SMALL_AND_ODD[op]:
        p = canonical_problem(op, given)
        default = mod.default_config(p, dev)
        assert mod.prune([default], p, dev) == [default], (given, default)
        assert default in mod.config_space(p, dev), "a default outside the space could not be published"

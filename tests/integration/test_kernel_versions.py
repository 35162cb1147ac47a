"""A kernel version covers exactly the code its backend runs: editing Hopper-only host code
leaves Blackwell entries valid, and editing the matmul leaves the convolutions' entries valid.
Each case edits one file of a temporary copy of the kernels and asks a fresh process (importing
that copy) for every backend's version."""

from __future__ import annotations

import pytest

from support import versions_after_edit

BACKENDS = [
    f"{op}.{b}" for op in ("matmul", "conv2d_fprop", "conv2d_wgrad") for b in ("blackwell", "hopper", "portable")
]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    return versions_after_edit(tmp_path_factory.mktemp("kernels"), BACKENDS)


@pytest.mark.parametrize(
    "edited,moved",
    [
        ("gluon_hopper.py", {"matmul.hopper", "conv2d_fprop.hopper", "conv2d_wgrad.hopper"}),
        ("gluon_launch.py", {"matmul.hopper", "conv2d_fprop.hopper", "conv2d_wgrad.hopper"}),
        ("gluon_blackwell.py", {"matmul.blackwell", "conv2d_fprop.blackwell", "conv2d_wgrad.blackwell"}),
        ("matmul_hopper.py", {"matmul.hopper"}),
        ("conv2d_fprop_hopper.py", {"conv2d_fprop.hopper"}),
        # the Gluon convolutions run geometry.is_pointwise (it picks the IM2COL variant); the problem
        # functions beside it shape the key's problem, not a kernel's code
        (
            "geometry.py",
            {"conv2d_fprop.hopper", "conv2d_fprop.blackwell", "conv2d_wgrad.hopper", "conv2d_wgrad.blackwell"},
        ),
    ],
)
def test_an_edit_moves_exactly_the_versions_of_the_backends_that_run_it(copies, edited, moved):
    before, after = copies(None), copies(edited)
    assert {k for k in BACKENDS if before[k] != after[k]} == moved

"""Tuning never hurts its caller: candidates compile and run in processes of tunecache's own,
a plain script with no `__main__` guard tunes, and a candidate that crashes or hangs is a
failed trial with its reason while tuning goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch


def _run_script(tmp_path, code: str, env: dict, timeout: float = 600, stdin: bool = False):
    full = {**os.environ, **env}
    code = textwrap.dedent(code)
    if stdin:  # notebook-style: `python - <<EOF`, no file and no `__main__` guard
        return subprocess.run(
            [sys.executable, "-"], input=code, env=full, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
        )
    script = tmp_path / "train.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], env=full, capture_output=True, text=True, timeout=timeout, cwd=tmp_path
    )


PLAIN_TUNE = """
import torch
from tunecache import ops
from tunecache.store import default_store
torch.manual_seed(1)
a, b = torch.randn(40, 24), torch.randn(24, 36)
torch.testing.assert_close(ops.matmul(a, b), a @ b)
print("TRIALS", default_store().counts()["trials"])
"""


def test_a_plain_script_and_a_notebook_cell_tune(tmp_path, db_url):
    for stdin in (False, True):
        proc = _run_script(tmp_path, PLAIN_TUNE, {"TUNECACHE_DB_URL": f"{db_url}{int(stdin)}"}, stdin=stdin)
        assert proc.returncode == 0, proc.stderr[-3000:]
        trials = int(proc.stdout.split("TRIALS")[-1])
        assert trials >= 2, proc.stdout


PLAIN_COMPILE = """
from tunecache.tuning.compile_pool import compile_space
reports = compile_space("matmul", "hopper", "sm_90a", {"M": 512, "N": 512, "K": 512, "dtype": "float16"},
                        workers=2)
reports = reports[:4]
print("COMPILED", sum(r.compiled for r in reports), len(reports), reports[0].error)
"""


def test_a_plain_script_compiles_gluon_kernels_in_parallel(tmp_path):
    # the compile path with no GPU: spawned pools used to re-run the caller's __main__ and die
    code = PLAIN_COMPILE.replace("reports = reports[:4]", "")
    code = code.replace('compile_space("matmul"', 'compile_space("matmul"')
    small = (
        "import tunecache_kernels.matmul_hopper as m\n"
        "_space = m.config_space\n"
        "m.config_space = lambda p, d: _space(p, d)[:3]\n"
    )
    proc = _run_script(tmp_path, small + code, {"TRITON_CACHE_DIR": str(tmp_path / "triton")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.split("COMPILED")[-1].split()
    assert int(line[0]) == int(line[1]) == 3, proc.stdout


def _crashy():
    import crashy_backend  # tests/support/kernels, on sys.path through pytest's `pythonpath`

    return crashy_backend


def test_a_crashing_or_hanging_candidate_is_a_failed_trial_and_tuning_goes_on(db_url, monkeypatch):
    from tunecache.key import interpreter_device
    from tunecache.tuning.isolated import runner_for
    from tunecache.tuning.tuner import tune

    monkeypatch.setenv("TUNECACHE_CANDIDATE_TIMEOUT_S", "5")
    mod = _crashy()
    mod.register(monkeypatch)
    problem = mod.problem(torch.randn(24, 16), torch.randn(16, 20))
    state = torch.random.get_rng_state()
    result = tune(mod, problem, interpreter_device())
    assert result.config["behaviour"] == "ok"
    by = {t.config["behaviour"]: t for t in result.trials}
    assert by["segfault"].status == "failed" and "SIGSEGV" in by["segfault"].error
    assert by["hang"].status == "failed" and "timed out after 5 s" in by["hang"].error
    assert by["exit"].status == "failed" and "exited with 3" in by["exit"].error
    assert by["raise"].status == "failed" and "cannot launch here" in by["raise"].error
    assert by["ok"].status == "ok"
    # the caller is untouched: same process, same random state, and the runner was replaced
    assert torch.equal(torch.random.get_rng_state(), state)
    assert runner_for("cpu").started >= 4


def test_a_candidate_timeout_is_a_setting(monkeypatch):
    import pytest

    from tunecache import settings

    monkeypatch.setenv("TUNECACHE_CANDIDATE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TUNECACHE_CANDIDATE_TIMEOUT_S must be a number of seconds"):
        settings.candidate_timeout_s()

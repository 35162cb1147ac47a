"""Triton's cache key is Triton's, computed once per install and remembered in Triton's cache
directory (tunecache/triton_key_cache.py): a process that finds it there does not hash
libtriton again, and gets exactly the key Triton would compute."""

from __future__ import annotations

import json

from support import run_py

KEY = """
import json

from tunecache.tuning import triton_key_cache
import triton.runtime.cache as cache
triton_key_cache.install()
key = cache.triton_key()
print(json.dumps({"key": key}))
"""
TRITONS_OWN = "import json, triton.runtime.cache as c; print(json.dumps({'key': c.triton_key()}))"


def key_of(env: dict) -> str:
    return json.loads(run_py(KEY, env).stdout.strip().splitlines()[-1])["key"]


def test_the_key_is_tritons_own_and_is_kept_in_tritons_cache_directory(tmp_path):
    env = {"TRITON_CACHE_DIR": str(tmp_path)}
    tritons = json.loads(run_py(TRITONS_OWN, env).stdout)["key"]
    assert key_of(env) == tritons  # computed by Triton, then kept
    (kept,) = json.loads((tmp_path / "tunecache-triton-key.json").read_text()).values()
    assert kept == tritons
    assert key_of(env) == tritons
    # read back, not computed again: what the file says for this install is what Triton is given
    path = tmp_path / "tunecache-triton-key.json"
    (fingerprint,) = json.loads(path.read_text())
    path.write_text(json.dumps({fingerprint: tritons + "-as-kept"}))
    assert key_of(env) == tritons + "-as-kept"


def test_a_file_that_is_corrupt_or_for_other_files_is_not_believed(tmp_path):
    env = {"TRITON_CACHE_DIR": str(tmp_path)}
    tritons = json.loads(run_py(TRITONS_OWN, env).stdout)["key"]
    path = tmp_path / "tunecache-triton-key.json"
    path.write_text("{not json")
    assert key_of(env) == tritons
    # another install's fingerprint with another key: this install's is computed and kept beside it
    path.write_text(json.dumps({"0" * 64: "3.9.0-someone-elses"}))
    assert key_of(env) == tritons
    assert set(json.loads(path.read_text()).values()) == {tritons, "3.9.0-someone-elses"}

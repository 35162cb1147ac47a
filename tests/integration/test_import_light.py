"""`import tunecache` is cheap: training jobs import it, and it must not drag in torch,
Triton or SQLAlchemy before they are used. The config spaces import neither torch nor
Triton (the service validates against them)."""

from __future__ import annotations

from support import run_py


def test_import_tunecache_is_light():
    out = run_py(
        "import sys, tunecache; print(sorted(m for m in ('torch', 'triton', 'sqlalchemy', 'alembic', "
        "'httpx') if m in sys.modules))"
    )
    assert out.stdout.strip() == "[]"


def test_config_spaces_import_neither_torch_nor_triton():
    out = run_py(
        "import sys; from tunecache_kernels.spaces import kernels, space_for; "
        "ks = kernels(); [len(space_for(k)) for k in ks]; "
        "print(sorted(m for m in ('torch', 'triton') if m in sys.modules), len(ks))"
    )
    mods, n = out.stdout.split("]")
    assert mods.strip() == "[" and int(n) >= 3


def test_the_fleet_client_imports_no_database_layer():
    """A host that only talks to the fleet loads the client, the `Fleet` protocol and the plain
    records (tunecache.store.records): none of them may drag in SQLAlchemy (nor torch or Triton)."""
    out = run_py(
        "import sys, tunecache.fleet.client, tunecache.fleet.protocol, tunecache.store.records, "
        "tunecache.store.faults; "
        "print(sorted(m for m in ('torch', 'triton', 'sqlalchemy', 'alembic') if m in sys.modules))"
    )
    assert out.stdout.strip() == "[]"


def test_a_plain_op_call_registers_no_custom_ops(tmp_path):
    """A warm host's first `ops.matmul` does not pay for the torch.library registrations of
    the autograd ops (0.2 s): `ops.linear` and `ops.conv2d` make them on first use."""
    out = run_py(
        "import sys, torch; from tunecache import ops; a = torch.randn(8, 8); ops.matmul(a, a); "
        "print(sorted(m for m in ('tunecache.ops.custom',) if m in sys.modules)); "
        "ops.linear(a, a); print('tunecache.ops.custom' in sys.modules)",
        env={"TUNECACHE_DB_URL": f"sqlite:///{tmp_path / 'none' / 'store.sqlite'}", "TUNECACHE_MISS_POLICY": "default"},
    )
    assert out.stdout.split() == ["[]", "True"], out.stdout + out.stderr

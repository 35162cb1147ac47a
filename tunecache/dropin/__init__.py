"""Your own Triton kernels: `@tunecache.autotune`, `triton.autotune` whose results are kept in the
store and the fleet, and `patch_triton()`, which makes it Triton's.

    @tunecache.autotune(configs=[triton.Config({"BLOCK_M": 64}, num_warps=4), ...], key=["M", "N", "K"])
    @triton.jit
    def matmul_kernel(...): ...

Same signature and behaviour as `triton.autotune` in Triton 3.9. A key this process has not
seen is looked up in the local store, then in the fleet, and benchmarked only when neither
has a winner; the winner and every candidate's timing are stored and published.
`patch_triton()` routes existing `triton.autotune` uses through it without editing their code.

This module imports neither Triton nor torch: `import tunecache` exports it and must stay
light. The work is done by `tunecache.dropin.autotuner.Autotuner`, imported when a kernel is
decorated.
"""

from __future__ import annotations

import importlib
import sys
import threading


def autotune(
    configs,
    key,
    prune_configs_by=None,
    reset_to_zero=None,
    restore_value=None,
    pre_hook=None,
    post_hook=None,
    warmup=None,
    rep=None,
    use_cuda_graph=False,
    do_bench=None,
    cache_results=False,
):
    """Decorator for auto-tuning a `triton.jit`'d function, with persistent, shared results.

    The arguments are `triton.autotune`'s (see its documentation). `cache_results` is accepted
    and ignored: results are always kept, in the store named by TUNECACHE_DB_URL (a SQLite file
    under the user cache dir by default) and in the fleet named by TUNECACHE_SERVER_URL.

    A stored result is keyed by the kernel (its module and name), its version (Triton's
    `cache_key` of the kernel and what it calls, and the list of configs), the Triton version,
    the device class (capability and SM count) and the problem (the values of the `key`
    arguments and the dtypes of the tensor arguments, as Triton keys its own memo). A stored
    config is launched only as the live decorator's own `triton.Config` with identical values,
    so a config's `pre_hook` runs as it would after benchmarking.

    Under TRITON_INTERPRET=1 without a `do_bench`, candidates are timed by the wall clock.
    """

    def decorator(fn):
        from tunecache.dropin.autotuner import Autotuner

        return Autotuner(
            fn,
            fn.arg_names,
            configs,
            key,
            reset_to_zero,
            restore_value,
            pre_hook=pre_hook,
            post_hook=post_hook,
            prune_configs_by=prune_configs_by,
            warmup=warmup,
            rep=rep,
            use_cuda_graph=use_cuda_graph,
            do_bench=do_bench,
            cache_results=cache_results,
        )

    return decorator


# Where Triton exposes its decorator. `from triton import autotune` executed after
# patch_triton() gets ours; a module that took the name before keeps Triton's.
_TRITON_NAMES = (("triton", "autotune"), ("triton.runtime", "autotune"), ("triton.runtime.autotuner", "autotune"))
_ORIGINALS: dict[tuple[str, str], object] = {}
_PATCH_LOCK = threading.Lock()


def patch_triton() -> None:
    """Make `triton.autotune` (and `triton.runtime.autotune`) this module's `autotune`.

    Kernels decorated after the call keep their tuning in the store. Idempotent; undone by
    `unpatch_triton()`.
    """
    with _PATCH_LOCK:
        for module_name, attr in _TRITON_NAMES:
            module = importlib.import_module(module_name)
            current = getattr(module, attr)
            if current is not autotune:
                _ORIGINALS.setdefault((module_name, attr), current)
                setattr(module, attr, autotune)


def unpatch_triton() -> None:
    """Give Triton its own `autotune` back (kernels already decorated keep ours)."""
    with _PATCH_LOCK:
        for (module_name, attr), original in _ORIGINALS.items():
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, attr, None) is autotune:
                setattr(module, attr, original)
        _ORIGINALS.clear()

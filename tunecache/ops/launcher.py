"""From a call to a launch: memo -> config cache (local store -> fleet) -> miss policy.

The hot path is `Op.memo.get(raw)` in `ops` (a pointwise conv's: `Op.as_matmul.get(raw)`): a
dict lookup on the raw shapes, strides, dtypes and arguments, then the cached launch.
Everything below runs once per raw shape.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from tunecache import backends, settings
from tunecache.cache.config_cache import CACHE
from tunecache.errors import short
from tunecache.key import DeviceClass, TuneKey, device_of, torch_device_for, use_interpreter_without_gpu
from tunecache.ops import selfcheck
from tunecache.store import process as process_store
from tunecache.store.records import ConfigRecord
from tunecache.tuning import triton_driver
from tunecache.tuning.tuner import TuneError, make_key, tune
from tunecache_kernels import gluon_launch as direct
from tunecache_kernels.spaces import VENDOR, is_vendor

if TYPE_CHECKING:
    pass

direct.set_direct_launch(settings.gluon_direct_launch())  # the kernels read no settings: told here

log = logging.getLogger("tunecache")


class MissingConfig(LookupError):
    """Miss policy `strict` and no tuned config for this key."""


@dataclass
class Entry:
    """A memoized decision: the backend's launch bound to a config."""

    run: Callable[..., Any]
    config: dict
    kernel: str
    provisional: bool = False  # a default config, run until a winner is known: asked again after `recheck_at`
    recheck_at: float = math.inf
    key: TuneKey | None = None
    mod: ModuleType | None = None
    problem: dict = field(default_factory=dict)
    device: DeviceClass | None = None
    from_cache: bool = False  # tuned or read from the store or the fleet (dropped if it fails)
    fallbacks: tuple = ()  # the next backends, in order, should this one fail at launch
    vendor: bool = False  # the vendor's op won: `run` is torch's call of it


class Op:
    """One op (e.g. "conv2d_fprop"): its memo and the slow path that fills it."""

    def __init__(self, name: str, problem_fn: Callable[..., dict]) -> None:
        self.name = name
        self.problem_fn = problem_fn
        self.memo: dict[tuple, Entry] = {}
        self.as_matmul: dict[tuple, AsMatmul] = {}  # a pointwise conv's calls, under its own key
        self._lock = threading.Lock()

    def resolve(self, raw: tuple, args: tuple, device_tensor: Any) -> Entry:
        """The slow path: check arguments, pick a backend, look up or tune, memoize. The
        store writes this leaves behind (a fresh host's fleet copy) wait for the call's launch
        (`process_store.hold_writes`): the returned entry's `run` lets them go."""
        entry = self.memo.get(raw)
        if entry is not None and entry.provisional and time.monotonic() < entry.recheck_at:
            return entry  # a default before its recheck time: every call comes here
        process_store.hold_writes()
        try:
            entry = self._resolve(raw, args, device_tensor)
        except BaseException:
            process_store.release_writes()
            raise
        return dataclasses.replace(entry, run=_then_release_writes(entry.run))

    def _resolve(self, raw: tuple, args: tuple, device_tensor: Any) -> Entry:
        entry = self.memo.get(raw)
        if entry is not None and entry.provisional:
            entry = self._recheck(raw, entry)
            if entry is not None:
                return entry
        problem = self.problem_fn(*args)  # raises errors naming the bad argument
        if device_tensor.device.type == "cuda":
            triton_driver.start()  # a host's first Triton launch builds its C utilities: beside what follows
        device = device_of(device_tensor)
        if device.arch == "cpu":
            use_interpreter_without_gpu()  # a CPU-only host: its kernels run on Triton's interpreter
        if device.arch == "cpu" and not settings.triton_interpret() and not settings.device_override():
            # CPU tensors in a process where Triton compiles for the GPU: Triton cannot run them
            CACHE.warn_once(
                "tunecache: CPU tensors run PyTorch's own ops in this process (Triton compiles for "
                "the GPU here; set TRITON_INTERPRET=1 before importing Triton to run its kernels "
                "on the CPU)"
            )
            with self._lock:
                entry = self.memo[raw] = _reference_entry(
                    backends.backends_for(self.name, device, problem)[0], problem, device
                )
            return entry
        forced = settings.backend_override()
        with self._lock:  # one tune per shape per process, even under threads
            entry = self.memo.get(raw)
            if entry is None or entry.provisional:
                on_gpu = device_tensor.device.type == "cuda"
                where = torch_device_for(device, (device_tensor.device.index or 0) if on_gpu else None)
                every = backends.backends_for(self.name, device, problem, forced)
                if on_gpu and not forced:
                    _runner_ahead(every[0], problem, device, where)
                looked_up = None if forced else _look_up_first(every[0], problem, device)
                if (
                    forced
                    or _tune_checks_first(every[0], device, looked_up)
                    or _vendor_won(looked_up)
                    or (looked_up == [None] and _vendor_until_tuned(every[0], device))
                ):
                    # its tune checks each candidate, and the verdict follows from it (_decide); or
                    # torch's own op runs the key, no kernel of the backend to check (yet)
                    mods = every
                else:
                    mods = selfcheck.trusted(every, device, where)
                if mods and mods[0] is not every[0]:
                    looked_up = None  # another backend's key
                entry = (
                    _decide(self, raw, mods, problem, device, where, looked_up)
                    if mods
                    else _reference_entry(every[0], problem, device)
                )
                # the entry's launch is the first use of Triton's driver here (a tune compiles,
                # checks and times in processes of its own): its build ran beside the tune
                triton_driver.ready()
                self.memo[raw] = entry
        return entry

    def _recheck(self, raw: tuple, entry: Entry) -> Entry | None:
        """A default after its time: the same default (asked again later), or the winner now known."""
        if time.monotonic() < entry.recheck_at:
            return entry
        # the key's own backend: a provisional entry may be running another one's default
        mod = backends.module_for_kernel(entry.key.kernel)
        rec = CACHE.get(entry.key, launchable(mod, entry.problem, entry.device))
        if rec is None:
            entry.recheck_at = time.monotonic() + settings.recheck_seconds()
            return entry
        new = _entry(
            self, raw, mod, entry.problem, entry.device, rec.config, entry.key, rec=rec, fallbacks=entry.fallbacks
        )
        self.memo[raw] = new
        return new

    def fall_back(self, raw: tuple, entry: Entry, error: BaseException, args: tuple) -> Any:
        """A launch raised: drop its config, then run the default config, the next backend, and
        at last the PyTorch reference, so that the user's call returns the right answer."""
        reason = f"launching it raised {short(error)}"
        if entry.key is not None and entry.from_cache:
            CACHE.drop(entry.key, entry.config, reason, where="tuned")
        else:
            log.warning("tunecache: %s %s failed: %s", entry.mod.KERNEL, entry.config, reason)
        chain = [(entry.mod, entry.mod.default_config(entry.problem, entry.device))]
        chain += [(m, m.default_config(entry.problem, entry.device)) for m in entry.fallbacks]
        for mod, config in chain:
            if mod is entry.mod and config == entry.config:
                continue
            if launchable(mod, entry.problem, entry.device)(config) is not None:
                continue
            try:
                out = mod.launch(config, *args)
            except Exception as e:  # noqa: BLE001 - try the next one
                log.warning("tunecache: fallback %s %s failed too: %s", mod.KERNEL, config, short(e))
                continue
            log.warning("tunecache: %s now runs %s %s for this shape", self.name, mod.KERNEL, config)
            self.memo[raw] = Entry(
                _bind(self, raw, mod, config), config, mod.KERNEL, mod=mod, problem=entry.problem, device=entry.device
            )
            return out
        log.warning("tunecache: %s falls back to PyTorch for this shape", self.name)
        self.memo[raw] = _reference_entry(entry.mod, entry.problem, entry.device)
        return entry.mod.reference(*args)

    def clear(self) -> None:
        self.memo.clear()
        self.as_matmul.clear()

    def remember_as_matmul(self, raw: tuple, matmul: "Op", mraw: tuple, out_shape: tuple) -> None:
        """After a pointwise conv's call ran as the matmul `mraw`: launch its later calls
        straight on that matmul's plan (AsMatmul), where the matmul's entry has one."""
        fast = AsMatmul.of(matmul, mraw, out_shape)
        if fast is not None:
            self.as_matmul[raw] = fast


def _then_release_writes(run: Callable[..., Any]) -> Callable[..., Any]:
    def first_run(*args):
        try:
            return run(*args)
        finally:
            process_store.release_writes()

    return first_run


def _reference_entry(mod: ModuleType, problem: dict, device: DeviceClass) -> Entry:
    """PyTorch's own op: what runs when no backend can be trusted with this shape."""
    reference = mod.reference
    return Entry(lambda *a: reference(*a), {}, "torch", mod=mod, problem=problem, device=device)


def _bind(op: Op, raw: tuple, mod: ModuleType, config: dict) -> Callable[..., Any]:
    if is_vendor(config):  # the vendor's op won this key's tune: torch's call of it, as is
        return mod.reference
    return _Launch(op, raw, mod, config)


class _Launch:
    """An entry's launch. Backends with direct-launch plans (`plan_for`) make one at a call's
    first launch; the entry then runs that plan itself, past the backend's own lookup (the memo's
    key fixes everything a plan depends on but the current device, checked here): a call's host
    time is a launch's, not two dict lookups on tuples of shapes."""

    __slots__ = ("op", "raw", "launch", "config", "plan_for", "plan", "dev", "tries")

    def __init__(self, op: Op, raw: tuple, mod: ModuleType, config: dict) -> None:
        self.op, self.raw, self.launch, self.config = op, raw, mod.launch, config
        self.plan_for = getattr(mod, "plan_for", None)
        self.plan = self.dev = None
        self.tries = 3 if self.plan_for is not None else 0  # a call that never makes one stops asking

    def __call__(self, *args):
        plan = self.plan
        try:
            out = None if plan is None else self.planned(args[0], args[1])
            if out is not None:
                return out
            out = self.launch(self.config, *args)
        except Exception as e:  # noqa: BLE001 - a bad config never fails the user's call
            return self.op.fall_back(self.raw, self.op.memo[self.raw], e, args)
        if plan is None and self.tries:
            self.tries -= 1
            found = self.plan_for(self.config, *args)
            if found is not None:
                self.plan, self.dev = found
        return out

    def planned(self, a, b, out_shape: tuple | None = None):
        """The plan's launch of a call on a and b (out_shape: the matmul plan's, AsMatmul's), or
        None: no plan, direct launches off or hooked, another current device, or the plan
        declines the call."""
        plan = self.plan
        if plan is None or not direct.direct_launch_enabled():
            return None
        dev, stream = direct.current_device_and_stream()
        if dev != self.dev:
            return None
        return plan.run(a, b, stream) if out_shape is None else plan.run(a, b, stream, out_shape)


class AsMatmul:
    """A pointwise conv's launch as the matmul it is, memoized under the conv's own key
    (`Op.as_matmul`): the matmul's memo entry and its plan, launched on the conv's tensors (the
    matmul's operands are views on their storage) into an output made in the conv's shape. A
    call then costs a lookup and the plan's launch, not three views and the matmul's key: for
    a batch-1 1x1 conv (a 3-6 us kernel) the host's time is the call's. It stands while the
    matmul memo holds that entry (a recheck or a fallback replaces it); there, and where the
    plan cannot launch a call as is, and past a default entry's recheck time, it returns None
    and the caller takes the views' path. Where the vendor's op won the matmul, that op runs on
    the operands as the matmul's key states them (shapes and strides on the same storage), past
    the views' path too."""

    __slots__ = ("memo", "mraw", "entry", "launch", "out_shape")

    @classmethod
    def of(cls, matmul: Op, mraw: tuple, out_shape: tuple) -> "AsMatmul | None":
        entry = matmul.memo.get(mraw)
        if entry is None:
            return None
        launch = entry.run
        if not entry.vendor and (
            type(launch) is not _Launch or launch.plan is None or not getattr(launch.plan, "reshapeable", False)
        ):
            return None
        fast = cls()
        fast.memo, fast.mraw, fast.entry, fast.launch, fast.out_shape = matmul.memo, mraw, entry, launch, out_shape
        return fast

    def __call__(self, a, b):
        """The output, or None: take the views' path (the matmul's own entry and launch)."""
        entry = self.entry
        if self.memo.get(self.mraw) is not entry:
            return None
        if entry.provisional and time.monotonic() >= entry.recheck_at:
            return None  # the matmul's resolve rechecks it
        if entry.vendor:
            m = self.mraw  # the matmul's operands: (a.shape, a.stride(), .., .., b.shape, b.stride(), ..)
            return self.launch(a.as_strided(m[0], m[1]), b.as_strided(m[4], m[5])).view(self.out_shape)
        try:
            return self.launch.planned(a, b, self.out_shape)
        except Exception:  # noqa: BLE001 - the views' path launches it again, and falls back if it must
            return None


def _entry(
    op: Op,
    raw: tuple,
    mod: ModuleType,
    problem: dict,
    device: DeviceClass,
    config: dict,
    key: TuneKey,
    *,
    rec: ConfigRecord | None = None,
    fallbacks: tuple = (),
    provisional: bool = False,
) -> Entry:
    # A winner stays this process's for its key (every rank that read it runs it) until
    # `tunecache.refresh()`; only a default, run until a winner is known, is asked about again.
    return Entry(
        _bind(op, raw, mod, config),
        config,
        mod.KERNEL,
        provisional=provisional,
        recheck_at=time.monotonic() + settings.recheck_seconds() if provisional else math.inf,
        key=key,
        mod=mod,
        problem=problem,
        device=device,
        from_cache=not provisional,
        fallbacks=fallbacks,
        vendor=is_vendor(config),
    )


def in_space(kernel: str) -> Callable[[dict], str | None]:
    """The check that a config lies in the kernel's space (for `triton:` kernels, that it is a
    well-formed triton.Config): why not, or None."""
    from tunecache_kernels.spaces import space_for

    def check(config: dict) -> str | None:
        try:
            space_for(kernel).check(config)
        except (KeyError, ValueError) as e:
            return str(e)
        return None

    return check


def launchable(mod: ModuleType, problem: dict, device: DeviceClass) -> Callable[[dict], str | None]:
    """The check every config passes before it is launched: it lies in the kernel's space and
    the backend's own pruning keeps it for this problem and device."""
    space = in_space(mod.KERNEL)

    def check(config: dict) -> str | None:
        why = space(config)
        if why is not None:
            return why
        if is_vendor(config):  # the vendor's op runs every problem of its op, where it competes
            return None if settings.vendor_competes() else "the vendor's op, and TUNECACHE_VENDOR is off"
        if not mod.prune([config], problem, device):
            return f"the backend's pruning refuses it for this problem on {device} (resources or shape)"
        return None

    return check


def announce_tune(mod: ModuleType, problem: dict, device: DeviceClass, torch_device: str) -> Callable[..., None]:
    """Tuning blocks the caller's call: say so once, with what and roughly how long."""
    said = []

    def progress(stage: str, done: int, total: int, best_ms: float | None) -> None:
        if said:
            return
        said.append(stage)
        log.warning(
            "tunecache: %s; later calls and processes reuse the winner (TUNECACHE_MISS_POLICY=default never blocks)",
            tune_announcement(mod, problem, device, total, torch_device),
        )

    return progress


def tune_announcement(mod: ModuleType, problem: dict, device: DeviceClass, candidates: int, torch_device: str) -> str:
    """'tuning matmul.portable for M=40,N=36,K=24,dtype=float32 on cpu:0: 18 candidates,
    roughly 0.9 s (from 2 past tunes here)': what a tune about to start says (the launcher's
    announcement, `tunecache tune`'s first line)."""
    from tunecache.tuning.estimate import estimate_tune

    shape = ",".join(f"{k}={v}" for k, v in problem.items() if not k.startswith("gemm_"))
    estimate = estimate_tune(mod, problem, device, candidates, torch_device)
    return f"tuning {mod.KERNEL} for {shape} on {device}: {candidates} candidates, {estimate.text()}"


def _runner_ahead(mod: ModuleType, problem: dict, device: DeviceClass, torch_device: str) -> None:
    """A call this process will likely tune (policy `tune`, and the local store surely has no
    winner): start the trial runner now, so that its imports (torch alone takes seconds) run
    while the fleet is asked and the store opened, not after; and, with no fleet to answer,
    read the ranking (the store opened, SQLAlchemy and the schema: a second on an H200 host's
    first call) on a thread while Triton's driver builds and the lookups run. If the fleet
    answers after all, the runner waits, idle and without a CUDA context, for this process's
    next miss."""
    try:
        if settings.miss_policy() != "tune" or not CACHE.surely_missing(make_key(mod, problem, device).digest):
            return
        from tunecache.tuning.isolated import runner_for

        runner = runner_for(torch_device)
        if runner.proc is None:  # torch, not CUDA: a runner left idle holds no GPU memory
            runner.in_background(lambda: runner.warm_up(torch=True))
        if not settings.server_url():  # a fleet winner's first launch would share the interpreter with it
            reader = threading.Thread(target=_read_ranking, args=(mod.KERNEL, device), name="tunecache-ranking")
            reader.daemon = True
            reader.start()
    except Exception as e:  # noqa: BLE001 - only a head start: the tune starts it (or says why) itself
        log.debug("tunecache: could not start the trial runner ahead: %s", e)


def _read_ranking(kernel: str, device: DeviceClass) -> None:
    try:
        CACHE.ranking(kernel, device)
    except Exception as e:  # noqa: BLE001 - the tune reads it again and meets the same fault
        log.debug("tunecache: could not read the ranking ahead: %s", e)


def _look_up_first(mod: ModuleType, problem: dict, device: DeviceClass) -> "list[ConfigRecord | None]":
    """The preferred backend's lookup, before its self-check: a fleet winner for this very call
    (fetched now, or copied earlier, `tunecache sync` included) is the backend's verdict on this
    device class (`selfcheck.vouch`), so a host that never tuned runs the fleet's kernel without
    a first-contact check of its own (which would compile and run other kernels in another
    process first). Returns [what the lookup found] for `_decide`."""
    rec = CACHE.get(make_key(mod, problem, device), launchable(mod, problem, device))
    if rec is not None and not is_vendor(rec.config):  # torch's op won: it says nothing of the kernels
        selfcheck.vouch(mod, device, rec)
    return [rec]


def _tune_checks_first(mod: ModuleType, device: DeviceClass, looked_up: "list[ConfigRecord | None]") -> bool:
    """Whether this miss tunes a backend that has no verdict yet on this device class: the
    tune runs every candidate in the isolated runner and checks it against PyTorch before any
    runs here, so its first-contact check would only repeat that work before it (seconds of
    compiles and launches in the runner); `selfcheck.checked_by_tuning` keeps the verdict."""
    return (
        looked_up == [None]
        and settings.miss_policy() == "tune"
        and selfcheck.applies(device)
        and selfcheck.unknown(mod, device)
    )


def _vendor_until_tuned(mod: ModuleType, device: DeviceClass) -> bool:
    """Whether a miss runs torch's own op until its winner is known (policy `default` on a
    GPU) because the backend has no verdict yet on this device class: nothing of the backend
    runs now, so its first-contact check (seconds of compiles in the runner, per backend,
    inside a first step) is not run for it; the winner a worker tunes was checked by that tune."""
    return (
        settings.miss_policy() == "default"
        and device.arch != "cpu"
        and settings.vendor_competes()
        and selfcheck.applies(device)
        and selfcheck.unknown(mod, device)
    )


def _vendor_won(looked_up: "list[ConfigRecord | None] | None") -> bool:
    return bool(looked_up) and looked_up[0] is not None and is_vendor(looked_up[0].config)


def _decide(
    op: Op,
    raw: tuple,
    mods: list[ModuleType],
    problem: dict,
    device: DeviceClass,
    torch_device: str,
    looked_up: "list[ConfigRecord | None] | None" = None,
) -> Entry:
    """`looked_up`: [the preferred backend's lookup], when `_look_up_first` made it already."""
    mod, fallbacks = mods[0], tuple(mods[1:])
    key = make_key(mod, problem, device)
    check = launchable(mod, problem, device)
    rec = looked_up[0] if looked_up is not None else CACHE.get(key, check)
    if rec is not None:
        return _entry(op, raw, mod, problem, device, rec.config, key, rec=rec, fallbacks=fallbacks)
    policy = settings.miss_policy()
    if policy == "strict":
        raise MissingConfig(
            f"no tuned config for {mod.KERNEL} {problem} on {device} (digest {key.digest[:12]}) and "
            f"TUNECACHE_MISS_POLICY=strict; tune it with `tunecache tune` or pre-tune a manifest"
        )
    if policy == "tune":
        # one process of the host (and with a fleet, one host of it) tunes a key; the others wait for it
        with CACHE.turn(key, check) as turn:
            if turn.waited:
                rec = CACHE.get(key, check)
                if rec is not None:
                    return _entry(op, raw, mod, problem, device, rec.config, key, rec=rec, fallbacks=fallbacks)
            failure = None
            try:
                announce = announce_tune(mod, problem, device, torch_device)
                ranking = CACHE.ranking(mod.KERNEL, device)
                result = tune(
                    mod, problem, device, torch_device=torch_device, progress=announce, hint=turn.hint, ranking=ranking
                )
            except TuneError as e:  # nothing of the space runs right here: the caller still gets an answer
                result, failure = None, e
            default_ran = result is not None and result.default_ms is not None
            if not default_ran and selfcheck.applies(device) and selfcheck.unknown(mod, device):
                # never checked here, and its default config did not run right in this tune: the
                # backend's own check decides whether the next backend takes this shape
                rest = selfcheck.trusted(mods, device, torch_device)
                if rest[:1] != [mod]:
                    return (
                        _decide(op, raw, rest, problem, device, torch_device)
                        if rest
                        else _reference_entry(mod, problem, device)
                    )
            if result is None:
                log.warning("tunecache: %s; this shape runs PyTorch's own op in this process", short(failure))
                return _reference_entry(mod, problem, device)
            selfcheck.checked_by_tuning(mod, device, result, problem)
            kept = CACHE.keep_tuned(result, device).record
            return _entry(op, raw, mod, problem, device, kept.config, key, fallbacks=fallbacks)
    # policy "default": run something reasonable now, let a worker tune it; on a GPU with no
    # tuned neighbour (or a backend not yet checked here), torch's own op (the vendor's): a
    # default config's binary is a compile in this process, a second or more per shape of a
    # first step on a cold Triton cache (a small CNN's first step waited 32 s on 26 of them)
    CACHE.enqueue(key)
    vendor = device.arch != "cpu" and check(VENDOR) is None
    config = None if vendor and _vendor_until_tuned(mod, device) else CACHE.nearest(key, check)
    if config is None and vendor:
        config = VENDOR
    config = config or mod.default_config(problem, device)
    if check(config) is None:
        return _entry(op, raw, mod, problem, device, config, key, fallbacks=fallbacks, provisional=True)
    log.warning(
        "tunecache: the default config of %s cannot run %s on %s (%s)", mod.KERNEL, problem, device, check(config)
    )
    for other in fallbacks:  # the next backend's default, until the winner is known
        config = other.default_config(problem, device)
        if launchable(other, problem, device)(config) is None:
            return _entry(op, raw, other, problem, device, config, key, provisional=True)
    return _reference_entry(mod, problem, device)

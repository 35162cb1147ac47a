"""The one place configs are looked up and kept: local store -> fleet -> validate.

`ConfigCache.get` is what the ops, `@tunecache.autotune` and the worker read through, and
`keep` is how their results are stored and published. Both never fail the caller's call:

- a fault of the local store (read-only, full disk, corrupt, newer schema, a lock held past
  the busy timeout) is one warning naming the cause, and the lookup goes on with the fleet
  and the miss policy (`tunecache.store.local` opens the best store that still works);
- a call never waits on a write: what it leaves to the store or the fleet (its key queued, a
  fleet copy, a report) is made beside it by the store's writer thread
  (`tunecache.store.process.write_behind`); a store another process holds locked costs that
  thread one busy timeout, after which its writes wait aside until it answers again, and a
  result to keep (`keep`) waits with them rather than making a call wait again;
- a call's fleet requests share one deadline (`FleetClient.for_a_call`): a fleet that missed
  it is skipped by the next calls until a background probe finds it back;
- a config is returned only if the caller's `check` accepts it for this problem and device
  (the kernel's space and the backend's own pruning): one that fails is dropped from the
  local store and reported to the fleet;
- a copy of a fleet winner is marked as one (source "fleet"), rechecked after
  TUNECACHE_FLEET_TTL_S or when the fleet's generation moved (a winner was removed or
  replaced), removed when the fleet no longer has it, and never keeps a result of this host
  out (see `Store._keep_faster`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Literal, NamedTuple

from tunecache import settings
from tunecache.errors import short
from tunecache.fleet.protocol import KEPT_EXISTING, UNREACHABLE, WON, Fleet, Published
from tunecache.key import TuneKey
from tunecache.store.records import ANNOUNCE_S, ConfigRecord, TrialRecord, utcnow

if TYPE_CHECKING:
    from tunecache.key import DeviceClass
    from tunecache.locks import Turn
    from tunecache.store import Store
    from tunecache.tuning.ranking import Ranking
    from tunecache.tuning.tuner import TuneResult

log = logging.getLogger("tunecache")

# How often a process asks the fleet for its generation (only when it reads a fleet copy).
GENERATION_POLL_S = 60.0
# How often a process reads the trials its tunes rank candidates by again (from its store and the
# fleet; its own tunes are added as it keeps them).
RANKING_S = 600.0
# How often a host that waits for another's tune of a key asks the fleet whether it is done.
FLEET_WAIT_POLL_S = 2.0

Check = Callable[[dict], "str | None"]  # a config -> why it cannot run here, or None


class Kept(NamedTuple):
    """What `ConfigCache.keep` did with a result."""

    record: ConfigRecord  # the record to run: the result, or a faster one already kept
    won: bool  # whether the result is the winner where it was kept
    published: Published | None  # the fleet's answer; None when it was not published


class SyncReport(NamedTuple):
    """What `ConfigCache.sync` copied from the fleet."""

    total: int
    new: int  # new or changed winners
    same: int  # copies already here
    own: int  # tuned on this host: kept
    installed: int  # compiled kernels written into Triton's cache
    skipped: list[str]  # entries that could not be read, in words


class ConfigCache:
    def __init__(self) -> None:
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._generation_at = -float("inf")
        self._copied: set[str] = set()  # digests whose fleet copy this process has written (or queued)
        self._rankings: dict[tuple[str, str], tuple[float, Ranking]] = {}  # (kernel, arch) -> (read at, it)
        self._ranking_lock = threading.Lock()  # read once: a tune waits for the read started ahead of it

    # ---- where configs live ---------------------------------------------------------------

    def store(self, url: str | None = None) -> Store | None:
        """The local store (`url`: default TUNECACHE_DB_URL), or None (one warning) when none can
        be had at all. It does not wait for the writes left beside the calls (a call reads what
        the store has)."""
        from tunecache.store.process import default_store

        try:
            return default_store(url, settle_writes=False)
        except Exception as e:  # noqa: BLE001 - no store is a warning, never the caller's failure
            self._warn_fault("open", e)
            return None

    def fleet(self) -> Any:
        """The fleet service's client (TUNECACHE_SERVER_URL), or None."""
        url = settings.server_url()
        if not url:
            return None
        from tunecache.fleet.client import fleet_client

        return fleet_client(url)

    def store_call(self, what: str, fn: Callable[[], Any], default: Any = None, *, url: str | None = None) -> Any:
        """`fn()`, or `default` on a fault of the store (`url`: its URL, default TUNECACHE_DB_URL),
        warned once; a store another process held locked is marked so (its writes then wait
        beside the calls, `tunecache.store.process.mark_locked`)."""
        from tunecache.store import STORE_ERRORS, ReadOnlyStoreError, fault_kind

        try:
            return fn()
        except ReadOnlyStoreError:  # the warning given when it was opened said why
            log.debug("tunecache: the local store is read-only: cannot %s", what)
            return default
        except STORE_ERRORS as e:
            if fault_kind(e) == "locked":
                from tunecache.store.process import mark_locked

                mark_locked(url or settings.db_url())
            self._warn_fault(what, e, url)
            return default

    def _warn_fault(self, what: str, e: BaseException, url: str | None = None) -> None:
        from tunecache.store import describe_fault, fault_kind, sqlite_path

        try:
            path = sqlite_path(url or settings.db_url())
        except Exception:  # noqa: BLE001 - the words are then less precise, nothing more
            path = None
        cause = describe_fault(e, path) or short(e)
        if cause in self._warned:
            return
        self._warned.add(cause)
        if fault_kind(e) == "locked":
            log.warning(
                "tunecache: the local store failed to %s (%s); reads go on, and its writes wait beside "
                "the calls until it answers again (those still waiting when the process exits are not kept)",
                what,
                cause,
            )
            return
        log.warning("tunecache: the local store failed to %s (%s); going on without it for this", what, cause)

    def warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s", text)

    # ---- get ----------------------------------------------------------------------------

    def _read(self, what: str, quick: Callable[[str], Any], slow: Callable[["Store"], Any], default: Any) -> Any:
        """A read a warm host's first call makes: `tunecache.store.quick_read` without opening the
        Store, else the Store (`default` without one, or on a fault)."""
        from tunecache.store import quick_read
        from tunecache.store.process import holds_nothing_yet

        url = settings.db_url()
        found = quick(url)
        if found is not quick_read.UNKNOWN:
            return found
        if holds_nothing_yet(url):  # a fresh host: opening the store to read nothing costs 0.7 s
            return default
        store = self.store()
        return default if store is None else self.store_call(what, lambda: slow(store), default)

    def read_config(self, digest: str) -> ConfigRecord | None:
        """The local store's winner for `digest` (None: none, or no store)."""
        from tunecache.store import quick_read

        return self._read("read", lambda url: quick_read.config(url, digest), lambda s: s.get_config(digest), None)

    def read_trials(self, digest: str) -> list[TrialRecord]:
        """The local store's trials of `digest` (none without a store)."""
        from tunecache.store import quick_read

        return self._read("read trials", lambda url: quick_read.trials(url, digest), lambda s: s.trials(digest), [])

    def read_selfcheck(self, *k: Any) -> tuple[bool, str | None] | None:
        """A backend's stored self-check verdict, as `Store.get_selfcheck` answers it."""
        from tunecache.store import quick_read

        return self._read(
            "read a self-check", lambda url: quick_read.selfcheck(url, *k), lambda s: s.get_selfcheck(*k), None
        )

    def nearest(self, key: TuneKey, check: Check) -> dict | None:
        """The config of the closest tuned problem (`tunecache.shapes.problem_distance`) of this
        kernel version, Triton and device class that `check` accepts: what a miss runs under
        policy `default` until its own winner is known. None without one, or without a store."""
        from tunecache.shapes import problem_distance
        from tunecache.store.process import holds_nothing_yet

        if holds_nothing_yet(settings.db_url()):  # no file yet: no neighbour, and no store to open
            return None
        store = self.store()
        if store is None:
            return None
        records = self.store_call(
            "read a neighbour's config", lambda: store.list_configs(kernel=key.kernel, arch=key.arch), []
        )
        problem, same = dict(key.problem), (key.kernel_version, key.triton_version, key.sm_count)
        best, best_d = None, float("inf")
        for rec in records:
            k = rec.key
            if (k.kernel_version, k.triton_version, k.sm_count) != same:
                continue
            d = problem_distance(problem, dict(k.problem))
            if d < best_d and check(rec.config) is None:
                best, best_d = rec.config, d
        return best

    def ranking(self, kernel: str, device: "DeviceClass", store: "Store | None" = None, fleet: Any = None) -> "Ranking":
        """What past tunes say of `kernel`'s candidates on this device's architecture
        (tunecache.tuning.ranking): the trials the package ships, the store's and the fleet's,
        read once per RANKING_S (a few hundred ms), the tunes this process keeps added as they
        are kept. `store`, `fleet`: the worker's own, else this process's."""
        from tunecache.tuning import ranking

        if not settings.ranking_learned():
            return ranking.Ranking()
        with self._ranking_lock:
            when, known = self._rankings.get((kernel, device.arch), (-math.inf, None))
            if known is not None and time.monotonic() - when < RANKING_S:
                return known
            known = ranking.Ranking.shipped(kernel, device.arch, device.sm_count)
            store = store or self.store()
            if store is not None:
                rows = self.store_call("read past trials", lambda: store.ranking_trials(device.arch, kernel), [])
                known.add(t for _, t in ranking.trial_rows(rows))
            fleet = fleet if fleet is not None else self.fleet()
            if fleet is not None:
                known.add(t for _, t in ranking.trial_rows(fleet.trials(kernel, device.arch) or []))
            self._rankings[(kernel, device.arch)] = (time.monotonic(), known)
            return known

    def forget_rankings(self) -> None:
        """The next tune reads its trials again (tunecache.ops.clear_memo)."""
        self._rankings.clear()

    def surely_missing(self, digest: str) -> bool:
        """Whether this host's store has no winner for `digest`, known without opening the
        Store: a plain SQLite store without the row, or without a file yet. (Postgres and
        the like: not known, False.)"""
        from tunecache.store import quick_read

        url = settings.db_url()
        found = quick_read.config(url, digest)
        return quick_read.no_file(url) if found is quick_read.UNKNOWN else found is None

    def get(self, key: TuneKey, check: Check) -> ConfigRecord | None:
        """The winner for `key` that `check` accepts, from the local store or the fleet; None: a
        miss. Its fleet requests share one deadline (`FleetClient.for_a_call`)."""
        fleet = self.fleet()
        if fleet is None:
            return self._get(key, check, None)
        with _for_a_call(fleet):
            return self._get(key, check, fleet)

    def _get(self, key: TuneKey, check: Check, fleet: Any) -> ConfigRecord | None:
        rec = self.read_config(key.digest)
        if rec is not None and rec.source == "fleet" and self._stale(rec):
            rec = self._recheck(key, rec)
        if rec is not None:
            why = _why_not(rec, key, check)
            if why is None:
                return rec
            self.drop(key, rec.config, why, where="stored")
        if fleet is None:
            return None
        status, frec = fleet.fetch(key)
        if frec is None:
            if status == "miss" and key.digest in self._copied:
                # the copy this process queued may land after the fleet removed the winner
                self._copied.discard(key.digest)
                self.write_behind("remove a fleet copy", lambda store: store.delete_fleet_copy(key.digest))
            return None
        why = _why_not(frec, key, check)
        if why is not None:
            log.warning("tunecache: ignoring the fleet's config of %s %s: %s", key.kernel, key.digest[:12], why)
            self.fleet_behind(lambda fleet: fleet.report(key, frec.config, why))
            return None
        frec.source = "fleet"
        generation = fleet.generation
        # write-through: the next process on this host needs no network
        self._copied.add(key.digest)
        self.write_behind("keep a fleet copy", lambda store: store.put_fleet_copy(frec, generation))
        self.install_binaries(fleet, frec)
        return frec

    def _stale(self, rec: ConfigRecord) -> bool:
        checked = rec.fleet_checked_at
        if checked is None or utcnow() - checked > timedelta(seconds=settings.fleet_ttl_s()):
            return True
        generation = self._fleet_generation()
        return generation is not None and generation != rec.fleet_generation

    def _fleet_generation(self) -> int | None:
        """The fleet's generation, asked at most once per GENERATION_POLL_S (None: unknown)."""
        fleet = self.fleet()
        if fleet is None:
            return None
        now = time.monotonic()
        with self._lock:
            if now - self._generation_at < GENERATION_POLL_S:
                return self._generation if fleet.generation is None else fleet.generation
            self._generation_at = now
        self._generation = fleet.current_generation()
        return self._generation

    def _recheck(self, key: TuneKey, rec: ConfigRecord) -> ConfigRecord | None:
        """Ask the fleet about a copy of its winner: still there, replaced, or removed."""
        fleet = self.fleet()
        if fleet is None:
            return rec  # the fleet is no longer configured: the copy is what this host has
        status, frec = fleet.fetch(key)
        if status == "unavailable":
            return rec
        if status == "miss":
            log.info("tunecache: the fleet no longer has %s %s: removing this host's copy", key.kernel, key.digest[:12])
            self.write_behind("remove a fleet copy", lambda store: store.delete_fleet_copy(key.digest))
            return None
        frec.source = "fleet"
        generation = fleet.generation
        if frec.config == rec.config:
            self.write_behind("mark a fleet copy", lambda store: store.mark_fleet_checked(key.digest, generation))
        else:
            self.write_behind("keep a fleet copy", lambda store: store.put_fleet_copy(frec, generation))
        if frec.config != rec.config:
            self.install_binaries(fleet, frec)
        return frec

    def install_binaries(self, fleet: Any, rec: ConfigRecord, found: "list | None" = None) -> int:
        """Put the compiled kernels of a fleet winner into this host's Triton cache, so that its
        first launch does not compile (tunecache.tuning.binaries); `found`: already fetched. Each is
        checked against the key; nothing here fails the caller's call. Returns how many were
        written."""
        if rec.key.arch == "cpu" or not settings.fleet_binaries():
            return 0
        from tunecache.tuning import binaries

        if found is None:
            got = fleet.binaries(rec.digest)
            if got is None or got[0] != rec.config:
                return 0
            found = got[1]
        written = 0
        for b in found:
            why = binaries.refusal(b, rec.key.arch, rec.key.triton_version)
            if why:
                log.warning(
                    "tunecache: not installing a compiled kernel of %s %s: %s", rec.key.kernel, rec.digest[:12], why
                )
                continue
            try:
                written += binaries.install(b)
            except Exception as e:  # noqa: BLE001 - a full or read-only disk...: Triton compiles it as before
                self.warn_once(
                    f"tunecache: could not write a fleet kernel into Triton's cache ({short(e)}); "
                    "kernels are compiled here as before"
                )
                break
        return written

    def write_behind(self, what: str, fn: Callable[["Store"], Any]) -> None:
        """A write to this host's store that the call does not wait for (its key queued, a fleet
        copy, a self-check verdict): left to the store's writer thread, which opens the store if
        need be (SQLAlchemy's import and the schema: 0.5-0.7 s of a fresh host's first call) once
        the call has launched its kernel, and holds it while another process holds the store
        locked (`process_store.write_behind`)."""
        from tunecache.store.process import write_behind

        url = settings.db_url()
        write_behind(lambda: self._write(what, fn, url), url)

    def _write(self, what: str, fn: Callable[["Store"], Any], url: str) -> bool:
        """One write of the writer thread; False when another process held the store locked (it
        is made again once the store answers)."""
        from tunecache.store.process import is_locked

        store = self.store(url)
        if store is None:
            return True
        done = []
        self.store_call(what, lambda: done.append(fn(store)), url=url)
        return bool(done) or not is_locked(url)

    def fleet_behind(self, fn: Callable[[Any], Any]) -> None:
        """A fleet request the call does not wait for (its key queued, a report), made by the
        store's writer thread under the rules of a call's requests (`FleetClient.for_a_call`)."""
        from tunecache.store.process import write_behind

        fleet = self.fleet()
        if fleet is None:
            return

        def send() -> None:
            with _for_a_call(fleet):
                fn(fleet)

        write_behind(send)

    # ---- the processes of a host ---------------------------------------------------------

    @contextlib.contextmanager
    def turn(self, key: TuneKey, check: Check, wait: bool = True) -> Iterator["Turn"]:
        """One tune of `key` per host and store (`tunecache.locks.tune_turn`), and with a fleet,
        one per fleet (`Fleet.announce`): a context whose `Turn` says whether this process
        waited for another's tune (then `get` the winner first), whether it holds the key
        (`wait=False`: not when another process or host tunes it), and a `hint` (another host's
        submitted config, to time against the default before it runs here)."""
        from tunecache import locks
        from tunecache.shapes import shape_text

        what = f"{key.kernel} {shape_text(dict(key.problem))}"
        with locks.tune_turn(settings.db_url(), key.digest, what, wait) as turn:
            fleet = self.fleet()
            if fleet is None or not turn.held or (turn.waited and self.get(key, check) is not None):
                yield turn
                return
            with self._fleet_turn(fleet, key, check, what, wait) as fleet_turn:
                yield fleet_turn

    @contextlib.contextmanager
    def _fleet_turn(self, fleet: Fleet, key: TuneKey, check: Check, what: str, wait: bool) -> Iterator["Turn"]:
        """The fleet's part of `turn`: wait while a worker or another host tunes `key` (at most
        TUNECACHE_TUNE_WAIT_S in all, and no longer than its lease or announcement holds
        unrenewed); else announce that this host tunes it, renewed while the block runs and
        withdrawn after it (its result is published inside the block)."""
        from tunecache.locks import Turn

        holder = f"{socket.gethostname()} pid {os.getpid()}"
        deadline = time.monotonic() + settings.tune_wait_s()
        told = waited = False
        while True:
            with _for_a_call(fleet):
                said = fleet.announce(key, holder)
            if said is None or said.mine:
                break
            if said.state == "submitted":  # a claim: one this host's check refuses is no hint
                hint = said.hint if said.hint is not None and _why_not_config(said.hint, check) is None else None
                yield Turn(waited=True, held=True, hint=hint)
                return
            if not wait:
                yield Turn(waited=False, held=False)
                return
            if time.monotonic() >= deadline:
                log.warning("tunecache: %s: still being tuned by %s; tuning it on this host too", what, said.holder)
                break
            if not told:
                log.warning(
                    "tunecache: %s is being tuned by %s on the fleet (%s): waiting for its result "
                    "(at most %g s, TUNECACHE_TUNE_WAIT_S)",
                    what,
                    said.holder,
                    fleet.where,
                    deadline - time.monotonic(),
                )
                told = True
            time.sleep(min(FLEET_WAIT_POLL_S, max(0.05, deadline - time.monotonic()), said.seconds_left + 0.05))
            waited = True
            if self.get(key, check) is not None:
                yield Turn(waited=True, held=True)
                return
        if said is None or not said.mine:
            yield Turn(waited=waited, held=True)
            return
        done = threading.Event()

        def renew() -> None:  # the announcement holds while this host tunes, and not after
            while not done.wait(ANNOUNCE_S / 3):
                with _for_a_call(fleet):
                    fleet.announce(key, holder)

        renewer = threading.Thread(target=renew, name="tunecache-announce", daemon=True)
        renewer.start()
        try:
            yield Turn(waited=waited, held=True)
        finally:
            done.set()
            renewer.join()
            with _for_a_call(fleet):
                fleet.announce(key, holder, 0.0)

    # ---- keep, drop, enqueue ----------------------------------------------------------------

    def keep(
        self,
        rec: ConfigRecord,
        trials: Iterable[TrialRecord] = (),
        *,
        run_id: str | None = None,
        tune_seconds: float | None = None,
        publish: Literal["if_won", "always", "never"] = "if_won",
        binaries: list | None = None,
        store: Store | None = None,
        fleet: Fleet | None = None,
        publish_attempts: int = 1,
    ) -> Kept:
        """Store a result in this host's store (unless a faster one is kept there) and publish it
        to the fleet, with its compiled kernels (`binaries`) when the fleet made it the winner.

        `publish`: "if_won" here (a library call's result), "always" (a worker's: the fleet
        decides), "never". `store`, `fleet`: where, when not this process's own; a fleet that
        is this very store (a worker of a host's own queue) keeps it once. A publish the fleet
        could not receive is tried `publish_attempts` times in all, waiting 0.5 s, 1 s, 2 s...
        A store that cannot write keeps nothing and `rec` runs; one another process holds locked
        keeps it once it answers again (the writer thread waits for it, the call does not)."""
        from tunecache.store.process import is_locked, settle

        trials = list(trials)
        own, url = store is None, settings.db_url()
        store = store or self.store()
        fleet = fleet if fleet is not None else self.fleet()
        kept, won = rec, True
        if store is not None and own:
            settle()  # after the writes left beside the calls: a bad row they drop must not outrun it
        if store is not None and own and is_locked(url):
            self.write_behind("keep a tuning result", lambda s: s.put_config(rec, trials, run_id))
        elif store is not None:
            put = self.store_call("keep a tuning result", lambda: store.put_config(rec, trials, run_id), None)
            if put is not None:
                kept, won = put
            elif own and is_locked(url):  # it waited out the busy timeout: kept once the store answers
                self.write_behind("keep a tuning result", lambda s: s.put_config(rec, trials, run_id))
        if fleet is None or publish == "never" or (publish == "if_won" and not won):
            return Kept(kept, won, None)
        if store is not None and getattr(fleet, "store", None) is store:
            sent = Published(WON if won else KEPT_EXISTING, kept=kept)  # kept once, above
        else:
            sent = Published(UNREACHABLE)
            delay = 0.5
            for attempt in range(max(1, publish_attempts)):
                if attempt:
                    time.sleep(delay)
                    delay *= 2
                sent = fleet.publish(rec, trials, tune_seconds=tune_seconds)
                if sent.reached:
                    break
        if binaries and sent.won:  # hosts that copy the winner need not compile it
            fleet.publish_binaries(rec, binaries)
        return Kept(kept, won, sent)

    def keep_tuned(self, result: "TuneResult", device: "DeviceClass", **where: Any) -> Kept:
        """`keep` a tuning run's result: its winner, trials, run and compiled kernels; its trials
        also rank this process's next tunes of the kernel."""
        known = self._rankings.get((result.key.kernel, device.arch))
        if known is not None:
            from tunecache.tuning.ranking import trial_rows

            problem = dict(result.key.problem)
            known[1].add(
                t for _, t in trial_rows((result.key.kernel, problem, x.config, x.median_ms) for x in result.trials)
            )
        return self.keep(
            result.record(device),
            result.trials,
            run_id=result.run_id,
            tune_seconds=result.seconds,
            binaries=result.binaries,
            **where,
        )

    def sync(
        self, fleet: Fleet, device: "DeviceClass", kernel_versions: Any, triton_version: str, binaries: bool = True
    ) -> SyncReport:
        """Copy every fleet winner of `device` into this host's store, and their compiled kernels
        into Triton's cache: one request, so that no call of a job that starts waits for the
        fleet or compiles what the fleet has. A result tuned on this host is never replaced.
        FleetError when the fleet could not answer; a store fault is the caller's error."""
        answer = fleet.sync(device, triton_version, kernel_versions, binaries)
        from tunecache.store.process import default_store

        store = default_store()
        recs: dict[str, ConfigRecord] = {}
        new = same = own = 0
        for rec in answer.configs:
            rec.source = "fleet"
            recs[rec.digest] = rec
            before = store.get_config(rec.digest)
            if not store.put_fleet_copy(rec, answer.generation):
                own += 1
            elif before is not None and before.config == rec.config:
                same += 1
            else:
                new += 1
        installed = 0
        if binaries:
            for digest, kernels in answer.binaries.items():
                if digest in recs:
                    installed += self.install_binaries(fleet, recs[digest], kernels)
            for digest in answer.more_binaries:  # those the answer had no room for, one by one
                if digest in recs:
                    installed += self.install_binaries(fleet, recs[digest])
        return SyncReport(len(recs), new, same, own, installed, answer.skipped)

    def drop(self, key: TuneKey, config: dict, reason: str, *, where: str = "stored") -> None:
        """A config that cannot run here: forget the local row that holds it, tell the fleet."""
        log.warning(
            "tunecache: dropping the %s config of %s %s %s: %s", where, key.kernel, key.digest[:12], config, reason
        )

        def delete(store: Store) -> None:
            rec = store.get_config(key.digest)
            if rec is not None and rec.config == config:
                store.delete_config(key.digest)

        self.write_behind("drop a bad config", delete)
        self.fleet_behind(lambda fleet: fleet.report(key, config, reason))

    def enqueue(self, key: TuneKey) -> None:
        """Queue `key`'s tuning in this host's store and in the fleet, beside the call."""
        self.write_behind("queue a tuning job", lambda store: store.enqueue(key))
        self.fleet_behind(lambda fleet: fleet.enqueue(key))


def _for_a_call(fleet: Any) -> ContextManager[Any]:
    """The fleet's scope for a call's requests (`FleetClient.for_a_call`); none for a fleet
    without one."""
    scope = getattr(fleet, "for_a_call", None)
    return scope() if scope is not None else contextlib.nullcontext()


def _why_not(rec: ConfigRecord, key: TuneKey, check: Check) -> str | None:
    if rec.key.digest != key.digest:
        return f"it is the entry of another key ({rec.key.kernel} {rec.key.digest[:12]})"
    return _why_not_config(rec.config, check)


def _why_not_config(config: dict, check: Check) -> str | None:
    try:
        return check(config)
    except Exception as e:  # noqa: BLE001 - a check that cannot decide refuses
        return f"checking it failed: {type(e).__name__}: {e}"


CACHE = ConfigCache()

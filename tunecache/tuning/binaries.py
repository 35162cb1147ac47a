"""Compiled kernels that travel with a fleet winner, so that a host that never tuned never compiles.

Triton keeps each compiled kernel in its cache directory under a hash of everything the binary
depends on (the kernel's source, its specialization and options, the target GPU, the Triton
build and the environment that changes code generation). The host that tunes a key records,
for the winner, the cache entries that its launch used (`capture`, in the trial runner), and
publishes their metadata and cubin with the result. A host that copies the winner installs
them into its own Triton cache (`install`): its first launch finds them under the same hash,
or, where anything that hash covers differs (another Triton build, another target), never
looks at them and compiles as before. A binary is code that runs on the host's GPU: only the
fleet's tuning hosts (worker and admin tokens) may publish one, and both the service and the
host check each against the key it came with (`refusal`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

# what a binary is made of: Triton's metadata and the cubin; the intermediate IRs stay home
SUFFIXES = (".json", ".cubin")
MAX_BINARY_BYTES = 4 << 20  # one kernel's metadata and cubin (these kernels: 50-400 KiB)
MAX_BINARIES_PER_CONFIG = 4  # kernels one launch of a config may use (split-K: the GEMM and its reduction)
_HASH = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,149}$")


@dataclass
class Binary:
    """One of Triton's cache entries: `files` {file name: bytes} under the directory `triton_hash`."""

    triton_hash: str
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def metadata(self) -> dict:
        name = next(n for n in self.files if n.endswith(".json"))
        return json.loads(self.files[name])

    def to_json(self) -> dict:
        return {
            "triton_hash": self.triton_hash,
            "files": {n: base64.b64encode(b).decode("ascii") for n, b in sorted(self.files.items())},
        }

    @classmethod
    def from_json(cls, body: Any) -> "Binary":
        """Raises ValueError on anything that is not a binary's JSON (base64 included)."""
        if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
            raise ValueError("a binary is {triton_hash, files: {name: base64}}")
        try:
            files = {str(n): base64.b64decode(str(b), validate=True) for n, b in body["files"].items()}
        except (ValueError, TypeError) as e:
            raise ValueError(f"a file of the binary is not base64: {e}") from None
        return cls(str(body.get("triton_hash", "")), files)


def refusal(binary: Binary, arch: str, triton_version: str) -> str | None:
    """Why `binary` cannot belong to a key of device `arch` (e.g. "sm_90") built with Triton
    `triton_version`, or None: the shape of its files, its metadata's hash, target and Triton."""
    if not _HASH.match(binary.triton_hash):
        return f"triton_hash {binary.triton_hash[:80]!r} is not a sha256 hex digest"
    names = sorted(binary.files)
    stems = {n.rsplit(".", 1)[0] for n in names}
    if len(stems) != 1 or sorted(os.path.splitext(n)[1] for n in names) != sorted(SUFFIXES):
        return f"a binary is one kernel's {' and '.join(SUFFIXES)} files, not {names[:6]}"
    stem = stems.pop()
    if not _NAME.match(stem):
        return f"file name {stem[:80]!r} is not a kernel name"
    size = sum(len(b) for b in binary.files.values())
    if size > MAX_BINARY_BYTES:
        return f"the binary is {size} bytes, more than {MAX_BINARY_BYTES}"
    try:
        meta = binary.metadata
    except (ValueError, UnicodeDecodeError):
        return "its metadata is not JSON"
    if not isinstance(meta, dict):
        return "its metadata is not a JSON object"
    if meta.get("hash") != binary.triton_hash:
        return "its metadata's hash is not the directory it is filed under"
    if meta.get("name") != stem:
        return f"its metadata names kernel {str(meta.get('name'))[:80]!r}, its files {stem!r}"
    target = meta.get("target")
    want = _capability(arch)
    if not isinstance(target, dict) or target.get("backend") != "cuda" or target.get("arch") != want:
        return f"it was built for {target!r}, not cuda {want} ({arch})"
    if meta.get("triton_version") != triton_version:
        return f"it was built by Triton {meta.get('triton_version')!r}, the key says {triton_version!r}"
    return None


def _capability(arch: str) -> int | None:
    """sm_90 -> 90, sm_100 -> 100 (the target arch in Triton's metadata)."""
    m = re.match(r"^sm_(\d+)a?$", arch)
    return int(m.group(1)) if m else None


# ---- the tuning host: which cache entries the winner's launch used ---------------------------


@contextmanager
def capture(fn: Any = None) -> Iterator[dict[str, dict[str, str]]]:
    """While inside, every kernel Triton compiles or loads from its cache is recorded:
    {triton_hash: {file name: path}}. Kernels already loaded are forgotten first (their
    launches would skip Triton's cache): those of the JIT function `fn` only, or with no `fn`
    every one of the process (the trial runner's, which is its own)."""
    from triton import knobs

    if fn is None:
        _forget_loaded_kernels()
    else:
        fn.device_caches.clear()
    seen: dict[str, dict[str, str]] = {}
    before = knobs.compilation.listener

    def listener(*, src: Any, metadata: dict, metadata_group: dict, times: Any, cache_hit: bool) -> None:
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        h = metadata.get("hash")
        if isinstance(h, str) and metadata_group:
            seen[h] = {name: path for name, path in metadata_group.items() if name.endswith(SUFFIXES)}

    knobs.compilation.listener = listener
    try:
        yield seen
    finally:
        knobs.compilation.listener = before


def _forget_loaded_kernels() -> None:
    """Empty every JIT function's in-memory kernels and every backend's launch plans, so that
    the next launch asks Triton's compile (and its cache) again."""
    import sys

    from triton.runtime.jit import JITFunction

    try:
        from tunecache_kernels.gluon_launch import PlanCache
    except ImportError:  # pragma: no cover - the kernels ship with the package
        PlanCache = None  # noqa: N806
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, JITFunction):
                value.device_caches.clear()
            elif PlanCache is not None and isinstance(value, PlanCache):
                value.clear()


def read(entries: dict[str, dict[str, str]]) -> list[Binary]:
    """The captured entries' files, read from this host's Triton cache."""
    out = []
    for h, paths in sorted(entries.items()):
        try:
            out.append(Binary(h, {name: open(path, "rb").read() for name, path in paths.items()}))
        except OSError:
            continue
    return out


# ---- a host that copies a winner: into its own Triton cache ----------------------------------


def cache_dir() -> str | None:
    """Triton's cache directory, or None where this process does not use Triton's file cache."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    if knobs.cache.manager_class not in (None, FileCacheManager):
        return None
    return knobs.cache.dir or None


def entry_dir(triton_hash: str) -> str:
    """The directory Triton files a hash under (`triton.runtime.cache.get_cache_manager`)."""
    try:
        from triton.runtime.cache import _base32
    except ImportError:  # the same rule, where Triton has no such helper
        return base64.b32encode(bytes.fromhex(triton_hash)).decode("ascii").rstrip("=")
    return _base32(triton_hash)


def install(binary: Binary, root: str | None = None) -> bool:
    """Put `binary` into Triton's cache (checked by the caller with `refusal`); True if it was
    written, False if the cache already holds it or there is no file cache. Atomic: a
    directory written aside and renamed, so a crash or a concurrent process never leaves a
    half entry that Triton would read."""
    root = root or cache_dir()
    if root is None:
        return False
    final = os.path.join(root, entry_dir(binary.triton_hash))
    meta_name = next(n for n in binary.files if n.endswith(".json"))
    if os.path.exists(os.path.join(final, f"__grp__{meta_name}")):
        return False
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"tmp.tunecache_{os.getpid()}_{uuid.uuid4().hex}")
    os.makedirs(tmp)
    try:
        for name, data in binary.files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        group = {name: os.path.join(final, name) for name in binary.files}
        with open(os.path.join(tmp, f"__grp__{meta_name}"), "w") as f:
            json.dump({"child_paths": group}, f)
        try:
            os.rename(tmp, final)
            return True
        except OSError:  # Triton made the directory (an entry of its own, or its lock): file by file
            for name in [*binary.files, f"__grp__{meta_name}"]:  # the group file last
                os.replace(os.path.join(tmp, name), os.path.join(final, name))
            return True
    finally:
        if os.path.isdir(tmp):
            for name in os.listdir(tmp):
                os.unlink(os.path.join(tmp, name))
            os.rmdir(tmp)

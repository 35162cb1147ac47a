"""Headless Chromium (Debian's `chromium`) for the page tests: how it is found and started."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run does)"
)


def chromium(profile: Path, *args: str, budget_ms: int, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run headless Chromium on its own profile, offline-friendly, with `budget_ms` of virtual
    time for the page's scripts."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--virtual-time-budget={budget_ms}",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=timeout)

"""The API docs render with no internet: /docs (Swagger UI) and /redoc load their scripts from
the service itself, checked in headless Chromium (Debian's `chromium`) on a machine whose
network reaches nothing outside."""

from __future__ import annotations

from support.browser import chromium, needs_chromium


def _dom(url: str, tmp_path) -> str:
    proc = chromium(tmp_path / "profile", "--dump-dom", url, budget_ms=10000)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@needs_chromium
def test_swagger_ui_and_redoc_render_without_a_cdn(clean_fleet, tmp_path):
    page = _dom(f"{clean_fleet.url}/docs", tmp_path)
    assert "cdn.jsdelivr.net" not in page and "/static-offline-docs/swagger-ui-bundle.js" in page
    # rendered by the script, not just the empty shell: the operations are listed
    assert "opblock" in page and "/v1/best/{op}" in page, page[-2000:]
    redoc = _dom(f"{clean_fleet.url}/redoc", tmp_path)
    assert "/static-offline-docs/redoc.standalone.js" in redoc and "Look up by digest" in redoc, redoc[-2000:]
    shot = tmp_path / "docs.png"
    chromium(
        tmp_path / "profile",
        f"--screenshot={shot}",
        "--window-size=1200,900",
        f"{clean_fleet.url}/docs",
        budget_ms=10000,
    )
    assert shot.stat().st_size > 10_000

"""Opens a static page in headless Chromium (the system's, through Playwright) and reports what
went wrong: script errors, console errors, failed requests and images that did not load.

    python tests/browser.py runs/figures/index.html     # prints the problems, exits 1 if any
"""

from __future__ import annotations

import os
import shutil
import sys

# Flags for a root session on a machine without a network: no sandbox, no GPU, no background calls.
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
  """The system's Chromium (``tests/run.sh`` installs Debian's ``chromium``)."""
  path = shutil.which("chromium") or shutil.which("chromium-browser")
  if path is None:
    raise RuntimeError("no chromium on PATH: install it (apt-get install chromium), as tests/run.sh does")
  return path


def open_page(path: str, screenshot: str | None = None) -> dict:
  """Loads ``path`` and returns ``{"errors", "failed", "images", "sections"}``: script and console
  errors, URLs that failed to load, ``(src, natural width)`` of every image and the ids of the
  page's sections. With ``screenshot``, a full-page PNG is written there."""
  from playwright.sync_api import sync_playwright

  errors, failed = [], []
  with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
    try:
      page = browser.new_page()
      page.on("pageerror", lambda e: errors.append(str(e)))
      page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
      page.on("requestfailed", lambda r: failed.append(r.url))
      page.goto("file://" + os.path.abspath(path), wait_until="load")
      images = page.evaluate("Array.from(document.images).map(i => [i.getAttribute('src'), i.complete ? i.naturalWidth : 0])")
      sections = page.evaluate("Array.from(document.querySelectorAll('section')).map(s => s.id)")
      if screenshot:
        page.screenshot(path=screenshot, full_page=True)
    finally:
      browser.close()
  return {"errors": errors, "failed": failed, "images": [tuple(i) for i in images], "sections": sections}


def problems(report: dict) -> list[str]:
  """What :func:`open_page` found wrong, one line each."""
  out = [f"error: {e}" for e in report["errors"]] + [f"failed to load: {u}" for u in report["failed"]]
  out += [f"image not shown: {src}" for src, width in report["images"] if not width]
  return out


if __name__ == "__main__":
  found = problems(open_page(sys.argv[1]))
  print("\n".join(found) or f"{sys.argv[1]}: loads without errors, every image shown")
  sys.exit(1 if found else 0)

"""End to end in a real browser: JupyterLab serves a notebook, a slider moves, the figure changes.

Run by ``make e2e`` (and by ``.ci/run`` after ``make test``). It starts JupyterLab on
127.0.0.1 with a random token over a temporary copy of ``notebooks/`` (so autosave never
touches the committed files), drives Debian's Chromium with Playwright, runs every cell
in quick mode, moves the first slider of the dashboard, and asserts that the widget
rendered, no error was shown and the figure image changed. Screenshots go to
``e2e-screenshots/`` (git-ignored). The server and its kernels are stopped at the end.
"""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "e2e-screenshots"
NOTEBOOK = os.environ.get("E2E_NOTEBOOK", "02_tradeoff_explorer.ipynb")
NEW_SLIDER_VALUE = "8"  # the first slider of the dashboard is max_batch_size
CHROMIUM = "/usr/bin/chromium"
# Flags for a sandboxed root user on a machine with no outside network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(server: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the server's whole process group, if it is still there."""
    try:
        os.killpg(server.pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a copy of the notebooks; yields its base URL and token."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, BATCHSIM_QUICK="1", JUPYTER_CONFIG_DIR=str(root / "config"),
               JUPYTER_RUNTIME_DIR=str(root / "runtime"))
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root / 'notebooks'}", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=open(root / "lab.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("JupyterLab did not start:\n"
                                       + (root / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield base, token
    finally:
        stop(server, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            stop(server, signal.SIGKILL)
            server.wait()
        time.sleep(1)
        leftovers = subprocess.run(["pgrep", "-s", str(server.pid)], capture_output=True,
                                   text=True).stdout.split()
        for pid in leftovers:
            os.kill(int(pid), signal.SIGKILL)
        assert not leftovers, f"processes left behind: {leftovers}"


def test_slider_redraws_the_figure(lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    base, token = lab
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.locator(".jp-NotebookPanel").first.wait_for(timeout=60_000)
            # The kernel has started and reports idle in the status bar.
            page.get_by_text("(ipykernel) | Idle").wait_for(timeout=60_000)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            # JupyterLab may still ask which kernel to start: take the notebook's own.
            try:
                page.locator(".jp-Dialog button.jp-mod-accept").click(timeout=5_000)
            except PlaywrightTimeout:
                pass
            slider = page.locator(".widget-slider").first
            slider.wait_for(timeout=150_000)
            # Every cell has run: no prompt still shows [*].
            expect(page.locator(".jp-InputPrompt", has_text="[*]")).to_have_count(0,
                                                                            timeout=150_000)
            assert page.get_by_text("Error displaying widget").count() == 0
            assert page.locator(".jp-OutputArea-output[data-mime-type="
                                "'application/vnd.jupyter.stderr']").count() == 0
            figure = page.locator(".widget-image").first
            figure.scroll_into_view_if_needed()
            figure.wait_for(timeout=30_000)
            page.screenshot(path=SHOTS / "before.png")
            before_src, before_png = figure.get_attribute("src"), figure.screenshot()

            # Type a new max_batch_size into the first slider's readout, as a user can.
            readout = slider.locator(".widget-readout").first
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type(NEW_SLIDER_VALUE)
            page.keyboard.press("Enter")
            page.wait_for_function(
                "old => document.querySelector('.widget-image').getAttribute('src') !== old",
                arg=before_src, timeout=60_000)
            page.wait_for_timeout(500)  # let the new image decode
            page.screenshot(path=SHOTS / "after.png")
            assert readout.inner_text().strip() == NEW_SLIDER_VALUE
            assert figure.screenshot() != before_png, "the figure did not change"
            assert page.get_by_text("Traceback").count() == 0
        except Exception:
            page.screenshot(path=SHOTS / "failure.png")
            raise
        finally:
            browser.close()

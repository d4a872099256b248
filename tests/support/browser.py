"""Headless Chromium driven over the DevTools protocol: load pages, run JS, take screenshots.

Used by the live view's browser test and by ``testbeds/live_view_shots.py``. Chromium runs
as a child of this process with a throw-away profile; :meth:`Browser.close` stops it by
pid (SIGTERM, then SIGKILL) and removes the profile, however the caller exits.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome", "headless_shell")


def find_chromium() -> str | None:
    """The Chromium (or Chrome) binary on PATH, ``$FUSION_TEST_CHROMIUM`` first; ``None`` if none."""
    override = os.environ.get("FUSION_TEST_CHROMIUM")
    if override:
        return shutil.which(override)
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """One headless Chromium with one page, driven over a DevTools websocket."""

    def __init__(self, binary: str, *, width: int = 1400, height: int = 1000, timeout_s: float = 30.0) -> None:
        import websocket  # websocket-client, of the test extra

        self._profile = tempfile.mkdtemp(prefix="fusion-chromium-")
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._next_id = 0
        self.timeout_s = timeout_s
        try:
            port = self._devtools_port(timeout_s)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout_s) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            self.ws = websocket.create_connection(
                pages[0]["webSocketDebuggerUrl"], timeout=timeout_s, suppress_origin=True
            )
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, timeout_s: float) -> int:
        path = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before it listened")
            if path.exists():
                first = path.read_text().splitlines()[:1]
                if first and first[0].isdigit():
                    return int(first[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port in {timeout_s}s")

    def __enter__(self) -> Browser:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method} failed: {msg['error']}")
                return dict(msg.get("result", {}))
        raise TimeoutError(f"{method}: no answer in {self.timeout_s}s")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JS expression in the page (promises awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll a JS expression until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None  # the page is between documents
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"{expression!r} still {value!r} after {timeout_s}s")

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        width = int(self.evaluate("document.documentElement.scrollWidth"))
        shot = self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        # Chromium's helpers share its process group (its own session): stop them all.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(0.2)  # let the helpers go with it
        shutil.rmtree(self._profile, ignore_errors=True)

"""A headless Chromium driven over the Chrome DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ended by a NUL byte, commands on the browser's fd 3, answers and events on its fd 4), so no port is opened
and no package is needed. One browser, one page: load a URL, evaluate script, move and click the mouse, take a
screenshot. Used by the viewer's tests and by ``jstd view --png``."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path

EXECUTABLES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL = "apt-get install chromium (Debian, Ubuntu), or set JSTD_CHROMIUM to a Chromium or Chrome executable"


def find_chromium() -> str | None:
    """The Chromium to drive: ``$JSTD_CHROMIUM``, else the first of EXECUTABLES on the PATH; None when there is
    none."""
    named = os.environ.get("JSTD_CHROMIUM")
    if named:
        return shutil.which(named)
    return next((found for found in map(shutil.which, EXECUTABLES) if found), None)


class BrowserError(RuntimeError):
    """The browser failed: it exited, did not answer in time, or a script threw (the message has its text)."""


class Chromium:
    """A headless Chromium with one page of ``width`` x ``height`` pixels; a context manager (``close`` ends the
    browser and removes its profile). Raises FileNotFoundError when no Chromium is installed (``find_chromium``)."""

    def __init__(self, executable: str | None = None, width: int = 1400, height: int = 900, timeout: float = 60.0):
        import fcntl  # POSIX only: imported here so that importing jstd works where there is none

        executable = executable or find_chromium()
        if not executable:
            raise FileNotFoundError(f"no Chromium found: {INSTALL}")
        self.timeout, self.width, self.height = timeout, width, height
        self.profile = tempfile.mkdtemp(prefix="jstd-chromium-")
        self.log = Path(self.profile) / "chromium.log"
        commands, answers = os.pipe(), os.pipe()
        # above fd 9 and close-on-exec, so the spawn's dup2 onto 3 and 4 is the only way they reach the browser
        theirs = [fcntl.fcntl(commands[0], fcntl.F_DUPFD_CLOEXEC, 10), fcntl.fcntl(answers[1], fcntl.F_DUPFD_CLOEXEC, 10)]
        for fd in (commands[0], answers[1]):
            os.close(fd)
        self.send_fd, self.recv_fd = commands[1], answers[0]
        args = [executable, "--headless=new", "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", "--mute-audio", f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        actions = [(os.POSIX_SPAWN_DUP2, theirs[0], 3), (os.POSIX_SPAWN_DUP2, theirs[1], 4),
                   (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 1, str(self.log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
                   (os.POSIX_SPAWN_OPEN, 2, str(self.log), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)]
        self.pid = os.posix_spawn(executable, args, os.environ, file_actions=actions, setsid=True)
        for fd in theirs:
            os.close(fd)
        self.buffer, self.events, self.next_id, self.session = b"", [], 0, None
        try:
            page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                      mobile=False)
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    # ---- the protocol
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.recv_fd], [], [], left)[0]:
                raise BrowserError(f"Chromium did not answer in {self.timeout:.0f} s{self._log_tail()}")
            chunk = os.read(self.recv_fd, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited{self._log_tail()}")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, **params):
        """Sends one DevTools command (to the page once attached) and returns its result; events that arrive
        meanwhile are kept in ``events``. Raises BrowserError on an error answer or no answer in ``timeout``."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self.send_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read_message(deadline)
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error'].get('message')}")
                return answer.get("result", {})
            self.events.append(answer)

    def wait_for(self, event: str) -> dict:
        """The first kept or arriving event named ``event`` (consumed)."""
        deadline = time.monotonic() + self.timeout
        while True:
            for i, e in enumerate(self.events):
                if e.get("method") == event:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))

    def _log_tail(self) -> str:
        try:
            return "; its log ends:\n" + self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    # ---- a page
    def open(self, url: str) -> None:
        """Loads ``url`` (``file://``, ``http://``) and waits for its load event; script errors thrown while it
        loads raise BrowserError."""
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"could not open {url}: {result['errorText']}")
        self.wait_for("Page.loadEventFired")
        thrown = [e for e in self.events if e.get("method") == "Runtime.exceptionThrown"]
        if thrown:
            details = thrown[0]["params"]["exceptionDetails"]
            raise BrowserError(f"the page threw: {details.get('exception', {}).get('description') or details['text']}")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited; JSON-like values). Raises
        BrowserError with the script's error where it throws."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{details.get('exception', {}).get('description') or details['text']}\n"
                               f"in: {expression[:300]}")
        return result["result"].get("value")

    def mouse(self, x: float, y: float, click: bool = False) -> None:
        """Moves the mouse to (x, y) in the page's viewport (CSS pixels), then clicks there when ``click``."""
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        if click:
            for kind in ("mousePressed", "mouseReleased"):
                self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path) -> Path:
        """Writes a PNG of the viewport to ``path``; returns it."""
        path = Path(path)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        """Closes the browser (then ends its process group if it lingers) and removes its profile."""
        if self.pid:
            try:
                self.call("Browser.close")
            except (BrowserError, OSError):
                pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                time.sleep(0.05)
            try:
                os.killpg(self.pid, signal.SIGKILL)  # the group this browser leads (setsid): its renderers
            except ProcessLookupError:
                pass
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass
            self.pid = None
        for fd in (self.send_fd, self.recv_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.send_fd = self.recv_fd = -1
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

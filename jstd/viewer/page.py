"""One self-contained HTML page: a template, one kind's body, styles and script from ``static/``, and its data inlined
as JSON. Nothing is fetched when the page opens (no network, no CDN), so it opens from disk on an offline machine;
``serve`` hands it to a browser over HTTP on 127.0.0.1 only."""

from __future__ import annotations

import html
import json
import math
import re
import threading
import webbrowser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STATIC = Path(__file__).parent / "static"
LOCALHOST = "127.0.0.1"


def inline_json(data) -> str:
    """``data`` as JSON that can sit inside a ``<script>`` element: every ``<`` escaped as ``\\u003c`` (so no
    ``</script>`` or ``<!--`` in a string ends the element). Raises ValueError on NaN or infinity, which JSON cannot
    carry, naming where it is."""
    try:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise ValueError(f"the page's data holds NaN or infinity at {non_finite(data)}: JSON has no such numbers; "
                         "replace them (null, or a finite value) before viewing") from None
    return text.replace("<", "\\u003c")


def non_finite(data, where="data") -> str | None:
    """The path of the first NaN or infinity in ``data`` (nested dicts and lists), or None."""
    if isinstance(data, float) and not math.isfinite(data):
        return where
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for key, value in items:
        found = non_finite(value, f"{where}[{key!r}]")
        if found:
            return found
    return None


def page(kind: str, data, title: str) -> str:
    """The HTML of one page of ``kind`` (``static/{kind}.html``, ``.css``, ``.js``) with ``data`` inlined as the
    JSON of ``<script id="page-data">``; ``title`` is escaped."""
    parts = {"TITLE": html.escape(title), "STYLE": (STATIC / f"{kind}.css").read_text(),
             "BODY": (STATIC / f"{kind}.html").read_text(), "SCRIPT": (STATIC / f"{kind}.js").read_text(),
             "DATA": inline_json(data)}
    template = (STATIC / "page.html").read_text()
    return re.sub(r"__(TITLE|STYLE|BODY|SCRIPT|DATA)__", lambda m: parts[m.group(1)], template)  # one pass


def write(text: str, out, open_browser: bool = False) -> Path:
    """Writes the page ``text`` to ``out`` (parents made), opens it in the default browser when ``open_browser``;
    returns the path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    if open_browser:
        webbrowser.open(out.resolve().as_uri())
    return out


class _Page(BaseHTTPRequestHandler):
    text = b""

    def do_GET(self):  # noqa: N802 (the handler's name)
        found = self.path.split("?")[0] in ("/", "/index.html")
        body = self.text if found else b"not found: this server serves one page, at /\n"
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "text/html; charset=utf-8" if found else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(text: str, port: int = 0) -> ThreadingHTTPServer:
    """A server for the page ``text`` at ``http://127.0.0.1:{port}/`` (``port=0``: a free one; read
    ``server.server_address``), bound to 127.0.0.1 only and serving in a daemon thread; ``server.shutdown()`` stops
    it. Raises OSError when the port is taken."""
    handler = type("Page", (_Page,), {"text": text.encode("utf-8")})
    server = ThreadingHTTPServer((LOCALHOST, port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

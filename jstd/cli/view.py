"""``jstd view GRAPH.json``: an attribution graph (the JSON circuit-tracer's frontend reads; jstd writes the same) as
one self-contained HTML page, written beside the JSON (or ``--out``), optionally served on 127.0.0.1 (``--port``),
opened in the browser (``--open``) or photographed by a headless Chromium (``--png``)."""

from __future__ import annotations

import threading
import webbrowser
from pathlib import Path

from jstd import viewer


def add_arguments(subparsers) -> None:
    v = subparsers.add_parser("view", help="an attribution graph JSON as a self-contained HTML page (no network)")
    v.add_argument("graph", help="the graph JSON (jstd's or circuit-tracer's create_graph_files output)")
    v.add_argument("--out", default=None, metavar="PAGE.html", help="where to write the page (default: beside the "
                                                                    "JSON, GRAPH.html)")
    v.add_argument("--port", type=int, default=None, help="also serve the page at http://127.0.0.1:PORT/ until "
                                                          "Ctrl-C (0: a free port); never bound to another address")
    v.add_argument("--open", action="store_true", help="open the page in the default browser")
    v.add_argument("--png", default=None, metavar="SHOT.png",
                   help="also write a screenshot taken by a headless Chromium (apt-get install chromium)")


def command(args, stop: threading.Event | None = None) -> int:
    """Writes the page; then the screenshot, the browser and the server as asked. The server runs until Ctrl-C or
    until ``stop`` is set (tests)."""
    path = viewer.view(args.graph, args.out)
    print(f"page: {path.resolve()} ({path.stat().st_size / 1024:.0f} KiB; opens from disk, no network)")
    if args.png:
        with viewer.Chromium() as browser:
            browser.open(path.resolve().as_uri())
            browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")
            print(f"screenshot: {browser.screenshot(args.png).resolve()}")
    if args.port is None:
        if args.open:
            webbrowser.open(path.resolve().as_uri())
        return 0
    server = viewer.serve(Path(path).read_text(encoding="utf-8"), args.port)
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/"
    print(f"serving {url} (127.0.0.1 only; from another machine: ssh -L {port}:127.0.0.1:{port} ...); Ctrl-C stops",
          flush=True)
    if args.open:
        webbrowser.open(url)
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0

"""The attribution-graph viewer (jstd.viewer, ``jstd view``).

Without a browser: the page is one self-contained file (nothing fetched, under 200 KB besides the graph, the graph
inlined intact), bad graph files raise errors that name the problem, the command writes and serves the page on
127.0.0.1 only. In a real headless Chromium (Debian's ``chromium``; these tests skip, saying so, where none is
installed): the DOM has the graph's nodes and edges, hovering a node shows its activation (or probability),
clicking pins exactly its paths to the logits, the slider hides exactly the edges under its threshold, a shared
node id (circuit-tracer's error/feature collision) draws both nodes and says so, a screenshot is not blank, and a
3,000-node graph pruned to ~200 renders (its time printed; no timed assertion)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
import warnings
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from viewer_graphs import cantor, error_node, pruned_large, random_dag

from jstd import cli, viewer
from jstd.cli import view as view_command

BROWSER = viewer.find_chromium()
needs_browser = pytest.mark.skipif(BROWSER is None, reason=f"no Chromium to test the page in: {viewer.headless.INSTALL}")


def inlined(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="page-data">(.*?)</script>', html, re.S).group(1))


# ---- the page, no browser

def test_page_is_self_contained_and_small():
    graph = random_dag()
    html = viewer.graph_page(graph)
    assert inlined(html) == graph                                      # the graph, intact
    data = re.search(r'id="page-data">(.*?)</script>', html, re.S).group(1)
    assert "</script>" in json.dumps(graph) and "</script" not in data  # a '</script>' in a label cannot end it
    code = html.replace(data, "")
    assert len(code.encode()) < 200_000, len(code)
    # nothing is fetched: no external script, style, image or font; the one URL is the SVG namespace (a name)
    assert not re.search(r"<(link|img|iframe)\b|\bsrc=|@import|url\(|fetch\(|XMLHttpRequest", code)
    assert set(re.findall(r"https?://[^\s\"'`]+", code)) == {"http://www.w3.org/2000/svg"}


def test_view_writes_beside_the_json_and_where_asked(tmp_path):
    src = tmp_path / "g.json"
    src.write_text(json.dumps(random_dag()))
    assert viewer.view(src) == tmp_path / "g.html" and inlined((tmp_path / "g.html").read_text()) == random_dag()
    out = viewer.view(src.read_text(), tmp_path / "sub" / "page.html")        # JSON text; parents made
    assert out.read_text() == (tmp_path / "g.html").read_text()


@pytest.mark.parametrize("change,message", [
    (lambda g: g.pop("links"), "no 'links' list"),
    (lambda g: g["nodes"][3].pop("ctx_idx"), "node 3 has no 'ctx_idx'"),
    (lambda g: g["nodes"][2].update(ctx_idx=-1), "a position is an int >= 0"),
    (lambda g: g["nodes"][7].update(layer="mlp"), "has layer 'mlp'; a feature's or an error's layer is a block number"),
    (lambda g: g["links"][5].update(target="7_7_7"), "link 5's target '7_7_7' is no node's node_id"),
    (lambda g: g["links"][0].update(weight=float("nan")), "a weight is a finite number"),
    (lambda g: g["links"][1].pop("weight"), "link 1 has no 'weight'"),
])
def test_bad_graphs_name_the_problem(change, message):
    graph = random_dag()
    change(graph)
    with pytest.raises(viewer.GraphFileError, match=re.escape(message)):
        viewer.graph_page(graph)


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no graph JSON at"):
        viewer.view(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(viewer.GraphFileError, match="is not JSON"):
        viewer.view(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="a path to one, its text, or the dict"):
        viewer.view(42)
    graph = random_dag()
    graph["nodes"][0]["influence"] = float("inf")
    with pytest.raises(ValueError, match=r"NaN or infinity at data\['nodes'\]\[0\]\['influence'\]"):
        viewer.graph_page(graph)


def test_shared_ids_warn():
    graph, shared = collided()
    with pytest.warns(viewer.SharedIdWarning, match=shared):
        viewer.graph_page(graph)


def test_command_writes_and_serves_on_localhost_only(tmp_path, capsys):
    src = tmp_path / "g.json"
    src.write_text(json.dumps(random_dag()))
    assert cli.main(["view", str(src), "--out", str(tmp_path / "p.html")]) == 0
    assert "opens from disk" in capsys.readouterr().out and (tmp_path / "p.html").is_file()
    stop = threading.Event()
    args = Namespace(graph=str(src), out=None, port=0, open=False, png=None)
    thread = threading.Thread(target=view_command.command, args=(args, stop))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "serving" not in (printed := capsys.readouterr().out) and time.monotonic() < deadline:
            time.sleep(0.05)
        url = re.search(r"serving (http://\S+)", printed).group(1)
        assert url.startswith("http://127.0.0.1:")
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert inlined(page) == random_dag()
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "other", timeout=10)
    finally:
        stop.set()
        thread.join(10)
    server = viewer.serve("<p>x</p>")
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.shutdown()
        server.server_close()


# ---- the page in a real browser

def collided() -> tuple[dict, str]:
    """(a circuit-tracer graph where a layer-0 feature, index 3, and the error node of layer 3 at its position are
    both named 0_3_{position}; that id)."""
    graph = random_dag(seed=1)
    feature = next(n for n in graph["nodes"] if n["layer"] == "0" and n["feature_type"] == "cross layer transcoder")
    old, shared = feature["node_id"], f"0_3_{feature['ctx_idx']}"
    feature.update(node_id=shared, feature=cantor(0, 3))
    for link in graph["links"]:
        for end in ("source", "target"):
            link[end] = shared if link[end] == old else link[end]
    graph["nodes"].append(error_node(3, feature["ctx_idx"], 0.5))           # circuit-tracer's name: the same id
    logit = next(n["node_id"] for n in graph["nodes"] if n["is_target_logit"])
    graph["links"].append({"source": shared, "target": logit, "weight": 0.7})
    return graph, shared


@pytest.fixture(scope="module")
def browser():
    if BROWSER is None:
        pytest.skip(f"no Chromium to test the page in: {viewer.headless.INSTALL}")
    with viewer.Chromium(BROWSER, width=1400, height=900) as b:
        yield b


def show(browser, tmp_path, graph, name="page.html"):
    """Opens the viewer page of ``graph`` from disk; waits for its first frame."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", viewer.SharedIdWarning)
        path = viewer.view(graph, tmp_path / name)
    browser.open(path.resolve().as_uri())
    browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")
    return path


def node_center(browser, node_id: str, nth: int = 0):
    return browser.evaluate(f"""(() => {{ const e = document.querySelectorAll('.node[data-id="{node_id}"]')[{nth}];
        e.scrollIntoView({{block: 'center', inline: 'center'}}); const r = e.getBoundingClientRect();
        return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")


def paths_to_logits(graph, pinned: str, visible) -> tuple[set, set]:
    """(node ids, link indices) on the paths from ``pinned`` to any logit over the links ``visible`` (indices);
    for a logit, the paths into it. Nodes keyed by node_id (the first of a shared id)."""
    links = [(i, l["source"], l["target"]) for i, l in enumerate(graph["links"]) if i in visible]
    def reach(start, forward):
        seen, stack = {start}, [start]
        while stack:
            v = stack.pop()
            for _, s, t in links:
                a, b = (s, t) if forward else (t, s)
                if a == v and b not in seen:
                    seen.add(b)
                    stack.append(b)
        return seen
    kind = {}
    for n in graph["nodes"]:
        kind.setdefault(n["node_id"], n["feature_type"])
    if kind[pinned] == "logit":
        on = reach(pinned, False)
    else:
        to_logits = set().union(*(reach(n, False) for n, k in kind.items() if k == "logit"))
        on = (reach(pinned, True) & to_logits) | {pinned}
    return on, {i for i, s, t in links if s in on and t in on}


def dom_state(browser):
    return browser.evaluate("""({
        nodes: document.querySelectorAll('#nodes .node').length,
        edges: document.querySelectorAll('#edges .edge').length,
        hidden: [...document.querySelectorAll('#edges .edge.hidden')].map(e => +e.dataset.index),
        onPath: [...document.querySelectorAll('#edges .edge.on-path')].map(e => +e.dataset.index),
        onPathNodes: [...document.querySelectorAll('#nodes .node.on-path')].map(e => e.dataset.id),
        pinned: [...document.querySelectorAll('.node.pinned')].map(e => e.dataset.id),
        tokens: [...document.querySelectorAll('#prompt text.token:not(.rowlabel)')].map(e => e.querySelector('title').textContent),
        warnings: document.getElementById('warnings').hidden ? '' : document.getElementById('warnings').textContent,
    })""")


@needs_browser
def test_counts_and_prompt(browser, tmp_path):
    graph = random_dag()
    show(browser, tmp_path, graph)
    state = dom_state(browser)
    assert (state["nodes"], state["edges"]) == (len(graph["nodes"]), len(graph["links"]))
    assert state["tokens"] == [f"position {p}: {json.dumps(t)}" for p, t in enumerate(graph["metadata"]["prompt_tokens"])]
    assert state["hidden"] == [] and state["pinned"] == [] and state["warnings"] == ""
    assert browser.evaluate("document.getElementById('counts').textContent") == \
        f"{len(graph['nodes'])} nodes, {len(graph['links'])} of {len(graph['links'])} edges shown"


@needs_browser
def test_a_jstd_graph_opens_pinned(browser, tmp_path):
    """``jstd.view(graph)`` on a ``jstd.circuits.Graph``: the pruned graph's nodes and edges are drawn, the node
    asked for is pinned when the page opens, and its paths to the logits are highlighted."""
    import jstd
    from test_circuits_display import random_graph

    graph = random_graph(3)
    path = jstd.circuits.top_path(graph, jstd.circuits.prune(graph))
    page = jstd.view(graph, tmp_path / "g.html", pin=path.nodes[0])
    data = inlined(page.read_text())
    browser.open(page.resolve().as_uri())
    browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")
    state = dom_state(browser)
    assert (state["nodes"], state["edges"]) == (len(data["nodes"]), len(data["links"]))
    token = graph.node(path.nodes[0])
    assert state["pinned"] == [f"E_{token[2]}_{token[1]}"]
    want_nodes, want_links = paths_to_logits(data, state["pinned"][0], range(len(data["links"])))
    assert set(state["onPathNodes"]) == want_nodes and set(state["onPath"]) == want_links


@needs_browser
def test_hover_shows_the_node(browser, tmp_path):
    graph = random_dag()
    show(browser, tmp_path, graph)
    feature = max((n for n in graph["nodes"] if n["feature_type"] == "cross layer transcoder"),
                  key=lambda n: sum(l["target"] == n["node_id"] for l in graph["links"]))
    browser.mouse(*node_center(browser, feature["node_id"]))
    details = browser.evaluate("""(() => { const d = document.getElementById('details'); return {
        text: d.textContent, activation: d.querySelector('.activation')?.textContent,
        raw: d.querySelector('.activation')?.dataset.value, index: d.querySelector('.feature-index')?.textContent,
        inputs: [...d.querySelectorAll('table.inputs .w')].map(e => +e.textContent) }; })()""")
    assert details["raw"] == repr(feature["activation"])
    assert float(details["activation"]) == pytest.approx(feature["activation"], rel=1e-3)
    assert details["index"] == feature["node_id"].split("_")[1]               # the index, not cantor(layer, index)
    weights = sorted((l["weight"] for l in graph["links"] if l["target"] == feature["node_id"]), key=abs, reverse=True)
    assert details["inputs"] == pytest.approx(weights[:8], rel=1e-3)          # top inputs, strongest first
    logit = next(n for n in graph["nodes"] if n["feature_type"] == "logit" and not n["is_target_logit"])
    browser.mouse(*node_center(browser, logit["node_id"]))
    raw = browser.evaluate("document.querySelector('#details .probability').dataset.value")
    token = browser.evaluate("document.querySelector('#details .token').textContent")
    assert float(raw) == logit["token_prob"] and token == json.dumps(logit["clerp"].split('"')[1])
    error = next(n for n in graph["nodes"] if n["feature_type"] == "mlp reconstruction error")
    browser.mouse(*node_center(browser, error["node_id"]))
    assert browser.evaluate("document.querySelector('#details h2').textContent") == "Reconstruction error"
    browser.mouse(2, 2)                                                         # off the node: the hint again
    assert "Hover a node" in browser.evaluate("document.getElementById('details').textContent")


@needs_browser
def test_pin_highlights_the_paths_to_the_logits(browser, tmp_path):
    graph = random_dag()
    show(browser, tmp_path, graph)
    everything = set(range(len(graph["links"])))
    low = [n["node_id"] for n in graph["nodes"] if n["layer"] == "0" and n["feature_type"] != "mlp reconstruction error"]
    checked = 0
    for node_id in low[:3] + [n["node_id"] for n in graph["nodes"] if n["is_target_logit"]]:
        browser.mouse(*node_center(browser, node_id), click=True)
        state = dom_state(browser)
        on, edges = paths_to_logits(graph, node_id, everything)
        assert state["pinned"] == [node_id]
        assert set(state["onPath"]) == edges and set(state["onPathNodes"]) == on
        checked += len(edges) > 0
        browser.mouse(*node_center(browser, node_id), click=True)              # the same node again releases it
        assert dom_state(browser)["pinned"] == [] and dom_state(browser)["onPath"] == []
    assert checked >= 2                                                         # not a vacuous comparison


@needs_browser
def test_slider_hides_the_edges_under_its_threshold(browser, tmp_path):
    graph = random_dag()
    show(browser, tmp_path, graph)
    weights = np.abs([l["weight"] for l in graph["links"]])
    for s in (0.2, 0.45, 0.0):
        browser.evaluate(f"(() => {{ const i = document.getElementById('threshold'); i.value = '{s}'; "
                         "i.dispatchEvent(new Event('input')); })()")
        state = dom_state(browser)
        expected = {i for i, w in enumerate(weights) if w < weights.max() * s * s}
        assert set(state["hidden"]) == expected and (s == 0 or 0 < len(expected) < len(weights))
    # a pin follows the edges shown
    browser.evaluate("(() => { const i = document.getElementById('threshold'); i.value = '0.3'; "
                     "i.dispatchEvent(new Event('input')); })()")
    shown = {i for i, w in enumerate(weights) if w >= weights.max() * 0.09}
    target = next(n["node_id"] for n in graph["nodes"] if n["is_target_logit"])
    browser.mouse(*node_center(browser, target), click=True)
    on, edges = paths_to_logits(graph, target, shown)
    assert set(dom_state(browser)["onPath"]) == edges and edges < shown
    browser.mouse(*node_center(browser, target), click=True)


@needs_browser
def test_resize_redraws_and_keeps_the_state(browser, tmp_path):
    graph = random_dag()
    show(browser, tmp_path, graph)
    browser.evaluate("(() => { const i = document.getElementById('threshold'); i.value = '0.3'; "
                     "i.dispatchEvent(new Event('input')); })()")
    target = next(n["node_id"] for n in graph["nodes"] if n["is_target_logit"])
    browser.mouse(*node_center(browser, target), click=True)
    before = dom_state(browser)
    size = "[+document.getElementById('graph').getAttribute('width'), document.getElementById('canvas').clientWidth]"
    try:
        browser.call("Emulation.setDeviceMetricsOverride", width=900, height=640, deviceScaleFactor=1, mobile=False)
        browser.evaluate("new Promise(r => setTimeout(r, 400))")              # the page redraws 100 ms after
        width, room = browser.evaluate(size)
        assert dom_state(browser) == before and width == pytest.approx(room, abs=1)  # refit, same state
    finally:
        browser.call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
        browser.evaluate("new Promise(r => setTimeout(r, 400))")


@needs_browser
def test_shared_ids_draw_both_nodes_and_say_so(browser, tmp_path):
    graph, shared = collided()
    show(browser, tmp_path, graph)
    state = dom_state(browser)
    assert (state["nodes"], state["edges"]) == (len(graph["nodes"]), len(graph["links"]))
    assert shared in state["warnings"] and "first node with the id takes its edges" in state["warnings"]
    kinds = browser.evaluate(f"[...document.querySelectorAll('.node[data-id=\"{shared}\"]')].map(e => e.getAttribute('class'))")
    assert sorted(kinds) == ["node error", "node feature"]
    # jstd's ids (unique across kinds) draw without a warning
    graph = random_dag(seed=1, error_id=lambda l, p: f"err_{l}_{p}")
    show(browser, tmp_path, graph)
    assert dom_state(browser)["warnings"] == "" and dom_state(browser)["nodes"] == len(graph["nodes"])


@needs_browser
def test_screenshot_is_not_blank(browser, tmp_path):
    from PIL import Image

    show(browser, tmp_path, random_dag())
    shot = browser.screenshot(tmp_path / "graph.png")
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    print(f"\nscreenshot: {shot}")
    assert pixels.shape[:2] == (900, 1400)
    assert (pixels.min(-1) < 200).mean() > 0.01                                # more than a blank page
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    blue = (b - r > 40) & (b - g > 15)                                         # positive edges (on white)
    red = (r - g > 40) & (np.abs(g - b) < 40)                                  # negative edges
    amber = (r > 200) & (g - b > 70)                                           # features
    assert blue.sum() > 200 and red.sum() > 200 and amber.sum() > 200


@needs_browser
def test_command_png(tmp_path, capsys):
    from PIL import Image

    src = tmp_path / "g.json"
    src.write_text(json.dumps(random_dag()))
    assert cli.main(["view", str(src), "--png", str(tmp_path / "g.png")]) == 0
    assert "screenshot:" in capsys.readouterr().out
    pixels = np.asarray(Image.open(tmp_path / "g.png").convert("RGB")).astype(int)
    assert pixels.shape[:2] == (900, 1400) and (pixels.min(-1) < 200).mean() > 0.01


@needs_browser
def test_large_graph_renders(browser, tmp_path):
    graph, edges_before = pruned_large(edge_share=0.995)
    path = show(browser, tmp_path, graph, "large.html")
    state = dom_state(browser)
    assert (state["nodes"], state["edges"]) == (len(graph["nodes"]), len(graph["links"]))
    render_ms = float(browser.evaluate("document.body.dataset.renderMs"))
    target = next(n["node_id"] for n in graph["nodes"] if n["is_target_logit"])
    pin_ms = browser.evaluate(f"""(() => {{ const t = performance.now();
        document.querySelector('.node[data-id="{target}"]').dispatchEvent(new MouseEvent('click', {{bubbles: true}}));
        return performance.now() - t; }})()""")
    page_kb = (path.stat().st_size - len(json.dumps(graph, separators=(",", ":")))) / 1024
    print(f"\nviewer: 3000 nodes ({edges_before} edges) pruned to {len(graph['nodes'])} nodes and "
          f"{len(graph['links'])} edges: rendered in {render_ms:.0f} ms (script start to first frame, headless "
          f"Chromium); pinning the target logit {pin_ms:.0f} ms; page {page_kb:.0f} KB besides the graph")
    assert dom_state(browser)["pinned"] == [target]


# ---- figures: attention patterns and heatmaps in the same style

def causal_probs(seed=0, layers=2, heads=3, n=7):
    rng = np.random.default_rng(seed)
    scores = np.where(np.tri(n, dtype=bool), rng.normal(0, 2, (layers, heads, n, n)), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_figures_check_their_inputs():
    with pytest.raises(ValueError, match="query == key"):
        viewer.attention_figure(np.zeros((2, 3, 4, 5)))
    with pytest.raises(ValueError, match="one label per position"):
        viewer.attention_figure(causal_probs(), labels=["a"] * 6)
    with pytest.raises(ValueError, match="3 rows labels"):
        viewer.grid_figure(np.zeros((2, 4)), rows=["a", "b", "c"])
    with pytest.raises(ValueError, match="one string per cell"):
        viewer.grid_figure(np.zeros((2, 4)), text=[["x"] * 4])
    figure = viewer.grid_figure(np.array([[1.0, np.nan], [np.inf, 2.0]]))
    assert figure["values"] == [[1.0, None], [None, 2.0]]                   # JSON has no NaN


@needs_browser
def test_figures_page_hover_and_pick(browser, tmp_path):
    probs = causal_probs()
    labels = [f"t{i}" for i in range(7)]
    values = np.random.default_rng(1).normal(size=(3, 7))
    values[2, 5] = np.nan
    path = viewer.view_figures([viewer.attention_figure(probs, labels, layers=[4, 5]),
                                viewer.grid_figure(values, [f"block {l}" for l in range(3)], labels, center=0.0,
                                                   value_label="recovered")], tmp_path / "figures.html")
    browser.open(path.resolve().as_uri())
    browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 0)))")

    def hover(section, i, j):
        x, y, cell = browser.evaluate(f"""(() => {{ const c = document.querySelectorAll('section')[{section}]
            .querySelector('canvas.main'); c.scrollIntoView({{block: 'center'}}); const r = c.getBoundingClientRect();
            return [r.x, r.y, +c.dataset.cell]; }})()""")
        browser.mouse(x + (j + 0.5) * cell, y + (i + 0.5) * cell)
        return browser.evaluate(f"""(() => {{ const r = document.querySelectorAll('section')[{section}]
            .querySelector('.readout'); return [r.textContent, r.dataset.value, r.dataset.cell]; }})()""")

    assert browser.evaluate("document.querySelectorAll('.thumb').length") == 6
    text, value, cell = hover(0, 5, 2)
    assert cell == "5,2" and float(value) == pytest.approx(probs[0, 0, 5, 2], abs=1e-5)
    assert text.startswith('block 4 head 0: query 5 "t5" -> key 2 "t2"')
    x, y = browser.evaluate("""(() => { const r = document.querySelector('.thumb[data-block="1"][data-head="2"] canvas')
        .getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()""")
    browser.mouse(x, y, click=True)
    text, value, _ = hover(0, 6, 3)
    assert float(value) == pytest.approx(probs[1, 2, 6, 3], abs=1e-5) and text.startswith("block 5 head 2")
    text, value, _ = hover(1, 1, 4)
    assert float(value) == values[1, 4] and text.startswith("block 1, t4: recovered")
    assert hover(1, 2, 5)[0].endswith("recovered n/a")


# ---- graphs circuit-tracer wrote (its create_graph_files output, tests/data/circuit_tracer/<case>/graph.json)

CIRCUIT_TRACER = sorted((Path(__file__).parent / "data" / "circuit_tracer").glob("*/graph.json"))


@needs_browser
@pytest.mark.skipif(not CIRCUIT_TRACER, reason="no circuit-tracer graphs in tests/data/circuit_tracer (the "
                                               "reference data of issue 37)")
def test_circuit_tracer_graphs_open(browser, tmp_path):
    """Every reference graph circuit-tracer wrote opens: all its nodes and links drawn, the target logit's paths
    pinned as computed here, and its id collisions (error 0_{l}_{p} = the layer-0 feature l at p) said."""
    collided = 0
    for path in CIRCUIT_TRACER:
        graph = json.loads(path.read_text())
        show(browser, tmp_path, graph, f"{path.parent.name}.html")
        state = dom_state(browser)
        assert (state["nodes"], state["edges"]) == (len(graph["nodes"]), len(graph["links"])), path
        ids = [n["node_id"] for n in graph["nodes"]]
        shared = {i for i in ids if ids.count(i) > 1}
        assert bool(state["warnings"]) == bool(shared) and all(i in state["warnings"] for i in list(shared)[:3])
        collided += bool(shared)
        target = next(n["node_id"] for n in graph["nodes"] if n["is_target_logit"])
        browser.mouse(*node_center(browser, target), click=True)
        on, edges = paths_to_logits(graph, target, set(range(len(graph["links"]))))
        assert set(dom_state(browser)["onPath"]) == edges and len(edges) > 0, path
    print(f"\n{len(CIRCUIT_TRACER)} circuit-tracer graphs opened, {collided} with shared ids")

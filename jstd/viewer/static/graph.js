"use strict";
// The attribution-graph viewer (jstd.viewer). Reads the graph inlined in #page-data, in the JSON that
// circuit-tracer's frontend and Neuronpedia read ({metadata, qParams, nodes, links}), and draws it as SVG:
// rows are layers (token embeddings at the bottom, logits at the top), columns are prompt positions, a node's size
// is its influence, an edge's colour its sign and its width its |weight|. Nodes are keyed by node_id; where a file
// gives one id to two nodes (circuit-tracer's error node 0_{l}_{p} and the layer-0 feature l at p), both are drawn,
// the first takes the id's edges, and the page says so.
(function () {
  const started = performance.now();
  const NS = "http://www.w3.org/2000/svg";
  const data = JSON.parse(document.getElementById("page-data").textContent);
  const meta = data.metadata || {};
  const tokens = meta.prompt_tokens || [];

  // ---- the graph: nodes keyed by node_id, links resolved to their endpoints
  const kindOf = (n) => {
    const t = String(n.feature_type || "").toLowerCase();
    if (t === "embedding" || n.layer === "E") return "embedding";
    if (t === "logit") return "logit";
    if (t.includes("error")) return "error";
    return "feature";
  };
  const nodes = data.nodes.map((n, i) => Object.assign({}, n, {index: i, kind: kindOf(n), ins: [], outs: []}));
  const byId = new Map();
  const shared = new Set();
  for (const n of nodes) {
    if (byId.has(n.node_id)) shared.add(n.node_id);
    else byId.set(n.node_id, n);
  }
  const links = [];
  let dangling = 0;
  data.links.forEach((l, i) => {
    const s = byId.get(l.source), t = byId.get(l.target);
    if (!s || !t) { dangling += 1; return; }
    const link = {index: i, s, t, weight: Number(l.weight), abs: Math.abs(Number(l.weight)), hidden: false};
    s.outs.push(link);
    t.ins.push(link);
    links.push(link);
  });
  const maxAbs = links.reduce((m, l) => Math.max(m, l.abs), 0) || 1;
  for (const n of nodes) {
    n.ins.sort((a, b) => b.abs - a.abs);
    n.outs.sort((a, b) => b.abs - a.abs);
  }

  // ---- what a node is, in words
  const fmt = (x) => (x === null || x === undefined || x === "") ? "" : String(Number(Number(x).toPrecision(4)));
  const tokenAt = (p) => (p >= 0 && p < tokens.length) ? tokens[p] : "";
  const quoted = (s) => JSON.stringify(String(s));
  const featureIndex = (n) => {   // node_id {layer}_{feature}_{position}; `feature` itself is cantor(layer, feature)
    const m = /^(\d+)_(\d+)_(\d+)$/.exec(String(n.node_id));
    return m ? m[2] : String(n.feature);
  };
  const logitToken = (n) => {
    const m = /^Output (".*") \(p=/.exec(n.clerp || "");
    if (m) { try { return JSON.parse(m[1]); } catch (e) { return m[1].slice(1, -1); } }
    return "#" + n.feature;
  };
  const shortName = (n) => {
    if (n.kind === "feature") return `F${n.layer}/${featureIndex(n)}@${n.ctx_idx}`;
    if (n.kind === "error") return `error ${n.layer}@${n.ctx_idx}`;
    if (n.kind === "embedding") return `token ${quoted(tokenAt(n.ctx_idx))}@${n.ctx_idx}`;
    return `logit ${quoted(logitToken(n))}`;
  };

  // ---- layout: rows bottom (embeddings) to top (logits), a column per position; the graph fills the window, and
  // scrolls where a crowded cell or many rows need more room than it has
  const isLayer = (n) => n.kind === "feature" || n.kind === "error";
  const layerNumbers = nodes.filter(isLayer).map((n) => Number(n.layer)).filter(Number.isFinite);
  const topLayer = layerNumbers.reduce((a, b) => Math.max(a, b), -1);
  const rows = ["E"];
  for (let l = 0; l <= topLayer; l++) rows.push(String(l));
  rows.push("logits");
  const rowOf = (n) => n.kind === "embedding" ? 0 : n.kind === "logit" ? rows.length - 1 : 1 + Number(n.layer);
  const positions = nodes.reduce((m, n) => Math.max(m, Number(n.ctx_idx) + 1), Math.max(tokens.length, 1));
  const cells = new Map();
  for (const n of nodes) {
    const key = rowOf(n) + "," + n.ctx_idx;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(n);
  }
  const crowd = new Array(positions).fill(1);   // the most nodes in one cell of each column
  const order = {embedding: 0, error: 1, feature: 2, logit: 3};
  for (const [key, cell] of cells) {
    const p = Number(key.split(",")[1]);
    crowd[p] = Math.max(crowd[p], cell.length);
    cell.sort((a, b) => order[a.kind] - order[b.kind] || (b.token_prob || 0) - (a.token_prob || 0)
      || Number(a.feature) - Number(b.feature));                  // logits by probability, features by index
  }
  const importance = (n) => {
    if (n.kind === "logit") return Number(n.token_prob) || 0;
    if (typeof n.influence === "number") return Math.min(1, Math.max(0, 1 - n.influence));  // cumulative: small = important
    return 0.5;
  };
  const LEFT = 62, RIGHT = 12, TOP = 58, BOTTOM = 44, MIN_GAP = 8, MAX_GAP = 18;   // TOP: the logits' labels
  let colX, colWidth, rowY, width, height;
  function layout() {
    const box = document.getElementById("canvas");
    const weight = crowd.map((c) => 2 + c);                    // a column's share of the width
    const total = weight.reduce((a, b) => a + b, 0);
    const room = Math.max(box.clientWidth - LEFT - RIGHT, 100);
    const scale = Math.max(room / total, ...crowd.map((c, p) => MIN_GAP * (c + 1) / weight[p]));
    colWidth = weight.map((w) => w * scale);
    colX = [];
    let x = LEFT;
    for (let p = 0; p < positions; p++) { colX.push(x); x += colWidth[p]; }
    width = x + RIGHT;
    const rowH = Math.min(110, Math.max(30, (box.clientHeight - TOP - BOTTOM - 4) / rows.length));
    height = TOP + rows.length * rowH + BOTTOM;
    rowY = (r) => TOP + (rows.length - 1 - r + 0.5) * rowH;
    for (const [key, cell] of cells) {
      const p = Number(key.split(",")[1]);
      const gap = Math.min(MAX_GAP, colWidth[p] / (cell.length + 1));
      const start = colX[p] + colWidth[p] / 2 - (cell.length - 1) * gap / 2;
      cell.forEach((n, i) => {
        n.x = start + i * gap;
        n.y = rowY(rowOf(n));
        n.r = Math.max(2, Math.min(3 + 5 * importance(n), gap / 2 - 0.5, rowH / 3));
      });
    }
  }

  // ---- the header first: the graph fills the room it leaves
  const title = meta.prompt !== undefined ? meta.prompt : (meta.slug || "attribution graph");
  document.getElementById("title").textContent = title;
  document.title = (meta.slug ? meta.slug + ": " : "") + String(title).slice(0, 80);
  const warnings = [];
  if (shared.size) {
    warnings.push(`${shared.size} node id${shared.size > 1 ? "s are" : " is"} given to more than one node ` +
      `(${[...shared].slice(0, 3).join(", ")}${shared.size > 3 ? ", …" : ""}; circuit-tracer names an error node ` +
      "0_{layer}_{position}, as it names the layer-0 feature of that index): the first node with the id takes its edges.");
  }
  if (dangling) warnings.push(`${dangling} link${dangling > 1 ? "s name" : " names"} a node the file does not have: not drawn.`);
  if (warnings.length) {
    const w = document.getElementById("warnings");
    w.textContent = warnings.join(" ");
    w.hidden = false;
  }

  // ---- drawing
  const svg = document.getElementById("graph");
  const el = (name, attrs, parent) => {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  };
  const byStrength = links.slice().sort((a, b) => a.abs - b.abs);   // the strongest drawn last, on top
  function draw() {
    layout();
    svg.replaceChildren();
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    const grid = el("g", {id: "grid"}, svg);
    rows.forEach((name, r) => {
      el("line", {class: "gridline", x1: LEFT, x2: width - RIGHT, y1: rowY(r), y2: rowY(r)}, grid);
      const label = el("text", {class: "rowlabel", x: LEFT - 8, y: rowY(r) + 4}, grid);
      label.textContent = name === "E" ? "tokens" : name === "logits" ? "logits" : "layer " + name;
    });
    const prompt = el("g", {id: "prompt"}, svg);
    for (let p = 0; p < positions; p++) {
      const full = tokenAt(p);
      const chars = Math.max(3, Math.floor(colWidth[p] / 7));
      const t = el("text", {class: "token", x: colX[p] + colWidth[p] / 2, y: height - BOTTOM + 20, "data-position": p}, prompt);
      t.textContent = full.length > chars ? full.slice(0, chars - 1) + "…" : full;
      el("title", {}, t).textContent = `position ${p}: ${quoted(full)}`;
      const i = el("text", {class: "rowlabel token", x: colX[p] + colWidth[p] / 2, y: height - BOTTOM + 36}, prompt);
      i.textContent = p;
    }
    const edgeLayer = el("g", {id: "edges"}, svg);
    const frag = document.createDocumentFragment();
    for (const l of byStrength) {
      const my = (l.s.y + l.t.y) / 2;
      l.el = el("path", {
        class: "edge " + (l.weight >= 0 ? "pos" : "neg"), "data-index": l.index,
        d: `M${l.s.x.toFixed(1)},${l.s.y.toFixed(1)}C${l.s.x.toFixed(1)},${my.toFixed(1)} ${l.t.x.toFixed(1)},${my.toFixed(1)} ${l.t.x.toFixed(1)},${l.t.y.toFixed(1)}`,
        "stroke-width": (0.4 + 4.6 * l.abs / maxAbs).toFixed(2), "stroke-opacity": (0.2 + 0.65 * l.abs / maxAbs).toFixed(2),
      }, frag);
    }
    edgeLayer.appendChild(frag);
    const nodeLayer = el("g", {id: "nodes"}, svg);
    const nodeFrag = document.createDocumentFragment();
    for (const n of nodes) {
      const attrs = {class: `node ${n.kind}` + (n.is_target_logit ? " target" : ""), "data-id": n.node_id, "data-index": n.index};
      n.el = n.kind === "error"
        ? el("rect", Object.assign(attrs, {x: n.x - n.r, y: n.y - n.r, width: 2 * n.r, height: 2 * n.r}), nodeFrag)
        : el("circle", Object.assign(attrs, {cx: n.x, cy: n.y, r: n.r}), nodeFrag);
      n.el.addEventListener("mouseenter", () => hover(n));
      n.el.addEventListener("mouseleave", () => hover(null));
      n.el.addEventListener("click", (e) => { e.stopPropagation(); pin(pinned === n ? null : n); });
    }
    nodeLayer.appendChild(nodeFrag);
    const logitLabels = el("g", {id: "logit-labels"}, svg);     // each logit's token, slanted above it
    for (const n of nodes.filter((m) => m.kind === "logit")) {
      const word = logitToken(n);
      const t = el("text", {class: "logit-label", transform: `translate(${n.x + 3},${n.y - n.r - 4}) rotate(-50)`}, logitLabels);
      t.textContent = word.length > 12 ? word.slice(0, 11) + "…" : word;
    }
  }
  draw();
  svg.addEventListener("click", () => pin(null));
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") pin(null); });
  let resizing = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => { draw(); threshold(); }, 100);
  });

  // ---- details: the hovered node, else the pinned one
  const details = document.getElementById("details");
  const row = (table, name, value, cls, raw) => {
    const tr = document.createElement("tr");
    const a = document.createElement("td"), b = document.createElement("td");
    a.textContent = name;
    b.textContent = value;
    if (cls) b.className = cls;
    if (raw !== undefined) b.dataset.value = String(raw);
    tr.append(a, b);
    table.appendChild(tr);
  };
  const edgeList = (heading, list, other, cls) => {
    const h = document.createElement("h3");
    const shown = list.filter((l) => !l.hidden);
    h.textContent = `${heading} (${shown.length} shown${list.length > shown.length ? ` of ${list.length}` : ""})`;
    details.appendChild(h);
    const table = document.createElement("table");
    table.className = cls;
    for (const l of shown.slice(0, 8)) {
      const tr = document.createElement("tr");
      const w = document.createElement("td"), who = document.createElement("td");
      w.className = "w " + (l.weight >= 0 ? "pos" : "neg");
      w.textContent = (l.weight >= 0 ? "+" : "") + fmt(l.weight);
      who.textContent = shortName(other(l));
      tr.append(w, who);
      table.appendChild(tr);
    }
    details.appendChild(table);
  };
  function show(n) {
    details.replaceChildren();
    if (!n) {
      const p = document.createElement("p");
      p.className = "hint";
      p.textContent = "Hover a node for its details.";
      details.appendChild(p);
      return;
    }
    const h = document.createElement("h2");
    h.textContent = {feature: "Feature", error: "Reconstruction error", embedding: "Token", logit: "Logit"}[n.kind];
    details.appendChild(h);
    if (n === pinned) {
      const p = document.createElement("p");
      p.className = "pinned-note";
      p.textContent = "pinned (click it again, the background or Esc to release)";
      details.appendChild(p);
    }
    const table = document.createElement("table");
    table.className = "fields";
    row(table, "id", n.node_id, "node-id");
    if (n.kind === "feature") {
      row(table, "feature", featureIndex(n), "feature-index");
      row(table, "layer", n.layer, "layer");
      row(table, "activation", fmt(n.activation), "activation", n.activation);
    } else if (n.kind === "error") {
      row(table, "what", `the part of layer ${n.layer}'s MLP output the transcoder does not reconstruct`, "error");
      row(table, "layer", n.layer, "layer");
    } else if (n.kind === "logit") {
      row(table, "token", quoted(logitToken(n)), "token");
      row(table, "token id", n.feature, "token-id");
      row(table, "probability", fmt(n.token_prob), "probability", n.token_prob);
      if (n.is_target_logit) row(table, "target", "yes (the first target)", "target");
    } else {
      row(table, "token", quoted(tokenAt(n.ctx_idx)), "token");
    }
    row(table, "position", `${n.ctx_idx} (${quoted(tokenAt(n.ctx_idx))})`, "position");
    if (typeof n.influence === "number") row(table, "influence", fmt(n.influence) + " (cumulative; small = important)", "influence");
    if (n.clerp && n.kind !== "logit") row(table, "label", n.clerp, "clerp");
    details.appendChild(table);
    if (n.kind !== "embedding") edgeList("top inputs", n.ins, (l) => l.s, "inputs");
    if (n.kind !== "logit") edgeList("top outputs", n.outs, (l) => l.t, "outputs");
  }
  let hovered = null, pinned = null;
  function hover(n) {
    if (hovered) hovered.el.classList.remove("hover");
    hovered = n;
    if (n) n.el.classList.add("hover");
    show(n || pinned);
  }

  // ---- pinning: the pinned node's paths to the logits (a logit's: the paths into it), over the edges shown
  function pathsOf(n) {
    const visible = (l) => !l.hidden;
    const reach = (start, step) => {   // the nodes reachable from start (itself included) along visible edges
      const seen = new Set([start]);
      const stack = [start];
      while (stack.length) for (const m of step(stack.pop())) if (!seen.has(m)) { seen.add(m); stack.push(m); }
      return seen;
    };
    const down = (m) => m.outs.filter(visible).map((l) => l.t);
    const up = (m) => m.ins.filter(visible).map((l) => l.s);
    let on;
    if (n.kind === "logit") {
      on = reach(n, up);
    } else {
      const below = reach(n, down);
      const toLogits = new Set();
      for (const m of nodes) if (m.kind === "logit" && byId.get(m.node_id) === m) for (const k of reach(m, up)) toLogits.add(k);
      on = new Set([...below].filter((m) => toLogits.has(m)));
      on.add(n);
    }
    const edges = new Set(links.filter((l) => visible(l) && on.has(l.s) && on.has(l.t)));
    return {on, edges};
  }
  function pin(n) {
    if (pinned) pinned.el.classList.remove("pinned");
    pinned = n;
    svg.classList.toggle("pinning", !!n);
    if (n) {
      const {on, edges} = pathsOf(n);
      n.el.classList.add("pinned");
      for (const m of nodes) m.el.classList.toggle("dim", !on.has(m));
      for (const l of links) { l.el.classList.toggle("on-path", edges.has(l)); l.el.classList.toggle("dim", !edges.has(l)); }
      for (const m of on) m.el.classList.add("on-path");
    } else {
      for (const m of nodes) m.el.classList.remove("dim", "on-path");
      for (const l of links) l.el.classList.remove("dim", "on-path");
    }
    show(hovered || pinned);
  }

  // ---- the edge threshold: |weight| >= max|weight| * s^2 for the slider's s in [0, 1]
  const slider = document.getElementById("threshold");
  const counts = document.getElementById("counts");
  function threshold() {
    const s = Number(slider.value);
    const cut = maxAbs * s * s;
    let shown = 0;
    for (const l of links) {
      l.hidden = l.abs < cut;
      l.el.classList.toggle("hidden", l.hidden);
      shown += !l.hidden;
    }
    document.getElementById("threshold-value").textContent = fmt(cut) || "0";
    counts.textContent = `${nodes.length} nodes, ${shown} of ${links.length} edges shown`;
    if (pinned) pin(pinned);
    else show(hovered);
  }
  slider.addEventListener("input", threshold);
  threshold();
  const clicked = (data.qParams || {}).clickedId;
  if (clicked && byId.has(clicked)) pin(byId.get(clicked));

  // for tests and scripts: the state, and the time from this script's start to the first frame drawn
  window.jstdViewer = {nodes, links, byId, maxAbs, pin: (id) => pin(id === null ? null : byId.get(id)), pathsOf};
  requestAnimationFrame(() => setTimeout(() => {
    document.body.dataset.renderMs = (performance.now() - started).toFixed(1);
  }, 0));
})();

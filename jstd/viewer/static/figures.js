"use strict";
// Figures in the viewer's style (jstd.viewer.figures). #page-data holds {title, figures}; a figure is
//   {kind: "attention", title, labels, layers, probs: [layers][heads][query][key]}: one block and head enlarged
//     (query down, key across), every block and head as a thumbnail to pick it; or
//   {kind: "grid", title, rows, columns, values: [rows][columns] (null: no value), text (optional, per cell),
//     center (a diverging scale around it) or null (sequential), value_label}.
// Hovering a cell writes its value into the figure's .readout (with data-value: the number as stored); it keeps
// the last value, and its height is fixed, so nothing moves under the mouse.
(function () {
  const data = JSON.parse(document.getElementById("page-data").textContent);
  document.getElementById("title").textContent = data.title || "";
  const root = document.getElementById("figures");
  const fmt = (x) => (x === null || x === undefined) ? "n/a" : String(Number(Number(x).toPrecision(4)));
  const quoted = (s) => JSON.stringify(String(s));
  const short = (t) => t.length > 12 ? t.slice(0, 11) + "…" : t;
  const make = (tag, cls, parent) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (parent) parent.appendChild(e);
    return e;
  };

  // colour scales: sequential (viridis stops) on [lo, hi]; diverging blue-white-red around `center`
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const mix = (stops, t) => {
    t = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(t)), f = t - i;
    return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
  };
  const DIVERGING = [[33, 102, 172], [247, 247, 247], [178, 24, 43]];
  function scale(values, center) {
    let lo = 0, hi = 0;                                    // (no spread: a large heatmap has too many values)
    for (const v of values.flat(Infinity)) if (v !== null && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (center === null || center === undefined) return (v) => mix(VIRIDIS, hi > lo ? (v - lo) / (hi - lo) : 0);
    const span = Math.max(hi - center, center - lo) || 1;
    return (v) => mix(DIVERGING, 0.5 + (v - center) / (2 * span));
  }

  // one heatmap on a canvas, labelled, with a readout on hover
  function heatmap(parent, values, rowLabels, colLabels, color, cell, describe) {
    const rows = values.length, cols = values[0] ? values[0].length : 0;
    const frame = make("div", "frame", parent);
    const top = make("div", "labels-top", frame);
    const plot = make("div", "plot", frame);
    const left = make("div", "labels-left", plot);
    const canvas = make("canvas", "main", plot);
    canvas.width = cols * cell;
    canvas.height = rows * cell;
    canvas.dataset.cell = cell;
    top.style.width = canvas.width + "px";
    frame.style.width = Math.max(canvas.width, 320) + "px";   // a fixed width: a readout wraps, moving nothing
    const every = Math.max(1, Math.ceil(11 / cell));      // label every n-th row and column where cells are small
    colLabels.forEach((t, j) => {
      if (j % every) return;
      const s = make("span", "", top);
      s.textContent = short(t);
      s.title = t;
      s.style.left = (j + 0.5) * cell + "px";
    });
    rowLabels.forEach((t, i) => {
      if (i % every) return;
      const s = make("div", "", left);
      s.textContent = short(t);
      s.title = t;
      s.style.position = "absolute";
      s.style.right = "0";
      s.style.top = (i + 0.5) * cell - 7 + "px";
    });
    const readout = make("div", "readout", frame);
    const paint = (vals) => {
      const ctx = canvas.getContext("2d");
      ctx.fillStyle = "#ddd";
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      vals.forEach((row, i) => row.forEach((v, j) => {
        if (v === null) return;
        const [r, g, b] = color(v);
        ctx.fillStyle = `rgb(${r},${g},${b})`;
        ctx.fillRect(j * cell, i * cell, cell, cell);
      }));
    };
    let current = values;
    paint(values);
    canvas.addEventListener("mousemove", (e) => {
      const box = canvas.getBoundingClientRect();
      const i = Math.floor((e.clientY - box.top) / cell), j = Math.floor((e.clientX - box.left) / cell);
      if (i < 0 || j < 0 || i >= current.length || j >= current[0].length) return;
      readout.textContent = describe(i, j, current[i][j]);
      readout.dataset.value = String(current[i][j]);
      readout.dataset.cell = i + "," + j;
    });
    return {canvas, readout, repaint: (vals) => { current = vals; paint(vals); }};
  }

  function attention(section, f) {
    const labels = f.labels.map(String);
    const at = (p) => `${p} ${quoted(labels[p] ?? "")}`;
    const color = (v) => mix(VIRIDIS, v);                 // probabilities: 0..1
    const n = labels.length;
    const cell = Math.max(4, Math.min(22, Math.floor(520 / Math.max(n, 1))));
    let block = 0, head = 0;
    const row = make("div", "row", section);
    const main = make("div", "", row);
    const caption = make("div", "hint", main);
    const map = heatmap(main, f.probs[0][0], labels, labels, color, cell, (i, j, v) =>
      `block ${f.layers[block]} head ${head}: query ${at(i)} -> key ${at(j)}: p = ${fmt(v)}`);
    const thumbs = make("div", "thumbs", row);
    const heads = f.probs[0].length;
    thumbs.style.gridTemplateColumns = `repeat(${heads}, auto)`;
    const small = Math.max(1, Math.min(3, Math.floor(96 / Math.max(n, 1))));
    const select = (b, h) => {
      block = b; head = h;
      caption.textContent = `block ${f.layers[b]}, head ${h} (query down, key across)`;
      map.repaint(f.probs[b][h]);
      for (const t of thumbs.children) t.classList.toggle("selected", t.dataset.block == b && t.dataset.head == h);
    };
    f.probs.forEach((block_, b) => block_.forEach((p, h) => {
      const t = make("div", "thumb", thumbs);
      t.dataset.block = b;
      t.dataset.head = h;
      const c = make("canvas", "", t);
      c.width = c.height = n * small;
      const ctx = c.getContext("2d");
      p.forEach((r, i) => r.forEach((v, j) => {
        const [R, G, B] = color(v);
        ctx.fillStyle = `rgb(${R},${G},${B})`;
        ctx.fillRect(j * small, i * small, small, small);
      }));
      make("div", "", t).textContent = `${f.layers[b]}.${h}`;
      t.addEventListener("click", () => select(b, h));
    }));
    select(0, 0);
  }

  function grid(section, f) {
    const color = scale(f.values, f.center);
    const cols = f.values[0] ? f.values[0].length : 0;
    const cell = Math.max(6, Math.min(30, Math.floor(760 / Math.max(cols, 1))));
    const rows = (f.rows || f.values.map((_, i) => i)).map(String);
    const columns = (f.columns || [...Array(cols).keys()]).map(String);
    const main = make("div", "", section);
    heatmap(main, f.values, rows, columns, color, cell, (i, j, v) =>
      `${rows[i]}, ${columns[j]}: ${f.value_label || "value"} ${fmt(v)}` + (f.text ? ` (${f.text[i][j]})` : ""));
    const legend = make("div", "scale", main);
    legend.textContent = f.center === null || f.center === undefined
      ? `${f.value_label || "value"}: sequential scale, dark = low`
      : `${f.value_label || "value"}: blue below ${fmt(f.center)}, red above`;
  }

  for (const f of data.figures) {
    const section = make("section", "figure " + f.kind, root);
    make("h2", "", section).textContent = f.title || "";
    (f.kind === "attention" ? attention : grid)(section, f);
  }
  requestAnimationFrame(() => setTimeout(() => { document.body.dataset.ready = "1"; }, 0));
})();

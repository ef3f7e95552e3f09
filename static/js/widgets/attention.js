// Section 6, "Attention": the real attention weights of one layer for the reader's text. One head
// as a large heatmap, or all heads of the layer as small multiples (grouped by the KV head they
// share); the causal mask drawn as the grey upper triangle; click a query token (a row of the map,
// or a token chip) to see its row as bars. Long texts come back binned into blocks of tokens by
// the server (the reply says bin_size) and the clicked row is then fetched exactly.

import { plot, escapeLabel } from "../lib/chart.js";
import { blend, textOn } from "../lib/color.js";
import { debounce, describeChart, el, field, setState } from "../lib/dom.js";
import { figure, stats, view as viewOf } from "../lib/figures.js";
import { fmtNum, fmtPct, visibleWhitespace } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";
import { mountView, teardown } from "../lib/lifecycle.js";

const DEFAULT_TEXT = "When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat because it was tired.";
const CHIP_LIMIT = 300;        // more tokens than this: no chips, pick the query on the map or by number
const LABEL_LIMIT = 48;        // more rows than this: the axes show positions, not token texts
const HOVER_TEXT_LIMIT = 150;  // more rows than this: hover shows positions only (keeps the page light)
const DENSE_ROW = 200;         // a longer row is drawn as a filled line, not as a bar per key
const COLORS = [[0, "#f7f8fb"], [0.2, "#cfdcf6"], [0.45, "#86a6e8"], [0.7, "#3c67cc"], [1, "#13306f"]];
const MASKED = "#e4e1d9";
const CHIP_BLUE = [47, 95, 208];       // a chip's shade: this blue at an opacity that grows with its weight
const CHIP_UNDER = [252, 252, 251];    // the token box's background, under the shade

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 20000 },
  layer: { type: "int", default: 3, min: 0 },
  head: { type: "int", default: 0, min: 0, choices: ["all"] },
  query: { type: "int", default: null, min: 0 },
};

const shortLabel = (text, n = 10) => {
  const t = visibleWhitespace(text);
  return t.length > n ? `${t.slice(0, n - 1)}…` : t || "∅";
};

// Ragged lower-triangle rows -> a square matrix with null above the diagonal (drawn as masked).
function square(rows) {
  const n = rows.length;
  return rows.map((row) => { const full = row.slice(); while (full.length < n) full.push(null); return full; });
}

// Where the colour scale tops out: the 99th percentile of the weights outside the first row (that
// row is always 1: token 0 sees only itself), so a few large weights do not wash out the rest.
function colourMax(rows) {
  const values = [];
  for (let i = 1; i < rows.length; i += 1) for (const v of rows[i]) values.push(v);
  if (!values.length) return 1;
  values.sort((a, b) => a - b);
  const top = values[Math.floor(0.99 * (values.length - 1))];
  return top > 0 ? top : values[values.length - 1] || 1;
}

// The stat tiles, name: [label, figure key, note, badge], and the empty elements, name: "tag.class".
const TILES = {
  tokens: ["Tokens", "num_tokens", "in your text"], bin: ["Bin size", "bin_size", "tokens per cell (1: exact)", "computed"],
  kv: ["KV head", "kv_head", "whose keys it reads"], max: ["Top weight", "max_weight", "in the chosen row"],
  sink: ["On token 0", "sink_weight", "mean over rows"], prev: ["On previous", "previous_weight", "mean over rows"],
};
const VIEW = {
  mapNode: "div.chart.attn-map", mapNote: "p.note.attn-map-note", rowNode: "div.chart.attn-row",
  rowTitle: "p.attn-row-title", chipsNote: "p.note",
};

function build(opts) {
  const view = {
    textBox: el("textarea", { class: "text-input", rows: 2, name: "text", "aria-label": "Text" }),
    layerSel: el("select", { "aria-label": "Layer", name: "layer" }),
    headSel: el("select", { "aria-label": "Head", name: "head" }),
    queryInput: el("input", { type: "number", min: "0", name: "query", "aria-label": "Query token" }),
    progress: el("p", { class: "progress", "aria-live": "polite" }),
    tiles: viewOf(TILES),
    ...viewOf(VIEW),
    mapTitle: el("h3", { text: "Weights" }),
    chips: el("div", { class: "tokens attn-chips", role: "group", "aria-label": "Tokens: click one to pick the query" }),
  };
  const v = view;
  v.textBox.value = opts.text;
  describeChart(v.mapNode, "Attention weights", v.mapNote);
  describeChart(v.rowNode, "Attention row", v.rowTitle);
  const mapFigure = figure("Attention weights", ["live"], [v.mapNode, v.mapNote]);
  mapFigure.querySelector("h3").replaceWith(v.mapTitle);
  view.nodes = [
    el("div", { class: "attn-input" }, [v.textBox, el("div", { class: "controls" }, [
      field("layer", v.layerSel), field("head", v.headSel), field("query token #", v.queryInput),
    ]), v.progress]),
    stats(Object.values(v.tiles)),
    el("div", { class: "attn-cols" }, [mapFigure, figure("One query's row", ["live"], [v.rowTitle, v.rowNode, v.chips, v.chipsNote])]),
  ];
  return view;
}

// Which of the reply's heads the tiles and the row show.
const focusIndex = (r, focus) => Math.max(0, r.heads.indexOf(focus));

function renderHeadTiles(view, r, focus) {
  const i = focusIndex(r, focus);
  view.tiles.kv.set(r.kv_heads[i], `${r.kv_heads[i]}`);
  view.tiles.sink.set(r.sink_weight[i], fmtPct(r.sink_weight[i]));
  view.tiles.prev.set(r.previous_weight[i], fmtPct(r.previous_weight[i]));
}

// ---- the map: one head, or every head of the layer ----
function traceFor(r, rows, extra = {}) {
  const n = rows.length, b = r.bin_size, T = r.num_tokens;
  const trace = {
    type: "heatmap", z: square(rows), zmin: 0, zmax: colourMax(rows), colorscale: COLORS, hoverongaps: false,
    x0: (b - 1) / 2, dx: b, y0: (b - 1) / 2, dy: b, xgap: 0, ygap: 0, ...extra,
  };
  if (n <= HOVER_TEXT_LIMIT) {
    const label = (i) => (b === 1 ? `#${i} ${escapeLabel(shortLabel(r.tokens[i].text, 14))}` : `#${i * b}–${Math.min(T, (i + 1) * b) - 1}`);
    trace.text = rows.map((_, i) => rows.map((__, j) => `query ${label(i)}<br>key ${label(j)}`));
    trace.hovertemplate = "%{text}<br>weight %{z:.4f}<extra></extra>";
  } else {
    trace.hovertemplate = "query ≈ #%{y:.0f}, key ≈ #%{x:.0f}<br>weight %{z:.4f}<extra></extra>";
  }
  return trace;
}

function axis(r, title, extra = {}) {
  const T = r.num_tokens;
  const ax = { showgrid: false, zeroline: false, range: [-0.5, T - 0.5], fixedrange: false, ...extra };
  if (r.bin_size === 1 && T <= LABEL_LIMIT) {
    ax.tickvals = [...Array(T).keys()];
    ax.ticktext = r.tokens.map((t) => escapeLabel(shortLabel(t.text)));
    ax.tickfont = { size: T > 24 ? 9 : 10, family: "ui-monospace, DejaVu Sans Mono, monospace" };
  } else {
    ax.title = { text: title, font: { size: 11 } };
  }
  return ax;
}

function queryLine(query, T, xref = "x", yref = "y") {
  if (query === null) return [];
  return [{ type: "rect", xref, yref, x0: -0.5, x1: Math.min(T, query + 1) - 0.5, y0: query - 0.5, y1: query + 0.5,
    line: { color: "#d0711b", width: 1.5 }, fillcolor: "rgba(0,0,0,0)" }];
}

function drawSingle(view, r, query) {
  const T = r.num_tokens;
  const labelled = r.bin_size === 1 && T <= LABEL_LIMIT;
  const width = view.mapNode.clientWidth || 560;
  return plot(view.mapNode, [traceFor(r, r.weights[0], { colorbar: { thickness: 10, len: 0.8, title: { text: "weight", side: "right" } } })], {
    height: Math.max(260, Math.min(560, width)),
    plot_bgcolor: MASKED,
    margin: { l: labelled ? 78 : 52, r: 8, t: 8, b: labelled ? 74 : 44 },
    xaxis: axis(r, "key token (position)", { tickangle: labelled ? -60 : 0 }),
    yaxis: axis(r, "query token (position)", { autorange: false, range: [T - 0.5, -0.5] }),
    shapes: queryLine(query, T),
    annotations: [{ xref: "paper", yref: "paper", x: 0.98, y: 0.97, xanchor: "right", yanchor: "top", showarrow: false,
      text: "masked: a token cannot<br>see the tokens after it", font: { size: 11, color: "#6a6f78" } }],
  });
}

function drawAll(view, r, focus, query) {
  const T = r.num_tokens;
  const cols = r.group_size, nrows = Math.ceil(r.heads.length / cols);
  const gapX = 0.03, gapY = 0.07;
  const data = [], layout = { plot_bgcolor: MASKED, annotations: [], shapes: [], margin: { l: 4, r: 4, t: 4, b: 4 } };
  const width = view.mapNode.clientWidth || 560;
  layout.height = Math.round(Math.min(640, Math.max(260, (width / cols) * nrows * 1.05)));
  const narrow = width / cols < 150;  // short panel titles, so neighbours' titles never overlap
  r.heads.forEach((h, i) => {
    const row = Math.floor(i / cols), col = i % cols;
    const suffix = i === 0 ? "" : String(i + 1);
    const x = [col / cols + gapX / 2, (col + 1) / cols - gapX / 2];
    const y = [1 - (row + 1) / nrows + gapY / 2, 1 - row / nrows - gapY];
    data.push(traceFor(r, r.weights[i], { xaxis: `x${suffix}`, yaxis: `y${suffix}`, showscale: false }));
    const hidden = { showticklabels: false, ticks: "", showgrid: false, zeroline: false };
    layout[`xaxis${suffix}`] = { ...hidden, domain: x, range: [-0.5, T - 0.5], anchor: `y${suffix}` };
    layout[`yaxis${suffix}`] = { ...hidden, domain: y, range: [T - 0.5, -0.5], anchor: `x${suffix}` };
    const focused = h === focus;
    layout.annotations.push({ xref: "paper", yref: "paper", x: (x[0] + x[1]) / 2, y: y[1], yanchor: "bottom", showarrow: false,
      text: narrow ? `h${h} · kv${r.kv_heads[i]}` : `head ${h} · KV ${r.kv_heads[i]}`,
      font: { size: narrow ? 10 : 11, color: focused ? "#2f5fd0" : "#1d1f23" } });
    if (focused) {
      layout.shapes.push({ type: "rect", xref: "paper", yref: "paper", x0: x[0] - 0.004, x1: x[1] + 0.004, y0: y[0] - 0.006, y1: y[1] + 0.006,
        line: { color: "#2f5fd0", width: 2 } });
      layout.shapes.push(...queryLine(query, T, `x${suffix}`, `y${suffix}`));
    }
  });
  return plot(view.mapNode, data, layout);
}

// The map (one head or all) with its title and its note, which is also its summary in words.
export async function renderMap(view, r, focus, query) {
  const all = r.head === "all";
  view.mapTitle.textContent = all ? `All ${r.heads.length} heads of layer ${r.layer}` : `Layer ${r.layer}, head ${r.heads[0]}`;
  if (all) await drawAll(view, r, focus, query); else await drawSingle(view, r, query);
  const parts = [];
  if (r.bin_size > 1) {
    parts.push(`${r.num_tokens.toLocaleString()} tokens, drawn in blocks of ${r.bin_size}: each cell is the mean, over the block's queries, of the weight they put on the block's keys, so every row still sums to 1. The row on the right is exact.`);
  }
  parts.push(all
    ? `Rows are queries, columns keys; grey is the causal mask. Each row of ${r.group_size} panels shares one KV head. Each panel has its own colour scale, darkest at its 99th-percentile weight. Click a panel to choose its head, and a row to choose the query.`
    : "Rows are queries, columns the keys they look at; grey is the causal mask. The colour is darkest at the 99th-percentile weight (the scale on the right). Click a row to choose the query; drag to zoom, double-click to zoom out.");
  view.mapNote.textContent = parts.join(" ");
}

// ---- the chosen query's row ----
export async function renderRow(view, r, q, weights, focus) {
  let top = 0;
  weights.forEach((w, j) => { if (w > weights[top]) top = j; });
  view.tiles.max.set(weights[top], fmtNum(weights[top], 3));
  const after = r.num_tokens - q - 1;
  const text = (i) => visibleWhitespace(r.tokens[i].text);
  view.rowTitle.textContent = `Token #${q} "${text(q)}" in head ${focus} (layer ${r.layer}) puts ${fmtPct(weights[top])} of its attention on #${top} "${text(top)}". Its ${q + 1} weight${q ? "s sum to" : " is"} 1${after ? `; the ${after} token${after > 1 ? "s" : ""} after it ${after > 1 ? "are" : "is"} masked` : ""}.`;
  tintChips(view, r, q, weights, top);
  const keys = weights.map((_, j) => j);
  const labelled = keys.length <= 40;
  const hoverText = keys.map((j) => `#${j} ${escapeLabel(shortLabel(r.tokens[j].text, 16))}`);
  const hovertemplate = "%{text}<br>weight %{y:.4f}<extra></extra>";
  // a long row is one filled step line and one marker, not an element per key: the page stays
  // the same weight however long the text
  const traces = keys.length > DENSE_ROW
    ? [{ type: "scatter", mode: "lines", x: keys, y: weights, text: hoverText, hovertemplate, fill: "tozeroy",
      line: { color: "#3c67cc", width: 1, shape: "hvh" }, fillcolor: "rgba(60, 103, 204, 0.35)" },
    { type: "scatter", mode: "markers", x: [top], y: [weights[top]], text: [hoverText[top]], hovertemplate, marker: { color: "#d0711b", size: 8 } }]
    : [{ type: "bar", x: keys, y: weights, text: hoverText, hovertemplate, textposition: "none",
      marker: { color: keys.map((j) => (j === top ? "#d0711b" : "#3c67cc")) } }];
  await plot(view.rowNode, traces, {
    height: 240,
    margin: { l: 44, r: 8, t: 8, b: labelled ? 70 : 40 },
    bargap: 0.15,
    xaxis: labelled
      ? { tickvals: keys, ticktext: keys.map((j) => escapeLabel(shortLabel(r.tokens[j].text))), tickangle: -60, tickfont: { size: 9 } }
      : { title: { text: "key token (position)", font: { size: 11 } } },
    yaxis: { range: [0, Math.min(1, Math.max(0.05, weights[top] * 1.12))], title: { text: "weight", font: { size: 11 } } },
  });
}

// Shade each chip by the weight the query puts on it, its text dark or white, whichever reads.
function tintChips(view, r, q, weights, top) {
  if (r.num_tokens > CHIP_LIMIT) return;
  const peak = weights[top] || 1;
  view.chips.querySelectorAll(".tok").forEach((chip) => {
    const i = Number(chip.dataset.index);
    const w = i < weights.length ? weights[i] : null;
    chip.classList.toggle("selected", i === q);
    chip.classList.toggle("masked", w === null);
    const shade = w === null ? null : blend(CHIP_BLUE, 0.08 + 0.8 * (w / peak), CHIP_UNDER);
    chip.style.background = shade ? `rgb(${shade.join(", ")})` : "";
    chip.style.color = shade ? textOn(shade) : "";
    chip.title = w === null ? `#${i}: after the query, masked` : `#${i} · id ${r.tokens[i].id} · weight ${w.toFixed(4)}`;
  });
}

function renderChips(view, r, onPick) {
  if (r.num_tokens > CHIP_LIMIT) {
    view.chips.hidden = true;
    view.chipsNote.textContent = `The text has ${r.num_tokens.toLocaleString()} tokens: pick the query by clicking a row of the map or by its number above.`;
    return;
  }
  view.chips.hidden = false;
  view.chips.replaceChildren(...tokenChips(r.tokens, { onClick: (tok, i) => onPick(i) }));
  view.chipsNote.textContent = "Click a token to make it the query. Shading: how much weight the query puts on each token; tokens after it are masked.";
}

// The layer and head selects for this model; a reconnect keeps what the reader chose.
function renderSelects(view, hello, opts) {
  const L = hello.num_layers, H = hello.num_heads;
  const layer = view.layerSel.value !== "" ? Number(view.layerSel.value) : opts.layer;
  const head = view.headSel.value !== "" ? view.headSel.value : String(opts.head);
  view.layerSel.replaceChildren(...[...Array(L).keys()].map((i) => el("option", { value: String(i), text: String(i) })));
  view.headSel.replaceChildren(...[...Array(H).keys()].map((i) => el("option", { value: String(i), text: String(i) })),
    el("option", { value: "all", text: `all ${H}` }));
  view.layerSel.value = String(layer < L ? layer : Math.min(OPTIONS.layer.default, L - 1));
  view.headSel.value = head === "all" || Number(head) < H ? head : "0";
  view.queryInput.max = String(hello.limits.max_inspect_tokens - 1);
}

// ---- the widget's behaviour, on w = { root, ctx, view, state, job, rowJob } ----
const headValue = (view) => (view.headSel.value === "all" ? "all" : Number(view.headSel.value));

function syncOptions(w) {
  const v = w.view;
  w.ctx.setOptions({ text: v.textBox.value, layer: Number(v.layerSel.value), head: headValue(v), query: w.state.query }, OPTIONS);
}

const drawMap = (w) => renderMap(w.view, w.state.reply, w.state.focus, w.state.query).then(() => bindClick(w));
const drawRow = (w) => (w.state.row ? renderRow(w.view, w.state.reply, w.state.query, w.state.row, w.state.focus) : Promise.resolve());

// Make token q the query: its row as bars (exact: from the reply, or fetched when binned).
// Resolves once the map and the row are drawn.
function selectQuery(w, q) {
  const { state, view } = w;
  const r = state.reply;
  state.query = Math.max(0, Math.min(r.num_tokens - 1, q));
  view.queryInput.value = String(state.query);
  syncOptions(w);
  w.rowJob.cancel();
  let row;
  if (r.bin_size === 1) {
    state.row = r.weights[focusIndex(r, state.focus)][state.query];
    row = drawRow(w);
  } else {
    view.rowTitle.textContent = `Fetching the exact row of token #${state.query}…`;
    let failure = null;   // the row's error fails the whole selection, as the map's would
    row = w.rowJob.run({ type: "attention_row", ...state.sent, head: state.focus, query: state.query }, {
      quiet: true,
      render: (reply) => { state.row = reply.weights[0]; return drawRow(w); },
      recover: (err) => { failure = err; return true; },
    }).then(() => { if (failure) throw failure; });
  }
  return Promise.all([drawMap(w), row]);
}

const pick = (w, q) => selectQuery(w, q).catch((err) => setState(w.root, "error", err.message));

function onMapClick(w, event) {
  const point = event.points?.[0];
  const r = w.state.reply;
  if (!point || !r) return;
  if (r.head === "all") w.state.focus = r.heads[point.curveNumber] ?? w.state.focus;
  renderHeadTiles(w.view, r, w.state.focus);
  const block = Math.floor(point.y / r.bin_size + 1e-9);   // a cell's y is its block's centre: take the block's last query
  pick(w, Math.min(r.num_tokens - 1, (block + 1) * r.bin_size - 1));
}

function bindClick(w) {
  if (w.state.clickBound || !w.view.mapNode.on) return;   // plotly's emitter exists once there is a plot
  w.view.mapNode.on("plotly_click", (event) => onMapClick(w, event));
  w.state.clickBound = true;
}

// Ask the server for the weights of the chosen layer and head(s), then draw them.
function request(w) {
  const { state, view, root } = w;
  const body = { type: "attention", text: view.textBox.value, layer: Number(view.layerSel.value), head: headValue(view) };
  w.rowJob.cancel();
  root.classList.add("busy");
  syncOptions(w);
  return w.job.run(body, {
    running: "Running the model…",
    onProgress: (p) => `Running the model: ${p.note} (${percent(p)})`,
    render: (reply) => {
      state.sent = { text: body.text, layer: body.layer };
      state.reply = reply;
      if (!reply.heads.includes(state.focus)) state.focus = reply.heads[0];
      view.tiles.tokens.set(reply.num_tokens);
      view.tiles.bin.set(reply.bin_size);
      renderHeadTiles(view, reply, state.focus);
      renderChips(view, reply, (i) => pick(w, i));
      const wanted = state.wantQuery !== null && state.wantQuery < reply.num_tokens ? state.wantQuery : reply.num_tokens - 1;
      state.wantQuery = null;
      root.classList.remove("busy");
      return selectQuery(w, wanted);
    },
  }).finally(() => root.classList.remove("busy"));
}

// The controls' events; returns the function that cancels what is pending.
function listen(w) {
  const { view, state } = w;
  const onText = debounce(() => { state.wantQuery = null; request(w); }, 500);
  view.textBox.addEventListener("input", onText);
  view.layerSel.addEventListener("change", () => { state.wantQuery = state.query; request(w); });
  view.headSel.addEventListener("change", () => {
    if (view.headSel.value !== "all") state.focus = Number(view.headSel.value);
    state.wantQuery = state.query;
    request(w);
  });
  view.queryInput.addEventListener("change", () => {
    if (state.reply && view.queryInput.value !== "") pick(w, Number(view.queryInput.value));
  });
  let lastWidth = 0;  // redraw when the width changes (the charts' height follows from it)
  const failed = (err) => setState(w.root, "error", `Drawing failed: ${err.message}`);
  const observer = new ResizeObserver(debounce(() => {
    if (!state.reply || w.root.clientWidth === lastWidth) return;
    lastWidth = w.root.clientWidth;
    drawMap(w).catch(failed);
    drawRow(w).catch(failed);
  }, 200));
  observer.observe(w.root);
  return () => { onText.cancel(); observer.disconnect(); };
}

export function mount(root, ctx) {
  const { opts, view } = mountView(root, ctx, OPTIONS, build);
  const w = {
    root, ctx, view,
    state: { reply: null, sent: null, focus: 0, query: null, row: null, wantQuery: opts.query, clickBound: false },
    job: jobRunner(root, { client: ctx.client, progress: view.progress }),
    rowJob: jobRunner(root, { client: ctx.client }),
  };
  const unlisten = listen(w);
  const offStatus = ctx.connected((hello) => {
    renderSelects(view, hello, opts);
    if (view.headSel.value !== "all") w.state.focus = Number(view.headSel.value);
    if (w.state.reply) w.state.wantQuery = w.state.query;
    return request(w);
  });
  return teardown(root, [unlisten, w.job.stop, w.rowJob.stop, offStatus], [view.mapNode, view.rowNode]);
}

// Section 6, "Attention": the real attention weights of one layer for the reader's text. One head
// as a large heatmap, or all heads of the layer as small multiples (grouped by the KV head they
// share); the causal mask drawn as the grey upper triangle; click a query token (a row of the map,
// or a token chip) to see its row as bars. Long texts come back binned into blocks of tokens by
// the server (the reply says bin_size) and the clicked row is then fetched exactly.

import { plot, purge, escapeLabel } from "../lib/chart.js";
import { el, field, setState, debounce } from "../lib/dom.js";
import { figure, stat, stats } from "../lib/figures.js";
import { fmtNum, fmtPct, visibleWhitespace } from "../lib/format.js";
import { tokenChips } from "../lib/tokens.js";

const DEFAULT_TEXT = "When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat because it was tired.";
const CHIP_LIMIT = 300;        // more tokens than this: no chips, pick the query on the map or by number
const LABEL_LIMIT = 48;        // more rows than this: the axes show positions, not token texts
const HOVER_TEXT_LIMIT = 150;  // more rows than this: hover shows positions only (keeps the page light)
const COLORS = [[0, "#f7f8fb"], [0.2, "#cfdcf6"], [0.45, "#86a6e8"], [0.7, "#3c67cc"], [1, "#13306f"]];
const MASKED = "#e4e1d9";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const { values: opts } = ctx.readOptions(OPTIONS);
  const state = { info: null, reply: null, sent: null, focus: 0, query: null, row: null, load: null, rowLoad: null,
    wantQuery: opts.query, clickBound: false };
  const failed = (err) => setState(root, "error", `Drawing failed: ${err.message}`);
  const cleanups = [];

  // ---- controls ----
  const textBox = el("textarea", { class: "text-input", rows: 2, name: "text", "aria-label": "Text" });
  textBox.value = opts.text;
  const layerSel = el("select", { "aria-label": "Layer", name: "layer" });
  const headSel = el("select", { "aria-label": "Head", name: "head" });
  const queryInput = el("input", { type: "number", min: "0", name: "query", "aria-label": "Query token" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const controls = el("div", { class: "controls" }, [
    field("layer", layerSel), field("head", headSel), field("query token #", queryInput),
  ]);

  // ---- figures ----
  const tiles = {
    tokens: stat("Tokens", { key: "num_tokens", note: "in your text" }),
    bin: stat("Bin size", { key: "bin_size", note: "tokens per cell (1: exact)", badge: "computed" }),
    kv: stat("KV head", { key: "kv_head", note: "whose keys it reads" }),
    max: stat("Top weight", { key: "max_weight", note: "in the chosen row" }),
    sink: stat("On token 0", { key: "sink_weight", note: "mean over rows" }),
    prev: stat("On previous", { key: "previous_weight", note: "mean over rows" }),
  };
  const mapNode = el("div", { class: "chart attn-map", role: "img", "aria-label": "Attention weights" });
  const mapNote = el("p", { class: "note attn-map-note" });
  const mapTitle = el("h3", { text: "Weights" });
  const rowNode = el("div", { class: "chart attn-row", role: "img", "aria-label": "Attention row" });
  const rowTitle = el("p", { class: "attn-row-title" });
  const chips = el("div", { class: "tokens attn-chips", "aria-label": "Tokens: click one to pick the query" });
  const chipsNote = el("p", { class: "note" });

  const mapFigure = figure("Attention weights", ["live"], [mapNode, mapNote]);
  mapFigure.querySelector("h3").replaceWith(mapTitle);
  root.append(
    el("div", { class: "attn-input" }, [textBox, controls, progress]),
    stats(Object.values(tiles)),
    el("div", { class: "attn-cols" }, [
      mapFigure,
      figure("One query's row", ["live"], [rowTitle, rowNode, chips, chipsNote]),
    ]),
  );

  const syncOptions = () => ctx.setOptions({
    text: textBox.value, layer: Number(layerSel.value),
    head: headSel.value === "all" ? "all" : Number(headSel.value), query: state.query,
  }, OPTIONS);

  // ---- which head's numbers the tiles and the row show ----
  const focusIndex = () => Math.max(0, state.reply.heads.indexOf(state.focus));
  const tokenText = (i) => state.reply.tokens[i].text;

  function headTiles() {
    const r = state.reply;
    const i = focusIndex();
    tiles.kv.set(r.kv_heads[i], `${r.kv_heads[i]}`);
    tiles.sink.set(r.sink_weight[i], fmtPct(r.sink_weight[i]));
    tiles.prev.set(r.previous_weight[i], fmtPct(r.previous_weight[i]));
  }

  // ---- the map: one head, or every head of the layer ----
  function traceFor(rows, b, T, extra = {}) {
    const n = rows.length;
    const trace = {
      type: "heatmap", z: square(rows), zmin: 0, zmax: colourMax(rows), colorscale: COLORS, hoverongaps: false,
      x0: (b - 1) / 2, dx: b, y0: (b - 1) / 2, dy: b, xgap: 0, ygap: 0, ...extra,
    };
    if (n <= HOVER_TEXT_LIMIT) {
      const label = (i) => (b === 1 ? `#${i} ${escapeLabel(shortLabel(tokenText(i), 14))}`
        : `#${i * b}–${Math.min(T, (i + 1) * b) - 1}`);
      trace.text = rows.map((_, i) => rows.map((__, j) => `query ${label(i)}<br>key ${label(j)}`));
      trace.hovertemplate = "%{text}<br>weight %{z:.4f}<extra></extra>";
    } else {
      trace.hovertemplate = "query ≈ #%{y:.0f}, key ≈ #%{x:.0f}<br>weight %{z:.4f}<extra></extra>";
    }
    return trace;
  }

  function axis(T, b, title, extra = {}) {
    const ax = { showgrid: false, zeroline: false, range: [-0.5, T - 0.5], fixedrange: false, ...extra };
    if (b === 1 && T <= LABEL_LIMIT) {
      ax.tickvals = [...Array(T).keys()];
      ax.ticktext = state.reply.tokens.map((t) => escapeLabel(shortLabel(t.text)));
      ax.tickfont = { size: T > 24 ? 9 : 10, family: "ui-monospace, DejaVu Sans Mono, monospace" };
    } else {
      ax.title = { text: title, font: { size: 11 } };
    }
    return ax;
  }

  function queryLine(T, xref = "x", yref = "y") {
    if (state.query === null) return [];
    return [{ type: "rect", xref, yref, x0: -0.5, x1: Math.min(T, state.query + 1) - 0.5, y0: state.query - 0.5, y1: state.query + 0.5,
      line: { color: "#d0711b", width: 1.5 }, fillcolor: "rgba(0,0,0,0)" }];
  }

  async function drawSingle() {
    const r = state.reply;
    const T = r.num_tokens, b = r.bin_size;
    const labelled = b === 1 && T <= LABEL_LIMIT;
    const width = mapNode.clientWidth || 560;
    const height = Math.max(260, Math.min(560, width));
    await plot(mapNode, [traceFor(r.weights[0], b, T, { colorbar: { thickness: 10, len: 0.8, title: { text: "weight", side: "right" } } })], {
      height,
      plot_bgcolor: MASKED,
      margin: { l: labelled ? 78 : 52, r: 8, t: 8, b: labelled ? 74 : 44 },
      xaxis: axis(T, b, "key token (position)", { tickangle: labelled ? -60 : 0 }),
      yaxis: axis(T, b, "query token (position)", { autorange: false, range: [T - 0.5, -0.5] }),
      shapes: queryLine(T),
      annotations: [{ xref: "paper", yref: "paper", x: 0.98, y: 0.97, xanchor: "right", yanchor: "top", showarrow: false,
        text: "masked: a token cannot<br>see the tokens after it", font: { size: 11, color: "#6a6f78" } }],
    });
  }

  async function drawAll() {
    const r = state.reply;
    const T = r.num_tokens, b = r.bin_size;
    const cols = r.group_size, nrows = Math.ceil(r.heads.length / cols);
    const gapX = 0.03, gapY = 0.07;
    const data = [], layout = { plot_bgcolor: MASKED, annotations: [], shapes: [], margin: { l: 4, r: 4, t: 4, b: 4 } };
    const width = mapNode.clientWidth || 560;
    layout.height = Math.round(Math.min(640, Math.max(260, (width / cols) * nrows * 1.05)));
    const narrow = width / cols < 150;  // short panel titles, so neighbours' titles never overlap
    r.heads.forEach((h, i) => {
      const row = Math.floor(i / cols), col = i % cols;
      const suffix = i === 0 ? "" : String(i + 1);
      const x = [col / cols + gapX / 2, (col + 1) / cols - gapX / 2];
      const y = [1 - (row + 1) / nrows + gapY / 2, 1 - row / nrows - gapY];
      data.push(traceFor(r.weights[i], b, T, { xaxis: `x${suffix}`, yaxis: `y${suffix}`, showscale: false }));
      const hidden = { showticklabels: false, ticks: "", showgrid: false, zeroline: false };
      layout[`xaxis${suffix}`] = { ...hidden, domain: x, range: [-0.5, T - 0.5], anchor: `y${suffix}` };
      layout[`yaxis${suffix}`] = { ...hidden, domain: y, range: [T - 0.5, -0.5], anchor: `x${suffix}` };
      const focused = h === state.focus;
      layout.annotations.push({ xref: "paper", yref: "paper", x: (x[0] + x[1]) / 2, y: y[1], yanchor: "bottom", showarrow: false,
        text: narrow ? `h${h} · kv${r.kv_heads[i]}` : `head ${h} · KV ${r.kv_heads[i]}`,
        font: { size: narrow ? 10 : 11, color: focused ? "#2f5fd0" : "#1d1f23" } });
      if (focused) {
        layout.shapes.push({ type: "rect", xref: "paper", yref: "paper", x0: x[0] - 0.004, x1: x[1] + 0.004, y0: y[0] - 0.006, y1: y[1] + 0.006,
          line: { color: "#2f5fd0", width: 2 } });
        layout.shapes.push(...queryLine(T, `x${suffix}`, `y${suffix}`));
      }
    });
    await plot(mapNode, data, layout);
  }

  async function drawMap() {
    const r = state.reply;
    const all = r.head === "all";
    mapTitle.textContent = all ? `All ${r.heads.length} heads of layer ${r.layer}` : `Layer ${r.layer}, head ${r.heads[0]}`;
    if (all) await drawAll(); else await drawSingle();
    if (!state.clickBound && mapNode.on) {  // plotly's event emitter exists once the node has a plot
      mapNode.on("plotly_click", onMapClick);
      state.clickBound = true;
    }
    const parts = [];
    if (r.bin_size > 1) {
      parts.push(`${r.num_tokens.toLocaleString()} tokens, drawn in blocks of ${r.bin_size}: each cell is the mean, over the block's queries, of the weight they put on the block's keys, so every row still sums to 1. The row on the right is exact.`);
    }
    parts.push(all
      ? `Rows are queries, columns keys; grey is the causal mask. Each row of ${r.group_size} panels shares one KV head. Each panel has its own colour scale, darkest at its 99th-percentile weight. Click a panel to choose its head, and a row to choose the query.`
      : "Rows are queries, columns the keys they look at; grey is the causal mask. The colour is darkest at the 99th-percentile weight (the scale on the right). Click a row to choose the query; drag to zoom, double-click to zoom out.");
    mapNote.textContent = parts.join(" ");
  }

  // ---- the chosen query's row ----
  async function drawRow() {
    const r = state.reply, q = state.query, weights = state.row;
    if (!weights) return;
    let top = 0;
    weights.forEach((w, j) => { if (w > weights[top]) top = j; });
    tiles.max.set(weights[top], fmtNum(weights[top], 3));
    const after = r.num_tokens - q - 1;
    rowTitle.textContent = `Token #${q} "${visibleWhitespace(tokenText(q))}" in head ${state.focus} (layer ${r.layer}) puts ${fmtPct(weights[top])} of its attention on #${top} "${visibleWhitespace(tokenText(top))}". Its ${q + 1} weight${q ? "s sum to" : " is"} 1${after ? `; the ${after} token${after > 1 ? "s" : ""} after it ${after > 1 ? "are" : "is"} masked` : ""}.`;
    tintChips(weights, top);
    const keys = weights.map((_, j) => j);
    const labelled = keys.length <= 40;
    await plot(rowNode, [{
      type: "bar", x: keys, y: weights,
      marker: { color: keys.map((j) => (j === top ? "#d0711b" : "#3c67cc")) },
      text: keys.map((j) => `#${j} ${escapeLabel(shortLabel(tokenText(j), 16))}`),
      hovertemplate: "%{text}<br>weight %{y:.4f}<extra></extra>", textposition: "none",
    }], {
      height: 240,
      margin: { l: 44, r: 8, t: 8, b: labelled ? 70 : 40 },
      bargap: keys.length > 200 ? 0 : 0.15,
      xaxis: labelled
        ? { tickvals: keys, ticktext: keys.map((j) => escapeLabel(shortLabel(tokenText(j)))), tickangle: -60, tickfont: { size: 9 } }
        : { title: { text: "key token (position)", font: { size: 11 } } },
      yaxis: { range: [0, Math.min(1, Math.max(0.05, weights[top] * 1.12))], title: { text: "weight", font: { size: 11 } } },
    });
  }

  function tintChips(weights, top) {
    if (state.reply.num_tokens > CHIP_LIMIT) return;
    const peak = weights[top] || 1;
    chips.querySelectorAll(".tok").forEach((chip) => {
      const i = Number(chip.dataset.index);
      const w = i < weights.length ? weights[i] : null;
      chip.classList.toggle("selected", i === state.query);
      chip.classList.toggle("masked", w === null);
      chip.style.background = w === null ? "" : `rgba(47, 95, 208, ${(0.08 + 0.8 * (w / peak)).toFixed(3)})`;
      chip.style.color = w !== null && w / peak > 0.55 ? "#fff" : "";
      chip.title = w === null ? `#${i}: after the query, masked` : `#${i} · id ${state.reply.tokens[i].id} · weight ${w.toFixed(4)}`;
    });
  }

  function drawChips() {
    const r = state.reply;
    if (r.num_tokens > CHIP_LIMIT) {
      chips.hidden = true;
      chipsNote.textContent = `The text has ${r.num_tokens.toLocaleString()} tokens: pick the query by clicking a row of the map or by its number above.`;
      return;
    }
    chips.hidden = false;
    chips.replaceChildren(...tokenChips(r.tokens, { onClick: (tok, i) => pick(i) }));
    chipsNote.textContent = "Click a token to make it the query. Shading: how much weight the query puts on each token; tokens after it are masked.";
  }

  // Make token q the query: its row as bars (exact: from the reply, or fetched when binned).
  // Resolves once the map and the row are drawn.
  function selectQuery(q) {
    const r = state.reply;
    state.query = Math.max(0, Math.min(r.num_tokens - 1, q));
    queryInput.value = String(state.query);
    syncOptions();
    state.rowLoad?.abort();
    let row;
    if (r.bin_size === 1) {
      state.row = r.weights[focusIndex()][state.query];
      row = drawRow();
    } else {
      const load = new AbortController();
      state.rowLoad = load;
      rowTitle.textContent = `Fetching the exact row of token #${state.query}…`;
      row = client.call({ type: "attention_row", ...state.sent, head: state.focus, query: state.query }, { signal: load.signal })
        .then((reply) => {
          if (load.signal.aborted) return null;
          state.row = reply.weights[0];
          return drawRow();
        })
        .catch((err) => { if (err.code !== "aborted") throw err; return null; });
    }
    return Promise.all([drawMap(), row]);
  }
  const pick = (q) => selectQuery(q).catch((err) => setState(root, "error", err.message));

  // ---- asking the server ----
  function request() {
    const headValue = headSel.value === "all" ? "all" : Number(headSel.value);
    const body = { type: "attention", text: textBox.value, layer: Number(layerSel.value), head: headValue };
    state.load?.abort();
    state.rowLoad?.abort();
    const load = new AbortController();
    state.load = load;
    progress.textContent = "Running the model…";
    root.classList.add("busy");
    syncOptions();
    return client.call(body, {
      signal: load.signal,
      onProgress: (p) => { progress.textContent = `Running the model: ${p.note} (${Math.round((100 * p.done) / p.total)}%)`; },
    }).then((reply) => {
      if (load.signal.aborted) return;
      state.sent = { text: body.text, layer: body.layer };
      state.reply = reply;
      if (!reply.heads.includes(state.focus)) state.focus = reply.heads[0];
      tiles.tokens.set(reply.num_tokens);
      tiles.bin.set(reply.bin_size);
      headTiles();
      drawChips();
      const wanted = state.wantQuery !== null && state.wantQuery < reply.num_tokens ? state.wantQuery : reply.num_tokens - 1;
      state.wantQuery = null;
      progress.textContent = "";
      root.classList.remove("busy");
      return selectQuery(wanted).then(() => { if (state.load === load) setState(root, "ready"); });
    }).catch((err) => {
      if (err.code === "aborted" || load.signal.aborted) return;
      progress.textContent = "";
      root.classList.remove("busy");
      setState(root, "error", err.message);
    });
  }

  // ---- events ----
  const onText = debounce(() => { state.wantQuery = null; request(); }, 500);
  textBox.addEventListener("input", onText);
  layerSel.addEventListener("change", () => { state.wantQuery = state.query; request(); });
  headSel.addEventListener("change", () => {
    if (headSel.value !== "all") state.focus = Number(headSel.value);
    state.wantQuery = state.query;
    request();
  });
  queryInput.addEventListener("change", () => {
    if (!state.reply || queryInput.value === "") return;
    pick(Number(queryInput.value));
  });
  function onMapClick(event) {
    const point = event.points?.[0];
    if (!point || !state.reply) return;
    const r = state.reply;
    if (r.head === "all") state.focus = r.heads[point.curveNumber] ?? state.focus;
    headTiles();
    // a cell's y is the centre of its block: take the block's last query
    const block = Math.floor(point.y / r.bin_size + 1e-9);
    pick(Math.min(r.num_tokens - 1, (block + 1) * r.bin_size - 1));
  }

  // ---- start ----
  let lastWidth = 0;  // redraw when the width changes (the charts' height follows from it)
  const observer = new ResizeObserver(debounce(() => {
    const width = root.clientWidth;
    if (!state.reply || width === lastWidth) return;
    lastWidth = width;
    drawMap().catch(failed);
    drawRow().catch(failed);
  }, 200));
  const start = () => client.ready().then((hello) => {
    state.info = hello;
    const L = hello.num_layers, H = hello.num_heads;
    layerSel.replaceChildren(...[...Array(L).keys()].map((i) => el("option", { value: String(i), text: String(i) })));
    headSel.replaceChildren(...[...Array(H).keys()].map((i) => el("option", { value: String(i), text: String(i) })),
      el("option", { value: "all", text: `all ${H}` }));
    layerSel.value = String(opts.layer < L ? opts.layer : Math.min(OPTIONS.layer.default, L - 1));
    headSel.value = opts.head === "all" || opts.head < H ? String(opts.head) : "0";
    if (headSel.value !== "all") state.focus = Number(headSel.value);
    queryInput.max = String(hello.limits.max_inspect_tokens - 1);
    return request();
  });
  start();
  observer.observe(root);
  cleanups.push(client.onStatus((status) => {
    if (status === "closed") setState(root, "error", "The connection to the server was lost; reconnecting…");
    if (status === "open" && root.dataset.state === "error") request();
  }));
  return () => {
    onText.cancel();
    observer.disconnect();
    state.load?.abort();
    state.rowLoad?.abort();
    cleanups.forEach((fn) => fn());
    purge(mapNode);
    purge(rowNode);
    root.replaceChildren();
  };
}

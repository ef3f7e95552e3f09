// Section 4, "Positions": rotary position embedding (RoPE) on the model's real query and key.
// Left: one query vector's dimension pairs drawn as clock hands, before rotation and after it is
// placed at two positions; each pair turns at its own speed, position × θ^(−2i/D).
// Right: the measured check that the attention score of a query and a key depends only on how
// far apart they are: the same two vectors placed at many absolute positions, scored.

import { debounce, describeChart, el, field, keepFocus, select, svg } from "../lib/dom.js";
import { figure, view as viewOf } from "../lib/figures.js";
import { plot } from "../lib/chart.js";
import { fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";
import { teardown } from "../lib/lifecycle.js";

const DEFAULT_TEXT = "The cat sat on the mat because it was tired after the long walk.";

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 4000 },
  layer: { type: "int", default: 3, min: 0 },
  head: { type: "int", default: 0, min: 0 },
  query: { type: "int", default: null, min: 0 },
  key: { type: "int", default: null, min: 0 },
};

const COLORS = { before: "#9aa0a8", near: "#2f5fd0", far: "#d0702f" };

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  theta: ["theta", "theta", "RoPE base"], realOffset: ["Offset", "real_offset", "query − key positions"],
  realScore: ["Score", "real_score", "q·k/√D at their real places"], clocks: "div.clocks", legend: "div.rope-legend",
  maxSpread: ["Max spread", "max_spread", "across positions, same offset"], maxSpreadRel: ["Relative", "max_spread_rel", "spread ÷ largest |score|"],
  offsetRange: ["Offsets vary", "offset_range", "range of scores over offsets"], table: "div.rope-table-wrap",
  chart: "div.chart.rope-chart", tableNote: "p.note",
};

function build(text) {
  const input = el("textarea", { class: "text-input", rows: 2, "aria-label": "Text", name: "text" });
  input.value = text;
  const view = {
    input,
    selects: el("div", { class: "controls" }, [el("span"), el("span"), el("span"), el("span")]),
    progress: el("p", { class: "progress", "aria-live": "polite" }),
    chips: el("div", { class: "rope-tokens", role: "group", "aria-label": "Tokens: the query and the key are marked" }),
    ...viewOf(VIEW),
  };
  const v = view;
  describeChart(v.chart, "Score against offset, one line per absolute position", v.tableNote);
  view.nodes = [
    el("div", { class: "controls" }, [input]), v.selects, v.chips, v.progress,
    el("div", { class: "rope-grid" }, [
      figure("Each pair of numbers is a clock hand", ["live", "computed"], [
        el("p", { class: "note", text: "The query's numbers taken in pairs, each pair drawn as an arrow. RoPE turns every arrow by position × θ^(−2i/D): pair 0 fastest, the last pair slowest." }),
        v.legend, v.clocks,
        el("div", { class: "stats" }, [v.theta.node, v.realOffset.node, v.realScore.node]),
      ]),
      figure("Same distance, same score", ["live"], [
        el("p", { class: "note", text: "The same query and key, rotated as if the key sat at position p and the query offset tokens later. Each row is one offset; across a row only p changes." }),
        v.chart, v.table, v.tableNote,
        el("div", { class: "stats" }, [v.maxSpread.node, v.maxSpreadRel.node, v.offsetRange.node]),
      ]),
    ]),
  ];
  return view;
}

function pairsToShow(half) {
  return [...new Set([0, Math.round(half / 4), Math.round(half / 2), half - 1])];
}

// One dimension pair as a clock: before RoPE, at the near position and at the far one.
function clock(hand) {
  const S = 120, c = S / 2, r = 44;
  const scale = hand.length > 0 ? r / hand.length : 0;
  const arrow = (v, color, dash) => svg("line", {
    x1: c, y1: c, x2: c + v[0] * scale, y2: c - v[1] * scale, stroke: color, "stroke-width": 2.5,
    "stroke-linecap": "round", "stroke-dasharray": dash || "none",
  });
  const tip = (v, color) => svg("circle", { cx: c + v[0] * scale, cy: c - v[1] * scale, r: 3.2, fill: color });
  const drawing = svg("svg", { viewBox: `0 0 ${S} ${S}`, role: "img", "aria-label": `Pair ${hand.pair}` }, [
    svg("circle", { cx: c, cy: c, r, fill: "none", stroke: "#e2e0da" }),
    svg("line", { x1: c - r - 4, x2: c + r + 4, y1: c, y2: c, stroke: "#efede8" }),
    svg("line", { y1: c - r - 4, y2: c + r + 4, x1: c, x2: c, stroke: "#efede8" }),
    arrow(hand.before, COLORS.before, "4 3"), arrow(hand.near.vector, COLORS.near), arrow(hand.far.vector, COLORS.far),
    tip(hand.near.vector, COLORS.near), tip(hand.far.vector, COLORS.far),
  ]);
  const turns = (a) => a / (2 * Math.PI);
  return el("div", { class: "clock" }, [
    drawing,
    el("p", { class: "clock-title", text: `pair ${hand.pair} (dims ${hand.dims[0]}, ${hand.dims[1]})` }),
    el("p", { class: "clock-line", text: `${fmtNum(hand.frequency, 3)} rad per position` }),
    el("p", { class: "clock-line near", text: `at ${hand.near.position}: ${fmtNum(hand.near.angle, 3)} rad` }),
    el("p", { class: "clock-line far", text: `at ${hand.far.position}: ${fmtNum(hand.far.angle, 3)} rad${turns(hand.far.angle) >= 1 ? ` (${fmtNum(turns(hand.far.angle), 3)} turns)` : ""}` }),
  ]);
}

function renderTable(view, r) {
  const head = el("tr", {}, [el("th", { text: "offset" }), ...r.starts.map((p) => el("th", { text: `p=${p.toLocaleString("en-US")}` })), el("th", { text: "spread" })]);
  const rows = r.offsets.map((offset, i) => {
    const mean = r.scores[i].reduce((a, b) => a + b, 0) / r.scores[i].length;
    const cells = r.scores[i].map((s, j) => el("td", {
      text: s.toFixed(5), title: `q at ${r.starts[j] + offset}, k at ${r.starts[j]}: ${s}`,
    }));
    const label = el("span", { "data-figure": `score_offset_${offset}`, "data-value": String(mean), text: String(offset) });
    return el("tr", { class: offset === r.query - r.key ? "real" : "" }, [
      el("th", {}, [label]), ...cells, el("td", { class: "spread", text: r.spread[i].toExponential(1) }),
    ]);
  });
  view.table.replaceChildren(el("table", { class: "rope-table" }, [el("thead", {}, [head]), el("tbody", {}, rows)]));
  view.tableNote.textContent = `Scores are q·k/√${r.head_dim}, the logit softmax sees. Spreads are float32 rounding: the angle `
    + `position × frequency is stored in 32 bits, so near position ${r.starts[r.starts.length - 1].toLocaleString("en-US")} it is off by about 1e-4 of a radian.`;
}

// One line per absolute position p: they lie on top of each other, because only the offset counts.
function renderChart(view, r) {
  const marks = ["circle-open", "square-open", "diamond-open", "x-thin-open"];
  const palette = ["#2f5fd0", "#1d7a4f", "#d0702f", "#8a3f8f"];
  const x = r.offsets.map(String);
  return plot(view.chart, r.starts.map((p, j) => ({
    type: "scatter", mode: "lines+markers", name: `key at ${p.toLocaleString("en-US")}`, x,
    y: r.scores.map((row) => row[j]),
    line: { color: palette[j % palette.length], width: 1.5, dash: j ? "dot" : "solid" },
    marker: { symbol: marks[j % marks.length], size: 6 + 3 * j, color: palette[j % palette.length] },
    hovertemplate: `offset %{x}, key at ${p}: %{y:.5f}<extra></extra>`,
  })), {
    height: 220, showlegend: true, legend: { orientation: "h", y: 1.18, x: 0, font: { size: 10 } },
    margin: { t: 28, b: 36, l: 44 },
    xaxis: { type: "category", title: { text: "offset (query position − key position)", font: { size: 10 } } },
    yaxis: { title: { text: "q·k/√D", font: { size: 10 } } },
  });
}

// The layer, head, query and key selects and the token chips; onPick(name, value) on a change.
// The select that had the focus keeps it across the rebuild.
function renderControls(view, info, s, tokens, onPick) {
  const pickFrom = (name, label, options, value) => {
    const node = select(options, value, { "aria-label": label, name });
    node.addEventListener("change", () => onPick(name, Number(node.value)));
    return field(name, node);
  };
  const group = info.num_heads / info.num_kv_heads;
  const label = (i) => `${i}: ${tokens[i].text.replace(/\s/g, "·").slice(0, 16)}`;
  keepFocus(view.selects, () => view.selects.replaceChildren(
    pickFrom("layer", "Layer", [...Array(info.num_layers).keys()].map((i) => [i, String(i)]), s.layer),
    pickFrom("head", "Head", [...Array(info.num_heads).keys()].map((i) => [i, `${i} (KV ${Math.floor(i / group)})`]), s.head),
    pickFrom("query", "Query token", tokens.map((_, i) => [i, label(i)]), s.query),
    pickFrom("key", "Key token", tokens.slice(0, s.query + 1).map((_, i) => [i, label(i)]), s.key),
  ));
  view.chips.replaceChildren(...tokenChips(tokens, {
    className: (tok, i) => (i === s.query ? "is-query" : i === s.key ? "is-key" : ""),
    title: (tok, i) => `#${i} · id ${tok.id}${i === s.query ? " · query" : i === s.key ? " · key" : ""}`,
  }));
}

export function renderRope(view, r) {
  view.legend.replaceChildren(
    el("span", { class: "key-before", text: "before RoPE (position 0)" }),
    el("span", { class: "key-near", text: `at position ${r.clock.near}` }),
    el("span", { class: "key-far", text: `at position ${r.clock.far}` }),
  );
  view.clocks.replaceChildren(...pairsToShow(r.head_dim / 2).map((i) => clock(r.clock.pairs[i])));
  view.theta.set(r.theta, fmtNum(r.theta));
  view.realOffset.set(r.query - r.key);
  view.realScore.set(r.real_score, fmtNum(r.real_score, 4));
  view.maxSpread.set(r.max_spread, r.max_spread.toExponential(1));
  view.maxSpreadRel.set(r.max_spread_rel, r.max_spread_rel.toExponential(1));
  view.offsetRange.set(r.offset_range, fmtNum(r.offset_range, 3));
  renderTable(view, r);
  return renderChart(view, r);
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { info: null, layer: opts.layer, head: opts.head, query: opts.query, key: opts.key };
  const view = build(opts.text);
  root.append(...view.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: view.progress });

  const syncOptions = () => ctx.setOptions({ text: view.input.value, layer: state.layer, head: state.head, query: state.query, key: state.key }, OPTIONS);
  const onPick = (name, value) => {
    state[name] = value;
    if (name === "query") state.key = Math.min(state.key, state.query);
    run();
  };

  function run() {
    const body = { type: "rope", text: view.input.value, layer: state.layer, head: state.head };
    if (state.query !== null) body.query = state.query;
    if (state.key !== null) body.key = state.key;
    syncOptions();
    return job.run(body, {
      running: "Running your text through the model…",
      onProgress: (p) => `Computing ${p.note}…`,
      render: (r) => {
        state.query = r.query;
        state.key = r.key;
        syncOptions();
        renderControls(view, state.info, state, r.tokens, onPick);
        return renderRope(view, r);
      },
      done: (r) => `Layer ${r.layer}, head ${r.head} (shares KV head ${r.kv_head}): query token ${r.query}, key token ${r.key}.`,
      recover: (err) => {
        if ((err.param !== "query" && err.param !== "key") || (state.query === null && state.key === null)) return false;
        state.query = null;   // a token index from the URL that this text does not have
        state.key = null;
        run();
        return true;
      },
    });
  }

  const onText = debounce(() => { state.query = null; state.key = null; if (view.input.value.trim()) run(); }, 600);
  view.input.addEventListener("input", onText);
  const offStatus = ctx.connected((hello) => {
    state.info = hello;
    if (state.layer >= hello.num_layers) state.layer = Math.min(OPTIONS.layer.default, hello.num_layers - 1);
    if (state.head >= hello.num_heads) state.head = 0;
    return run();
  });
  return teardown(root, [onText.cancel, job.stop, offStatus], [view.chart]);
}

// Section 5, "The transformer block": one block's anatomy (RMSNorm → attention → add → RMSNorm →
// SwiGLU MLP → add), its grouped-query attention drawn from the model's own head counts, and the
// whole stack measured on the reader's text: for every block, the size of the residual stream
// after it, the entropy of attention and the size of the MLP's update, per token.

import { debounce, describeChart, el, field, keepFocus, select, setState, svg } from "../lib/dom.js";
import { escapeLabel, plot } from "../lib/chart.js";
import { figure, view as viewOf } from "../lib/figures.js";
import { fmtNum, visibleWhitespace } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";
import { teardown } from "../lib/lifecycle.js";

const DEFAULT_TEXT = "The old lighthouse keeper climbed the stairs every night to light the lamp.";

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 4000 },
  token: { type: "int", default: null, min: 0 },
  metric: { type: "string", default: "residual_norm", choices: ["residual_norm", "attention_entropy", "mlp_update_norm"] },
};

const METRICS = {
  residual_norm: { label: "residual norm", title: "Size of the residual stream after the block (L2 norm)", color: "#2f5fd0", scale: "Blues", log: true },
  attention_entropy: { label: "attention entropy", title: "Entropy of the token's attention, mean over heads (nats)", color: "#1d7a4f", scale: "Greens", log: false },
  mlp_update_norm: { label: "MLP update", title: "Size of what the MLP adds to the residual stream (L2 norm)", color: "#d0702f", scale: "Oranges", log: true },
};

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  anatomy: "div.anatomy", gqa: "div.gqa", gqaNote: "p.note",
  numLayers: ["Blocks", "num_layers", "in the stack"], embeddingNorm: ["Start", "embedding_norm", "norm of the token's embedding"],
  finalNorm: ["End", "final_residual_norm", "after the last block"],
  maxEntropy: ["Widest attention", "max_entropy_layer", "block with the highest mean entropy"],
  stackNote: "p.note", chart: "div.chart.block-heatmap", chartNote: "p.note",
};

function build(opts) {
  const input = el("textarea", { class: "text-input", rows: 2, "aria-label": "Text", name: "text" });
  input.value = opts.text;
  const view = {
    input,
    tokenBox: el("span"),
    metric: select(Object.entries(METRICS).map(([k, m]) => [k, m.label]), opts.metric, { "aria-label": "Heatmap", name: "metric" }),
    progress: el("p", { class: "progress", "aria-live": "polite" }),
    chips: el("div", { class: "block-tokens", role: "group", "aria-label": "Tokens: click one to follow it" }),
    stack: el("div", { class: "stack", role: "table", "aria-label": "Per-block figures for the followed token" }),
    ...viewOf(VIEW),
  };
  const v = view;
  describeChart(v.chart, "Every block × every token", v.chartNote);
  view.nodes = [
    el("div", { class: "controls" }, [input]),
    el("div", { class: "controls" }, [v.tokenBox, field("heatmap", v.metric)]),
    v.chips,
    v.progress,
    el("div", { class: "block-grid" }, [
      el("div", { class: "col" }, [
        figure("Inside one block", ["live"], [v.anatomy]),
        figure("Grouped-query attention", ["live"], [v.gqa, v.gqaNote]),
      ]),
      el("div", { class: "col col-stack" }, [
        figure("The stack, for your text", ["live"], [
          el("div", { class: "stats" }, [v.numLayers.node, v.embeddingNorm.node, v.finalNorm.node, v.maxEntropy.node]),
          v.stack, v.stackNote,
        ]),
      ]),
    ]),
    figure("Every block × every token", ["live"], [v.chart, v.chartNote]),
  ];
  return view;
}

// ---- the diagrams, from the model's own numbers ----
function drawAnatomy(info) {
  const W = 300, x0 = 34, bx = 96, bw = 190;
  const parts = [svg("line", { x1: x0, x2: x0, y1: 18, y2: 330, stroke: "#2f5fd0", "stroke-width": 3 })];
  parts.push(svg("text", { x: x0 - 12, y: 12, "font-size": 11, fill: "#1d1f23", text: `residual stream in: ${info.hidden_size} numbers per token` }));
  parts.push(svg("text", { x: x0 - 12, y: 346, "font-size": 11, fill: "#1d1f23", text: "residual stream out, to the next block" }));
  const box = (y, h, label, sub, fill) => {
    parts.push(svg("rect", { x: bx, y, width: bw, height: h, rx: 6, fill, stroke: "#c9c6bd" }));
    parts.push(svg("text", { x: bx + 10, y: y + 17, "font-size": 12, "font-weight": 600, fill: "#1d1f23", text: label }));
    if (sub) parts.push(svg("text", { x: bx + 10, y: y + 32, "font-size": 10, fill: "#6a6f78", text: sub }));
  };
  const branch = (yFrom, yTo) => {
    parts.push(svg("path", { d: `M${x0} ${yFrom} H${bx - 8} V${yTo}`, fill: "none", stroke: "#9aa0a8", "stroke-width": 1.5 }));
  };
  const add = (yBox, yPlus) => {
    parts.push(svg("path", { d: `M${bx + bw / 2} ${yBox} V${yPlus} H${x0 + 9}`, fill: "none", stroke: "#9aa0a8", "stroke-width": 1.5 }));
    parts.push(svg("circle", { cx: x0, cy: yPlus, r: 9, fill: "#fff", stroke: "#2f5fd0", "stroke-width": 2 }));
    parts.push(svg("text", { x: x0, y: yPlus + 4.5, "text-anchor": "middle", "font-size": 14, fill: "#2f5fd0", text: "+" }));
  };
  branch(30, 30);
  box(26, 24, "RMSNorm", null, "#f2efe6");
  parts.push(svg("line", { x1: bx + bw / 2, x2: bx + bw / 2, y1: 50, y2: 62, stroke: "#9aa0a8", "stroke-width": 1.5 }));
  box(62, 50, "Attention", `${info.num_heads} query heads, ${info.num_kv_heads} KV heads, RoPE`, "#e8f0ff");
  add(112, 140);
  branch(170, 170);
  box(166, 24, "RMSNorm", null, "#f2efe6");
  parts.push(svg("line", { x1: bx + bw / 2, x2: bx + bw / 2, y1: 190, y2: 202, stroke: "#9aa0a8", "stroke-width": 1.5 }));
  box(202, 50, "SwiGLU MLP", `${info.hidden_size} → ${info.intermediate_size.toLocaleString("en-US")} → ${info.hidden_size}, per token`, "#fdeccf");
  add(252, 290);
  return svg("svg", { viewBox: `0 0 ${W} 352`, role: "img", "aria-label": "The block: RMSNorm, attention, add, RMSNorm, SwiGLU MLP, add" }, parts);
}

function drawGqa(view, info) {
  const H = info.num_heads, K = info.num_kv_heads, group = H / K;
  const W = 320, top = 30, bottom = 112;
  const qx = (i) => 20 + (i + 0.5) * ((W - 40) / H);
  const kx = (j) => 20 + (j + 0.5) * ((W - 40) / K);
  const palette = ["#2f5fd0", "#1d7a4f", "#d0702f", "#8a3f8f", "#9a5b00", "#4b55a8"];
  const parts = [
    svg("text", { x: 20, y: 14, "font-size": 11, fill: "#6a6f78", text: `${H} query heads` }),
    svg("text", { x: 20, y: 150, "font-size": 11, fill: "#6a6f78", text: `${K} key-value heads (stored in the KV cache)` }),
  ];
  for (let i = 0; i < H; i += 1) {
    const j = Math.floor(i / group), color = palette[j % palette.length];
    parts.push(svg("line", { x1: qx(i), y1: top + 10, x2: kx(j), y2: bottom - 12, stroke: color, "stroke-opacity": 0.6, "stroke-width": 1.5 }));
    parts.push(svg("circle", { cx: qx(i), cy: top, r: 10, fill: "#fff", stroke: color, "stroke-width": 2 }, [svg("title", { text: `query head ${i} reads KV head ${j}` })]));
    parts.push(svg("text", { x: qx(i), y: top + 4, "text-anchor": "middle", "font-size": 10, fill: color, text: `q${i}` }));
  }
  for (let j = 0; j < K; j += 1) {
    const color = palette[j % palette.length];
    parts.push(svg("rect", { x: kx(j) - 26, y: bottom - 12, width: 52, height: 24, rx: 5, fill: color, "fill-opacity": 0.12, stroke: color, "stroke-width": 2 }));
    parts.push(svg("text", { x: kx(j), y: bottom + 4, "text-anchor": "middle", "font-size": 10, fill: color, text: `k${j} v${j}` }));
  }
  view.gqaNote.textContent = `Each group of ${group} query heads asks its own questions of the same keys and values, so the KV cache `
    + `stores ${K} heads per layer instead of ${H}: 1/${group} of the memory.`;
  return svg("svg", { viewBox: `0 0 ${W} 158`, role: "img", "aria-label": `${H} query heads sharing ${K} key-value heads` }, parts);
}

// ---- the measurements ----
function renderStack(view, r, t) {
  const cols = ["residual_norm", "attention_entropy", "mlp_update_norm"];
  const max = Object.fromEntries(cols.map((k) => [k, Math.max(...r[k].map((row) => row[t]), 1e-9)]));
  max.residual_norm = Math.max(max.residual_norm, r.embedding_norm[t]);
  const cell = (k, v) => el("div", { class: "cell", role: "cell", title: `${METRICS[k].title}: ${v}` }, [
    el("span", { class: "bar", style: `width:${(100 * v) / max[k]}%;background:${METRICS[k].color}` }),
    el("span", { class: "num", text: fmtNum(v, 3) }),
  ]);
  const header = el("div", { class: "row head", role: "row" }, [
    el("span", { class: "name", text: "" }),
    ...cols.map((k) => el("span", { class: "cell", role: "columnheader", text: METRICS[k].label })),
  ]);
  const embedRow = el("div", { class: "row embed", role: "row" }, [
    el("span", { class: "name", text: "embedding" }), cell("residual_norm", r.embedding_norm[t]),
    el("span", { class: "cell muted", text: "" }), el("span", { class: "cell muted", text: "" }),
  ]);
  const rows = r.residual_norm.map((_, l) => el("div", { class: `row${l === r.max_entropy_layer ? " widest" : ""}`, role: "row" }, [
    el("span", { class: "name", text: `block ${l}` }),
    ...cols.map((k) => cell(k, r[k][l][t])),
  ]));
  view.stack.replaceChildren(header, embedRow, ...rows);
  view.stackNote.textContent = `Token ${t} (${visibleWhitespace(r.tokens[t].text)}), top to bottom through the ${r.num_layers} blocks. `
    + `Its attention entropy can be at most ln(${t + 1}) = ${fmtNum(Math.log(t + 1), 3)} nats: it sees ${t + 1} token${t ? "s" : ""}.`;
}

// The heatmap of one metric, blocks down and tokens across, with its summary in words.
export async function renderHeatmap(view, r, metric) {
  const m = METRICS[metric];
  const labels = r.tokens.map((tok, i) => `${i} ${escapeLabel(visibleWhitespace(tok.text))}`);
  const blocks = r.residual_norm.map((_, l) => `block ${l}`);
  // norms span orders of magnitude (the first token's stream grows far larger than the rest):
  // their colours follow log10, the hover shows the value itself
  const values = r[metric];
  const z = m.log ? values.map((row) => row.map((v) => Math.log10(Math.max(v, 1e-6)))) : values;
  const ticks = m.log ? logTicks(values) : null;
  let top = [0, 0];
  values.forEach((row, l) => row.forEach((v, t) => { if (v > values[top[0]][top[1]]) top = [l, t]; }));
  view.chartNote.textContent = `${m.title}, for each of the ${r.tokens.length} tokens after each of the ${r.num_layers} blocks; `
    + `darker is larger${m.log ? " (colours on a log scale)" : ""}. The largest, ${fmtNum(values[top[0]][top[1]], 4)}, is token ${top[1]} after block ${top[0]}.`;
  await plot(view.chart, [{
    type: "heatmap", z, customdata: values, x: labels, y: blocks, colorscale: m.scale, reversescale: true,
    hovertemplate: `%{y}, token %{x}<br>${escapeLabel(m.label)}: %{customdata:.4g}<extra></extra>`,
    colorbar: { thickness: 10, len: 0.9, ...(ticks ? { tickvals: ticks.map(Math.log10), ticktext: ticks.map(String) } : {}) },
  }], {
    height: Math.max(260, 60 + 13 * r.num_layers),
    margin: { l: 64, b: 70, r: 8 },
    yaxis: { autorange: "reversed", tickfont: { size: 9 } },
    xaxis: { tickangle: -50, tickfont: { size: 9 }, automargin: true },
  });
}

function logTicks(values) {
  const flat = values.flat().filter((v) => v > 0);
  const lo = Math.floor(Math.log10(Math.min(...flat))), hi = Math.ceil(Math.log10(Math.max(...flat)));
  const ticks = [];
  for (let e = lo; e <= hi; e += 1) ticks.push(10 ** e);
  return ticks;
}

// Token t followed: the token select, the chips, the stack and its two tiles. The control that
// had the focus (the select, or a chip) keeps it across the rebuild.
export function renderFollow(view, r, t, onFollow) {
  const tokens = r.tokens;
  keepFocus(view.tokenBox.closest("[data-widget]") || view.chips.parentElement, () => {
    const pick = select(tokens.map((tok, i) => [i, `${i}: ${visibleWhitespace(tok.text).slice(0, 16)}`]), t, { "aria-label": "Token", name: "token" });
    pick.addEventListener("change", () => onFollow(Number(pick.value)));
    view.tokenBox.replaceChildren(field("follow token", pick));
    view.chips.replaceChildren(...tokenChips(tokens, { className: (tok, i) => (i === t ? "is-followed" : ""), onClick: (tok, i) => onFollow(i) }));
  });
  renderStack(view, r, t);
  const last = r.residual_norm[r.num_layers - 1][t];
  view.finalNorm.set(last, fmtNum(last, 4));
  view.embeddingNorm.set(r.embedding_norm[t], fmtNum(r.embedding_norm[t], 3));
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { result: null, token: opts.token, metric: opts.metric };
  const view = build(opts);
  root.append(...view.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: view.progress });
  const syncOptions = () => ctx.setOptions({ text: view.input.value, token: state.token, metric: state.metric }, OPTIONS);

  function follow(t) {
    state.token = t;
    syncOptions();
    renderFollow(view, state.result, t, follow);
  }

  function render(r) {
    state.result = r;
    if (state.token === null || state.token >= r.tokens.length) state.token = r.tokens.length - 1;
    view.numLayers.set(r.num_layers);
    view.maxEntropy.set(r.max_entropy_layer);
    follow(state.token);
    return renderHeatmap(view, r, state.metric);
  }

  function run() {
    syncOptions();
    return job.run({ type: "layers", text: view.input.value }, {
      running: "Running your text through the blocks…",
      onProgress: (p) => `Computing ${p.note}…`,
      render,
      done: (r) => `${r.tokens.length} tokens through ${r.num_layers} blocks. Click a token to follow it.`,
    });
  }

  view.metric.addEventListener("change", () => {
    state.metric = view.metric.value;
    syncOptions();
    if (state.result) renderHeatmap(view, state.result, state.metric).catch((err) => setState(root, "error", err.message));
  });
  const onText = debounce(() => { state.token = null; if (view.input.value.trim()) run(); }, 600);
  view.input.addEventListener("input", onText);

  const offStatus = ctx.connected((hello) => {
    view.anatomy.replaceChildren(drawAnatomy(hello));
    view.gqa.replaceChildren(drawGqa(view, hello));
    return run();
  });
  return teardown(root, [onText.cancel, job.stop, offStatus], [view.chart]);
}

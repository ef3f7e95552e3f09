// Section 19, "Mixture of experts": SmolLM2 with every MLP cut into 16 experts and a trained
// router per layer (smollm2-135m-moe16). The reader's batch of texts goes through the MoE model:
// the first 12 tokens are drawn to the experts their router picked in the chosen layer, the
// histogram counts each expert's tokens over the whole batch, and a chart shows how a global
// batch splits into per-expert batches. The stored perplexity table says what top-k costs in
// quality; the last figure runs the layer with its experts in worker processes (all-to-all).

import { describeChart, el, field, select, setDisabled, svg } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure, view as viewOf } from "../lib/figures.js";
import { fmtMs, fmtNum, visibleWhitespace } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { teardown } from "../lib/lifecycle.js";

const DEFAULT_TEXTS = [
  "The cat sat on the mat and watched the rain run down the window.",
  "def mean(values): return sum(values) / len(values)",
  "In 1969 about 600 million people watched Apollo 11 land on the Moon.",
  "Bonjour, je m'appelle Marie et j'habite à Paris.",
];
const OPTIONS = {
  texts: { type: "string", default: DEFAULT_TEXTS.join("\n"), maxLength: 4000 },
  top_k: { type: "int", default: 2, choices: [1, 2, 4, 8, 16] },
  layer: { type: "int", default: 12, min: 0, max: 255 },
  workers: { type: "int", default: 2, choices: [2, 4] },
};
const MAX_TEXTS = 8;
const PHASES = [["route", "route"], ["dispatch", "dispatch (all-to-all)"], ["compute", "experts compute"],
  ["return", "return (all-to-all)"], ["combine", "combine"]];

const labelled = (node, cls) => { node.classList.add(cls); return node; };
const plural = (n, word) => `${fmtNum(n)} ${word}${n === 1 ? "" : "s"}`;
const color = (e, n) => `hsl(${Math.round((360 * e) / n)}, 62%, 42%)`;

const VIEW = {  // name: a stat tile [label, figure key, note, badge] or an element "tag.class"
  experts: ["Experts per layer", "experts", null, "live"], topKStat: ["Experts per token", "top_k", "the router's top-k", "live"],
  tokens: ["Tokens in the batch", "batch_tokens", null, "live"], pplDense: ["Perplexity, dense", "perplexity_dense", "held-out text", "computed"],
  pplTopK: ["Perplexity, MoE", "perplexity_topk", null, "computed"], alltoall: ["All-to-all per layer", "alltoall_ms", "dispatch + return", "measured"],
  routingNote: "p.note", loadChart: "div.chart.moe-load", loadNote: "p.note", splitChart: "div.chart.moe-split",
  splitNote: "p.note", pplTable: "div.moe-ppl", pplNote: "p.note", sentTable: "div.moe-sent", phaseTable: "div.moe-phases",
  epNote: "p.note", machineLine: "p.note.machine",
};

function build(opts) {
  const view = {
    texts: el("textarea", { name: "texts", rows: 4, class: "text-input moe-texts", "aria-label": "Texts of the batch, one per line" }),
    topK: select(OPTIONS.top_k.choices.map((k) => [k, `top-${k}`]), opts.top_k, { name: "top_k", "aria-label": "Experts per token" }),
    layerSel: select([[opts.layer, `layer ${opts.layer}`]], opts.layer, { name: "layer", "aria-label": "Layer" }),
    workers: select(OPTIONS.workers.choices.map((w) => [w, `${w} processes`]), opts.workers, { name: "workers", "aria-label": "Worker processes" }),
    go: el("button", { type: "button", class: "primary", text: "Route the batch" }),
    again: el("button", { type: "button", text: "Time the exchange again" }),
    progress: el("p", { class: "progress", "aria-live": "polite" }),
    routing: el("div", { class: "moe-routing", role: "img" }),
    ...viewOf(VIEW),
  };
  const v = view;
  v.texts.value = opts.texts;
  describeChart(v.routing, "The first tokens and the experts their router picked", v.routingNote);
  describeChart(v.loadChart, "Tokens per expert over the whole batch", v.loadNote);
  describeChart(v.splitChart, "Per-expert batch against global batch", v.splitNote);
  view.nodes = [
    el("div", { class: "controls moe-controls" }, [
      labelled(field("a batch of texts, one per line (up to 8)", v.texts), "moe-texts-field"),
      el("div", { class: "moe-selects" }, [field("experts per token", v.topK), field("layer", v.layerSel), field("expert parallel", v.workers), v.go, v.again]),
    ]),
    v.progress,
    el("div", { class: "stats" }, [v.experts.node, v.topKStat.node, v.tokens.node, v.pplDense.node, v.pplTopK.node, v.alltoall.node]),
    figure("The first 12 tokens, drawn to their experts", ["live"], [v.routing, v.routingNote]),
    figure("Each expert's load over the whole batch", ["live", "computed"], [v.loadChart, v.loadNote]),
    figure("Per-expert batch against global batch", ["live", "computed"], [v.splitChart, v.splitNote]),
    figure("What top-k costs: perplexity on held-out text", ["computed"], [v.pplTable, v.pplNote]),
    figure("Expert parallelism: the layer across worker processes", ["measured", "live"], [el("div", { class: "moe-ep" }, [v.sentTable, v.phaseTable]), v.epNote, v.machineLine]),
  ];
  return view;
}

// ---- the routing of the first tokens (SVG: tokens left, experts right, a line per choice) ----
function renderRouting(view, r, layer) {
  const L = r.layers[layer], E = r.experts, n = r.tokens.length;
  const rowH = 24, top = 18, height = top + Math.max(n, 1) * rowH + 8;
  const expH = (height - top - 8) / E, xTok = 150, xExp = 430, width = 560;
  const parts = [
    svg("text", { x: 4, y: 12, "font-size": 11, fill: "#6a6f78", text: "token" }),
    svg("text", { x: xExp + 8, y: 12, "font-size": 11, fill: "#6a6f78", text: `expert (layer ${layer})` }),
  ];
  for (let e = 0; e < E; e += 1) {
    const y = top + e * expH;
    parts.push(svg("rect", { x: xExp, y: y + 1, width: 34, height: Math.max(expH - 2, 2), rx: 3, fill: color(e, E), opacity: 0.9 }));
    parts.push(svg("text", { x: xExp + 17, y: y + expH / 2 + 4, "text-anchor": "middle", "font-size": 10, fill: "#fff", text: `E${e}` }));
    parts.push(svg("text", { x: xExp + 40, y: y + expH / 2 + 4, "font-size": 10, fill: "#6a6f78", text: plural(L.load[e], "token") }));
  }
  r.tokens.forEach((tok, i) => {
    const y = top + i * rowH + rowH / 2;
    const label = visibleWhitespace(tok.text);
    parts.push(svg("text", { x: xTok - 8, y: y + 4, "text-anchor": "end", "font-size": 12, "font-family": "ui-monospace, monospace", fill: "#1d1f23",
      text: label.length > 16 ? `${label.slice(0, 15)}…` : label }));
    parts.push(svg("text", { x: 4, y: y + 4, "font-size": 9, fill: "#9aa0a8", text: `t${tok.text_index + 1}` }));
    L.first[i].forEach((e, j) => {
      const p = L.first_probs[i][j];
      parts.push(svg("path", { d: `M${xTok} ${y} C${(xTok + xExp) / 2} ${y}, ${(xTok + xExp) / 2} ${top + (e + 0.5) * expH}, ${xExp} ${top + (e + 0.5) * expH}`,
        fill: "none", stroke: color(e, E), "stroke-width": (1 + 5 * p).toFixed(2), opacity: 0.75 }));
    });
  });
  view.routing.replaceChildren(svg("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%", preserveAspectRatio: "xMinYMin meet" }, parts));
  view.routing.setAttribute("aria-label", `The first ${n} tokens and the ${r.top_k} experts each one's router picked in layer ${layer}`);
  view.routingNote.textContent = `Each token goes to the ${r.top_k} experts its router scored highest (line width: the router's probability). `
    + `Only those ${r.top_k} of ${E} experts run for it: ${fmtNum(r.top_k * r.expert_size)} of the MLP's ${fmtNum(E * r.expert_size)} units. `
    + `t1, t2… say which text of the batch a token comes from. Routers: ${r.routers === "random" ? "random (this model has no trained ones)" : "trained, shipped in toy_models/data/"}.`;
}

async function renderLoad(view, r, layer) {
  const L = r.layers[layer], E = r.experts, even = (r.batch_tokens * r.top_k) / E;
  await plot(view.loadChart, [
    { type: "bar", x: L.load.map((_, e) => `E${e}`), y: L.load, marker: { color: L.load.map((_, e) => color(e, E)) },
      hovertemplate: "%{x}: %{y} tokens<extra></extra>" },
    { type: "scatter", mode: "lines", x: [`E0`, `E${E - 1}`], y: [even, even], line: { color: "#1d1f23", dash: "dash", width: 1 },
      hovertemplate: `even split: ${fmtNum(even)}<extra></extra>` },
  ], { height: 220, margin: { t: 10, b: 36, l: 44 }, yaxis: { title: { text: "tokens", font: { size: 10 } }, rangemode: "tozero" }, bargap: 0.15 });
  const max = Math.max(...L.load), idle = L.load.filter((c) => c === 0).length;
  view.loadNote.textContent = `Layer ${layer}: ${r.batch_tokens} tokens × ${r.top_k} experts = ${r.batch_tokens * r.top_k} token-expert pairs. `
    + `An even split would give each expert ${fmtNum(even)} (dashed line, computed: B·k/E); the busiest got ${max}`
    + `${idle ? `, and ${idle} got none` : ""}. A step takes as long as its busiest expert.`;
}

async function renderSplit(view, r, layer) {
  const s = r.layers[layer].split;
  const top = Math.max(...s.largest), ticks = [];                  // powers of two from B·k/E at B = 1
  for (let t = s.even[0]; t <= top * 1.01; t *= 2) ticks.push(t);
  await plot(view.splitChart, [
    { type: "scatter", mode: "lines+markers", name: "busiest expert (measured)", x: s.sizes, y: s.largest, line: { color: "#b8323f", width: 2 },
      hovertemplate: "batch %{x}: busiest expert %{y:.1f} tokens<extra></extra>" },
    { type: "scatter", mode: "lines+markers", name: "mean over experts used (measured)", x: s.sizes, y: s.mean_active, line: { color: "#2f5fd0", width: 2 },
      text: s.active.map((a) => fmtNum(a)), hovertemplate: "batch %{x}: %{text} experts used, %{y:.1f} tokens each<extra></extra>" },
    { type: "scatter", mode: "lines", name: "B·k/E (computed)", x: s.sizes, y: s.even, line: { color: "#1d1f23", dash: "dash", width: 1 },
      hovertemplate: "batch %{x}: B·k/E = %{y:.2f}<extra></extra>" },
  ], {
    height: 260, showlegend: true, legend: { orientation: "h", y: 1.18, x: 0, font: { size: 10 } }, margin: { t: 30, b: 40, l: 48 },
    xaxis: { type: "log", tickvals: s.sizes, ticktext: s.sizes.map(String), title: { text: "tokens in the global batch (B)", font: { size: 10 } } },
    yaxis: { type: "log", tickvals: ticks, ticktext: ticks.map((t) => fmtNum(t)), title: { text: "tokens per expert", font: { size: 10 } } },
  });
  const last = s.sizes.length - 1;
  view.splitNote.textContent = `Batches of B tokens drawn at random from this batch's routing in layer ${layer} (${fmtNum(16)} draws each). `
    + `With one token only ${r.top_k} experts work, on one row each: the thin products that batching exists to avoid. `
    + `At B = ${s.sizes[last]}, ${fmtNum(s.active[last])} experts are used with ${fmtNum(s.mean_active[last])} tokens each on average, `
    + `against the ${s.sizes[last]} rows a dense MLP would multiply at once.`;
}

function renderTable(view, r) {
  const t = r.table;
  if (!t) {
    view.pplTable.replaceChildren();
    view.pplNote.textContent = `No perplexity table: the ${r.model} model's routers are random, not trained.`;
    return;
  }
  const rows = [["dense", "the dense model", t.perplexity.dense]].concat(
    OPTIONS.top_k.choices.map((k) => [String(k), `top-${k} of ${t.experts}${k === t.experts ? " (every expert)" : ""}`, t.perplexity[String(k)]]));
  view.pplTable.replaceChildren(el("table", { class: "moe-table" }, [
    el("thead", {}, [el("tr", {}, [el("th", { text: "model" }), el("th", { text: "perplexity" })])]),
    el("tbody", {}, rows.map(([key, label, value]) => el("tr", { class: key === String(r.top_k) ? "moe-chosen" : "" }, [
      el("td", { text: label }), el("td", { class: "num", text: fmtNum(value, 4) })]))),
  ]));
  const x = t.text;
  view.pplNote.textContent = `Computed: exp of the mean −log p(token | the tokens before it) over ${fmtNum(t.predicted_tokens)} predicted tokens `
    + `(${x.eval_chunks} pieces of ${x.chunk_tokens}) of held-out text: ${x.source}, ${x.held_out}. The experts and routers were fitted on `
    + `${fmtNum(x.calibration_tokens)} other tokens of the same source. Made by ${t.made_by} at ${t.made_at.slice(0, 16).replace("T", " ")} UTC `
    + `(torch ${t.torch}, ${t.threads} threads, ${fmtNum(t.seconds)} s) and stored with the routers. `
    + "All 16 experts are the dense MLP, so top-16 matches dense. Fewer experts cost quality: these experts were cut out of a model "
    + "trained dense, not trained as experts, and most tokens need more than two of them.";
}

export function renderParallel(view, p) {
  const W = p.workers;
  const head = el("tr", {}, [el("th", { text: "from \\ to" }), ...Array.from({ length: W }, (_, j) => el("th", { text: `rank ${j}` }))]);
  const body = p.sent.map((row, i) => el("tr", {}, [el("th", { text: `rank ${i}` }), ...row.map((n) => el("td", { class: "num", text: String(n) }))]));
  view.sentTable.replaceChildren(el("p", { class: "moe-caption", text: "token rows each rank sent to each rank (dispatch)" }),
    el("table", { class: "moe-table" }, [el("thead", {}, [head]), el("tbody", {}, body)]));
  view.phaseTable.replaceChildren(el("p", { class: "moe-caption", text: `one layer, slowest rank, median of ${p.runs} runs` }),
    el("table", { class: "moe-table" }, [el("tbody", {}, PHASES.map(([key, label]) => el("tr", {}, [
      el("td", { text: label }), el("td", { class: "num", text: fmtMs(p.phase_ms[key]) })])))]));
  view.alltoall.set(p.alltoall_ms, fmtMs(p.alltoall_ms));
  const ranges = p.experts.map(([a, b], i) => `rank ${i} holds E${a}–E${b - 1}`).join(", ");
  view.epNote.textContent = `Layer ${p.layer}, ${p.batch_tokens} tokens, top-${p.top_k}: ${ranges}, and each takes 1/${W} of the tokens. `
    + `Each token row travels to the ranks holding its experts and its results travel back: two all-to-all exchanges, `
    + `${fmtMs(p.alltoall_ms)} together, against ${fmtMs(p.phase_ms.compute)} of expert arithmetic. `
    + `The output equals this layer run in one process (largest difference ${p.max_abs_diff}).`;
  const m = p.machine;
  view.machineLine.textContent = `Measured here: ${W} worker processes with ${p.worker_threads} torch thread each (gloo over loopback), `
    + `on ${m.system} ${m.processor} with ${m.cpu_count} CPU cores, at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}. `
    + "The machine is shared: times move from run to run.";
}

// A routing reply drawn for one layer.
export async function renderRouted(view, r, layer) {
  view.experts.set(r.experts);
  view.topKStat.set(r.top_k);
  view.tokens.set(r.batch_tokens);
  view.pplDense.set(r.perplexity_dense, fmtNum(r.perplexity_dense, 4));
  view.pplTopK.set(r.perplexity_topk, fmtNum(r.perplexity_topk, 4));
  renderRouting(view, r, layer);
  renderTable(view, r);
  await Promise.all([renderLoad(view, r, layer), renderSplit(view, r, layer)]);
}

function setLayers(layerSel, n) {
  const current = Math.min(Number(layerSel.value), n - 1);
  layerSel.replaceChildren(...Array.from({ length: n }, (_, i) => el("option", { value: String(i), text: `layer ${i}` })));
  layerSel.value = String(current);
}

const ROUTERS = { trained: "trained routers", served: "routers (this server runs the MoE model)", random: "random routers" };

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { routed: null, run: 0 };
  const view = build(opts);
  root.append(...view.nodes);
  // both buttons are off while a run goes; "again" is the runner's, "go" follows it
  const job = jobRunner(root, { client: ctx.client, progress: view.progress, button: view.again });

  function values() {
    const list = view.texts.value.split("\n").map((t) => t.trim()).filter(Boolean);
    return { texts: list, top_k: Number(view.topK.value), layer: Number(view.layerSel.value), workers: Number(view.workers.value) };
  }

  // routeToo: the routing job (texts, top_k) then the parallel run; else the parallel run only.
  function update(routeToo) {
    const v = values();
    if (!v.texts.length || v.texts.length > MAX_TEXTS) {
      view.progress.textContent = `Write 1 to ${MAX_TEXTS} texts, one per line.`;
      return Promise.resolve();
    }
    ctx.setOptions({ ...v, texts: v.texts.join("\n") }, OPTIONS);
    setDisabled(view.go, true);
    return job.run(async (call) => {
      const progress = (note) => (p) => `${note}: ${p.note} (${percent(p)})…`;
      if (routeToo || !state.routed) state.routed = await call({ type: "moe", texts: v.texts, top_k: v.top_k }, progress("Routing"));
      await renderRouted(view, state.routed, v.layer);
      view.progress.textContent = "Routed; now running the layer in worker processes…";
      view.alltoall.set(null);
      return call({ type: "moe-parallel", texts: v.texts, top_k: v.top_k, layer: v.layer, workers: v.workers, run: state.run }, progress("Expert parallel"));
    }, {
      loading: true,
      render: (p) => renderParallel(view, p),
      done: (p) => `Routed by the MoE model's ${ROUTERS[state.routed.routers]}; layer ${p.layer} timed in ${p.workers} processes.`,
    }).finally(() => setDisabled(view.go, view.again.disabled));
  }

  view.go.addEventListener("click", () => update(true));
  view.again.addEventListener("click", () => { state.run += 1; update(false); });
  view.topK.addEventListener("change", () => update(true));
  view.layerSel.addEventListener("change", () => update(false));
  view.workers.addEventListener("change", () => update(false));
  const offStatus = ctx.connected((hello) => {
    setLayers(view.layerSel, hello.num_layers);
    return update(!state.routed);
  });
  return teardown(root, [job.stop, offStatus], [view.loadChart, view.splitChart]);
}

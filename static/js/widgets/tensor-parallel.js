// Section 17, "Tensor parallelism": the model split by attention heads and MLP columns across real
// worker processes on this server. Who holds what (each rank's bands of the four weight matrices
// of every block), the measured timeline of each worker over the prompt's forward pass (compute
// and all-reduce, on one clock), compute against communication per layer, how one all-reduce's
// time grows with the batch rows, and the check against the whole model in one process.

import { describeChart, el, field, svg } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtBytes, fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuring, progressLine, view, workersLine } from "../lib/measure.js";

const DEFAULT_TEXT = "The capital of France is Paris, and the capital of Italy is";
const OPTIONS = {
  tp_degree: { type: "int", default: 3, min: 1, max: 4 },
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 1000 },
};
const RANK_COLORS = ["#2f5fd0", "#d0702f", "#1d7a4f", "#8a3f8f"];
const KIND_COLORS = { compute: "#2f5fd0", allreduce: "#e0a030" };

// "query heads 0–2", "KV head 0": a [start, stop) range in words.
function span(what, [a, b]) {
  return b - a === 1 ? `${what} ${a}` : `${what}s ${a}–${b - 1}`;
}

// The rule of core/parallel/tensor_parallel.split_error: whole grouped-query groups on every rank.
function splits(n, H, K) {
  return n >= 1 && (K % n === 0 || (n % K === 0 && H % n === 0));
}

const legend = () => el("div", { class: "legend" }, [
  el("span", {}, [el("span", { class: "swatch", style: { background: KIND_COLORS.compute } }), "compute"]),
  el("span", {}, [el("span", { class: "swatch", style: { background: KIND_COLORS.allreduce } }), "all-reduce (with waiting)"]),
]);

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  compute: ["Compute per layer", "compute_ms_per_layer", "mean of the ranks"],
  allreduce: ["All-reduce per layer", "allreduce_ms_per_layer", "two a layer, with waiting"],
  volume: ["Sent per layer", null, "2 × tokens × hidden × 4 bytes"], timeline: "div.chart.tp-timeline", timelineNote: "p.note",
  split: "div.chart.tp-split", sweep: "div.chart.tp-sweep", sweepNote: "p.note",
  tpDegree: ["Degree", "tp_degree", "worker processes"], perRank: ["Weights a rank holds", null, "of the whole model"],
  shards: "div.tp-shards", shardNote: "p.note", degreeNote: "p.note.tp-degrees",
  maxDiff: ["Largest logit difference", "max_logit_diff", "against one process, every position"],
  same: ["Greedy tokens", null, "against one process"], continuation: "p.tp-continuation", top: "table.tp-top",
  machineLine: "p.note.machine",
};

function build(opts) {
  const v = {
    opts,
    degree: el("select", { name: "tp_degree", "aria-label": "Tensor-parallel degree" }),
    input: el("textarea", { class: "text-input", rows: 2, name: "text", "aria-label": "Prompt" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    filled: false,
    ...view(VIEW),
  };
  v.input.value = opts.text;
  const computeStats = el("div", { class: "stats" }, [v.compute.node, v.allreduce.node, v.volume.node]);
  describeChart(v.timeline, "Each worker's timeline over the prompt", v.timelineNote);
  describeChart(v.split, "Compute against all-reduce, per rank", computeStats);
  describeChart(v.sweep, "One all-reduce against batch rows", v.sweepNote);
  v.nodes = [
    el("div", { class: "controls" }, [field("degree", v.degree), v.again]),
    el("div", { class: "controls" }, [v.input]),
    v.progress,
    el("div", { class: "tp-grid" }, [
      figure("Who holds what, in every block", ["live"], [el("div", { class: "stats" }, [v.tpDegree.node, v.perRank.node]), v.shards, v.shardNote, v.degreeNote]),
      figure("The same answer as one process", ["live"], [el("div", { class: "stats" }, [v.maxDiff.node, v.same.node]), v.continuation, v.top]),
    ]),
    figure("Each worker's timeline over the prompt", ["measured"], [v.timeline, legend(), v.timelineNote, v.machineLine]),
    el("div", { class: "tp-grid" }, [
      figure("Compute against communication", ["measured"], [computeStats, v.split, legend()]),
      figure("One all-reduce against the batch", ["measured"], [v.sweep, v.sweepNote]),
    ]),
  ];
  return v;
}

function fillDegrees(v, hello) {
  const H = hello.num_heads, K = hello.num_kv_heads;
  const wanted = Number(v.opts.tp_degree);
  const valid = [];
  v.degree.replaceChildren();
  for (let n = OPTIONS.tp_degree.min; n <= OPTIONS.tp_degree.max; n += 1) {
    const ok = splits(n, H, K);
    if (ok) valid.push(n);
    v.degree.append(el("option", { value: String(n), disabled: !ok, text: ok ? String(n) : `${n}: refused` }));
  }
  v.degree.value = String(valid.includes(wanted) ? wanted : valid.filter((n) => n <= 3).pop());
  const refused = [2, 3, 4].filter((n) => !splits(n, H, K));
  const copies = [];
  for (let n = K * 2; n <= H; n += K) if (H % n === 0) copies.push(n);
  v.degreeNote.textContent = `${H} query heads read ${K} KV heads in groups of ${H / K}, and a query head must sit on the same rank as `
    + `the KV head it reads. So a degree must divide the ${K} KV heads (each rank then holds whole groups)`
    + (copies.length ? `, or be a multiple of ${K} that divides ${H} (${copies.join(", ")}: each KV head is then copied on several ranks, as Megatron-LM and vLLM do)` : "")
    + `. ${refused.length ? `${refused.length > 1 ? "Degrees" : "Degree"} ${refused.join(" and ")} cannot give every rank the same number of whole groups, so the server refuses ${refused.length > 1 ? "them" : "it"}.` : ""}`;
}

// The four matrices of a block in the x·W layout (rows: inputs, columns: outputs), scaled;
// each band is coloured by the rank that holds it (a copied KV head: striped by its ranks).
function drawShards(r) {
  const s = r.shape, D = s.head_dim, C = s.hidden_size, I = s.intermediate_size, H = s.num_heads, K = s.num_kv_heads;
  const scale = 0.085, gap = 40, top = 46;
  const holders = (i, key) => r.plan.filter((p) => i >= p[key][0] && i < p[key][1]).map((p) => p.rank);
  // runs of consecutive heads held by the same ranks: [{ size, ranks, label }]
  const heads = (count, key, what) => {
    const runs = [];
    for (let i = 0; i < count; i += 1) {
      const ranks = holders(i, key), last = runs[runs.length - 1];
      if (last && last.ranks.join() === ranks.join()) { last.size += D; last.to = i; } else runs.push({ size: D, ranks, from: i, to: i });
    }
    return runs.map((g) => ({ ...g, label: `${what} ${g.from === g.to ? `head ${g.from}` : `heads ${g.from}–${g.to}`}` }));
  };
  const cols = (what) => r.plan.map((p) => ({ size: p.mlp_cols[1] - p.mlp_cols[0], ranks: [p.rank], label: `${what} columns ${p.mlp_cols[0]}–${p.mlp_cols[1] - 1}` }));
  const parts = [];
  let x = 8;
  // A matrix in the x·W layout (rows: its inputs, columns: its outputs), cut along its split
  // axis into segments, each coloured by the rank that holds it (a copied KV head: striped).
  const matrix = (name, other, segments, byColumns, marks = []) => {
    const total = segments.reduce((a, g) => a + g.size, 0);
    const w = (byColumns ? total : other) * scale, h = (byColumns ? other : total) * scale;
    let offset = 0;
    for (const g of segments) {
      const len = g.size * scale, cross = (byColumns ? h : w) / g.ranks.length;
      g.ranks.forEach((rank, j) => {
        const rect = byColumns ? { x: x + offset, y: top + j * cross, width: len, height: cross }
          : { x: x + j * cross, y: top + offset, width: cross, height: len };
        parts.push(svg("rect", { ...rect, class: "shard", fill: RANK_COLORS[rank % RANK_COLORS.length], "fill-opacity": 0.75, stroke: "#fff", "stroke-width": 0.8 },
          [svg("title", { text: `${name}, ${g.label}: rank ${g.ranks.join(" and ")}` })]));
      });
      offset += len;
    }
    parts.push(svg("rect", { x, y: top, width: w, height: h, fill: "none", stroke: "#5f646d", "stroke-width": 1 }));
    for (const [at, label] of marks) {
      parts.push(svg("text", { x: x + at * scale, y: top + h + 11, "text-anchor": "middle", "font-size": 9, fill: "#6a6f78", text: label }));
    }
    parts.push(svg("text", { x, y: top - 30, "font-size": 10.5, "font-weight": 600, fill: "#1d1f23", text: name }));
    parts.push(svg("text", { x, y: top - 18, "font-size": 9, fill: "#6a6f78", text: byColumns ? "split by columns" : "split by rows," }));
    if (!byColumns) parts.push(svg("text", { x, y: top - 7, "font-size": 9, fill: "#6a6f78", text: "then all-reduce" }));
    x += w + gap;
    return h;
  };
  const q = heads(H, "q_heads", "q"), kv = heads(K, "kv_heads", "k"), v = heads(K, "kv_heads", "v");
  const h1 = matrix("qkv_proj", C, [...q, ...kv, ...v], true, [[H * D / 2, "q"], [H * D + K * D / 2, "k"], [H * D + K * D * 1.5, "v"]]);
  const h2 = matrix("o_proj", C, heads(H, "q_heads", "rows of q"), false);
  const h3 = matrix("gate_up_proj", C, [...cols("gate"), ...cols("up")], true, [[I / 2, "gate"], [I * 1.5, "up"]]);
  const h4 = matrix("down_proj", C, cols("rows of"), false);
  const height = top + Math.max(h1 + 14, h2, h3 + 14, h4) + 24;
  r.plan.forEach((p, i) => {
    const lx = 8 + i * 80;
    parts.push(svg("rect", { x: lx, y: height - 14, width: 10, height: 10, fill: RANK_COLORS[i % RANK_COLORS.length], "fill-opacity": 0.75 }));
    parts.push(svg("text", { x: lx + 14, y: height - 5, "font-size": 10, fill: "#1d1f23", text: `rank ${p.rank}` }));
  });
  return svg("svg", { viewBox: `0 0 ${x - gap + 72} ${height}`, role: "img", "aria-label": "Each block's four weight matrices, coloured by the rank that holds each part" }, parts);
}

function timelineTraces(r) {
  const traces = [];
  for (const kind of ["compute", "allreduce"]) {
    const spans = r.ranks.flatMap((rk) => rk.spans.filter((s) => s[2] === kind).map((s) => ({ rank: rk.rank, s })));
    traces.push({
      type: "bar", orientation: "h", name: kind === "compute" ? "compute" : "all-reduce",
      y: spans.map((p) => `rank ${p.rank}`), base: spans.map((p) => p.s[3]), x: spans.map((p) => Math.max(p.s[4] - p.s[3], 0.001)),
      marker: { color: KIND_COLORS[kind] }, width: 0.6,
      customdata: spans.map((p) => [p.s[0] < 0 ? "embedding" : p.s[0] >= r.shape.num_layers ? "final norm" : `layer ${p.s[0]} ${p.s[1]}`, p.s[4] - p.s[3]]),
      hovertemplate: `%{customdata[0]}: ${kind === "compute" ? "compute" : "all-reduce"} %{customdata[1]:.3f} ms<extra>%{y}</extra>`,
    });
  }
  return traces;
}

function renderShards(v, r) {
  const s = r.shape, p0 = r.plan[0];
  v.tpDegree.set(r.tp_degree, String(r.tp_degree));
  v.perRank.set(null, `${(100 * p0.params / r.whole_params).toFixed(0)}%`);
  v.shards.replaceChildren(drawShards(r));
  v.shardNote.textContent = `Rank 0 holds ${span("query head", p0.q_heads)}, ${span("KV head", p0.kv_heads)} and ${span("MLP column", p0.mlp_cols)} `
    + `of every block: ${fmtNum(p0.layer_params)} weights a block. Every rank also holds the embedding table `
    + `(${fmtNum(s.vocab_size)} × ${s.hidden_size}, also the LM head) and the norms: ${fmtNum(p0.replicated_params)} weights, the same on every rank.`;
}

// Model text (the continuation, the top tokens) goes in as text, never as markup.
function renderAnswer(v, r) {
  v.maxDiff.set(r.max_logit_diff, r.max_logit_diff === 0 ? "0 (bit-equal)" : r.max_logit_diff.toExponential(2));
  v.same.set(null, r.tokens_equal ? "identical" : "different");
  v.continuation.textContent = `${r.new_tokens} greedy tokens, each recomputed over the whole sequence by ${r.tp_degree > 1 ? `the ${r.tp_degree} ranks` : "the one process"}: “${r.continuation.replace(/\n/g, "↵")}”. `
    + (r.tp_degree > 1 ? "The all-reduce adds the ranks' partial sums in another order than one process does, so the logits differ in the last digits." : "");
  v.top.replaceChildren(
    el("caption", { text: "The split run's highest logits for the next token" }),
    el("tr", {}, [el("th", { text: "token" }), el("th", { text: "id" }), el("th", { text: "logit" })]),
    ...r.top.map((t) => el("tr", {}, [el("td", { class: "tok-text", text: JSON.stringify(t.text) }), el("td", { text: String(t.token_id) }),
      el("td", { text: t.logit.toFixed(4) })])),
  );
}

function renderTimes(v, r) {
  const m = r.machine, s = r.shape;
  v.machineLine.textContent = workersLine(m, r.tp_degree, "talking",
    `${r.tp_degree} processes share ${m.cpu_count} cores, so they take turns: part of each all-reduce is waiting for a rank that is not running. `);
  v.compute.set(r.compute_ms_per_layer, fmtMs(r.compute_ms_per_layer));
  v.allreduce.set(r.allreduce_ms_per_layer, fmtMs(r.allreduce_ms_per_layer));
  v.volume.set(null, fmtBytes(r.allreduce_bytes_per_layer));
  const total = r.ranks[0].spans.length ? Math.max(...r.ranks.flatMap((rk) => rk.spans.map((x) => x[4]))) : 0;
  v.timelineNote.textContent = `The prompt's ${r.prompt_tokens} tokens through ${s.num_layers} layers, ${fmtMs(total)} from the first rank's start to the last rank's end. `
    + "Each layer: attention on this rank's heads, an all-reduce, the MLP on its columns, another all-reduce. "
    + "Every rank must arrive at an all-reduce before any can leave it, so a rank that computed faster waits there (the times include that wait).";
  const a = r.sweep[0], b = r.sweep[r.sweep.length - 1];
  v.sweepNote.textContent = r.tp_degree === 1
    ? "With one process there is nobody to exchange with: the all-reduce returns at once. Choose degree 3 to see the exchange."
    : `Every layer sends its partial sums twice: rows × ${s.hidden_size} × 4 bytes each time, so the volume grows with the batch. Here ${fmtBytes(a.bytes)} took ${fmtMs(a.ms)} `
      + `and ${fmtBytes(b.bytes)} took ${fmtMs(b.ms)} (median of ${r.sweep_repeats} tries): small messages cost a fixed delay, large ones their bytes.`;
}

async function drawCharts(v, r) {
  await plot(v.timeline, timelineTraces(r), {
    height: 50 + 34 * r.tp_degree, barmode: "overlay", margin: { t: 8, b: 36, l: 52 }, xaxis: { title: { text: "ms since the first rank started", font: { size: 10 } } },
    yaxis: { autorange: "reversed" },
  });
  const ranks = r.ranks.map((rk) => `rank ${rk.rank}`);
  await plot(v.split, [
    { type: "bar", orientation: "h", name: "compute", y: ranks, x: r.ranks.map((rk) => rk.compute_ms_per_layer), marker: { color: KIND_COLORS.compute },
      hovertemplate: "compute %{x:.3f} ms a layer<extra>%{y}</extra>" },
    { type: "bar", orientation: "h", name: "all-reduce", y: ranks, x: r.ranks.map((rk) => rk.allreduce_ms_per_layer), marker: { color: KIND_COLORS.allreduce },
      hovertemplate: "all-reduce %{x:.3f} ms a layer<extra>%{y}</extra>" },
  ], { height: 50 + 30 * r.tp_degree, barmode: "stack", margin: { t: 8, b: 36, l: 52 }, xaxis: { title: { text: "ms per layer", font: { size: 10 } } }, yaxis: { autorange: "reversed" } });
  await plot(v.sweep, [{
    type: "scatter", mode: "lines+markers", x: r.sweep.map((p) => p.rows), y: r.sweep.map((p) => p.ms),
    customdata: r.sweep.map((p) => fmtBytes(p.bytes)), line: { color: KIND_COLORS.allreduce, width: 2 }, marker: { size: 7 },
    hovertemplate: "%{x} rows = %{customdata}: %{y:.3f} ms (median)<extra></extra>",
  }], { height: 220, margin: { t: 8, b: 40, l: 52 },
    xaxis: { type: "log", title: { text: `batch rows (tokens) × ${r.shape.hidden_size} floats`, font: { size: 10 } } },
    yaxis: { type: "log", title: { text: "ms, one all-reduce", font: { size: 10 } } } });
}

async function render(v, r) {
  renderShards(v, r);
  renderAnswer(v, r);
  renderTimes(v, r);
  await drawCharts(v, r);
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const life = measuring(root, ctx, {
    job, button: v.again, changed: [v.degree, v.input], charts: [v.timeline, v.split, v.sweep],
    onHello(hello) {
      if (!v.filled) fillDegrees(v, hello);
      v.filled = true;
    },
    measure(run) {
      const x = { tp_degree: Number(v.degree.value), text: v.input.value };
      if (!x.text.trim()) {
        v.progress.textContent = "Type a prompt first.";
        return Promise.resolve();
      }
      ctx.setOptions(x, OPTIONS);
      return job.run({ type: "tensor-parallel", ...x, run }, {
        running: `Starting ${x.tp_degree} worker process${x.tp_degree > 1 ? "es" : ""}…`,
        onProgress: (p) => `${p.note}…`,
        render: (r) => render(v, r),
        done: (r) => `Measured on ${r.tp_degree} worker process${r.tp_degree > 1 ? "es" : ""}, which have exited.`,
      });
    },
  });
  return life.unmount;
}

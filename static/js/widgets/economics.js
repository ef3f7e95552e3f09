// Section 22, "Why a giant MoE is cheap at scale and dear for one user": the price of a million
// output tokens against the number of concurrent users, for a dense model and a mixture of experts,
// on hardware figures the reader edits. The server computes it (app/widgets/economics.py over
// app/lab/economics.py, a roofline per decode step); this module draws the curves, one decode step
// in detail with every formula beside its number, and the GPUs each preset needs.

import { describeChart, el, field, select } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtBytes, fmtMs, fmtNum, fmtPct } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { DTYPES, PRESETS } from "../lib/kv-shapes.js";
import { measuring, numberInput, progressLine, view } from "../lib/measure.js";

const DENSE = Object.keys(PRESETS).filter((k) => !PRESETS[k].experts);
const MOE = Object.keys(PRESETS).filter((k) => PRESETS[k].experts);

const OPTIONS = {
  price: { type: "number", default: 2.5, min: 0.01, max: 1000 },
  hbm: { type: "number", default: 80, min: 1, max: 1024 },
  bandwidth: { type: "number", default: 3.35, min: 0.01, max: 100 },
  tflops: { type: "number", default: 1979, min: 0.1, max: 100000 },
  link: { type: "number", default: 450, min: 1, max: 10000 },
  network: { type: "number", default: 50, min: 0.1, max: 10000 },
  dtype: { type: "string", default: "fp8", choices: Object.keys(DTYPES) },
  dense: { type: "string", default: "llama-3.1-70b", choices: DENSE },
  moe: { type: "string", default: "deepseek-v3", choices: MOE },
  context: { type: "int", default: 4096, min: 1, max: 131072 },
  batch: { type: "int", default: 64, min: 1, max: 16384 },
};
const HARDWARE = [  // option, label, unit
  ["price", "price", "$ per GPU-hour"], ["hbm", "HBM", "GB a GPU"], ["bandwidth", "bandwidth", "TB/s a GPU"],
  ["tflops", "FLOP/s", "TFLOP/s a GPU"], ["link", "NVLink", "GB/s a GPU"], ["network", "network", "GB/s a GPU"],
];
const COLORS = { dense: "#2f5fd0", moe: "#b8323f" };
const COST_TICKS = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 3000, 10000];

const money = (v) => (v >= 100 ? `$${fmtNum(Math.round(v))}` : `$${fmtNum(v, 3)}`);
const params = (n) => (n >= 1e9 ? `${fmtNum(n / 1e9, 3)}B` : `${fmtNum(n / 1e6, 3)}M`);
const flops = (n) => (n >= 1e12 ? `${fmtNum(n / 1e12, 3)} TFLOP` : `${fmtNum(n / 1e9, 3)} GFLOP`);
const count = (n) => fmtNum(n, 4);

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  chart: "div.chart.econ-chart", chartNote: "p.note", costDense: ["Dense", "cost_per_mtok_dense", "$ per million output tokens"],
  costMoe: ["Mixture of experts", "cost_per_mtok_moe", "$ per million output tokens"], stepHead: "h4.econ-subhead",
  stepNote: "p.note", gpusNeeded: ["GPUs needed", "gpus_needed", "the MoE, weights + KV"], sizingFormula: "p.econ-formula",
  assumptions: "ul.econ-assumptions",
};

function build(opts) {
  const inputs = {};
  for (const [key, label, unit] of HARDWARE) inputs[key] = numberInput(key, `${label}, ${unit}`, opts[key], OPTIONS[key]);
  inputs.dtype = select(Object.keys(DTYPES).map((k) => [k, `${k} (${DTYPES[k]} B)`]), opts.dtype, { name: "dtype", "aria-label": "Weight format" });
  inputs.dense = select(DENSE.map((k) => [k, PRESETS[k].label]), opts.dense, { name: "dense", "aria-label": "Dense model" });
  inputs.moe = select(MOE.map((k) => [k, PRESETS[k].label]), opts.moe, { name: "moe", "aria-label": "Mixture of experts" });
  inputs.context = numberInput("context", "Context, tokens per sequence", opts.context, OPTIONS.context);
  inputs.batch = numberInput("batch", "Concurrent users", opts.batch, OPTIONS.batch);
  const v = {
    inputs,
    progress: progressLine(),
    stepTable: el("div", { class: "econ-step", role: "table", "aria-label": "One decode step, formula by formula" }),
    sizing: el("div", { class: "econ-sizing", role: "table", "aria-label": "GPUs needed by each model" }),
    ...view(VIEW),
  };
  describeChart(v.chart, "Cost per million output tokens against concurrent users", v.chartNote);
  v.nodes = [
    el("div", { class: "controls econ-controls" }, HARDWARE.map(([key, label, unit]) => field(label, inputs[key], unit))),
    el("div", { class: "controls econ-controls" }, [field("weights", inputs.dtype), field("dense", inputs.dense),
      field("MoE", inputs.moe), field("context", inputs.context, "tokens"), field("users", inputs.batch, "concurrent")]),
    v.progress,
    figure("Cost per million output tokens against concurrent users", ["simulated"], [
      v.chart, el("div", { class: "stats" }, [v.costDense.node, v.costMoe.node]), v.chartNote]),
    figure("One decode step, formula by formula", ["computed", "simulated"], [v.stepHead, v.stepTable, v.stepNote]),
    figure("Hardware sizing: GPUs to hold the weights and the KV cache", ["computed"], [
      el("div", { class: "econ-size-head" }, [v.gpusNeeded.node, v.sizingFormula]), v.sizing]),
    figure("Assumed", ["simulated"], [v.assumptions]),
  ];
  return v;
}

function values(inputs) {
  const out = {};
  for (const [key, spec] of Object.entries(OPTIONS)) out[key] = spec.choices ? inputs[key].value : Number(inputs[key].value);
  return out;
}

function invalid(values) {
  for (const [key, spec] of Object.entries(OPTIONS)) {
    if (spec.choices) continue;
    const bad = !Number.isFinite(values[key]) || values[key] < spec.min || values[key] > spec.max || (spec.type === "int" && !Number.isInteger(values[key]));
    if (bad) return `${key} must be ${spec.type === "int" ? "a whole number" : "a number"} from ${fmtNum(spec.min)} to ${fmtNum(spec.max)}.`;
  }
  return null;
}

function trace(r, side) {
  const pts = r.curves[side];
  const m = r.models[side];
  return {
    type: "scatter", mode: "lines+markers", name: `${m.name} (${side === "moe" ? "MoE" : "dense"})`,
    x: pts.map((p) => p.concurrency), y: pts.map((p) => p.cost_per_mtok),
    line: { color: COLORS[side], width: 2 }, marker: { size: 5, color: COLORS[side] },
    customdata: pts.map((p) => [p.gpus, p.replicas, p.stages, p.microbatches, p.tokens_per_s, p.user_tokens_per_s, p.bound]),
    hovertemplate: `${m.name}: %{x} users, $%{y:.3g} per Mtok<br>%{customdata[0]} GPUs (%{customdata[1]} replicas, %{customdata[2]} stages, `
      + "%{customdata[3]} microbatches)<br>%{customdata[4]:,.0f} tok/s in all, %{customdata[5]:.0f} each, %{customdata[6]}-bound<extra></extra>",
  };
}

async function drawChart(v, r) {
  const b = r.inputs.batch, at = r.at_batch;
  const mark = {
    type: "scatter", mode: "markers", name: `${fmtNum(b)} users`, x: [b, b], y: [at.dense.cost_per_mtok, at.moe.cost_per_mtok],
    marker: { size: 11, color: "rgba(0,0,0,0)", line: { color: "#1d1f23", width: 1.5 } }, hoverinfo: "skip",
  };
  const narrow = v.chart.clientWidth < 520;        // the legend wraps: give it room above the plot
  await plot(v.chart, [trace(r, "dense"), trace(r, "moe"), mark], {
    height: narrow ? 340 : 300, showlegend: true, legend: { orientation: "h", yanchor: "bottom", y: 1.02, x: 0, font: { size: 10 } },
    margin: { t: narrow ? 70 : 28, b: 44, l: 58 },
    xaxis: { type: "log", dtick: 1, tickformat: ",~g", title: { text: "concurrent users (sequences decoding together)", font: { size: 10 } } },
    yaxis: { type: "log", tickmode: "array", tickvals: COST_TICKS, tickformat: "$~g", title: { text: "$ per million output tokens", font: { size: 10 } } },
  });
}

// One row of the step table: a quantity, its formula, and each model's value with the formula's numbers.
function row(label, formula, cells) {
  return el("div", { class: "econ-row", role: "row" }, [
    el("div", { class: "econ-what", role: "rowheader" }, [el("strong", { text: label }), el("span", { class: "econ-formula", text: formula })]),
    ...["dense", "moe"].map((side) => {
      const c = cells[side];
      if (!c) return el("div", { class: "econ-cell is-none", role: "cell", text: "—" });
      const value = el("span", { class: "econ-value", text: c.text });
      value.dataset.figure = c.key;
      value.dataset.value = String(c.value);
      return el("div", { class: `econ-cell is-${side}`, role: "cell" }, [value, el("span", { class: "econ-sub", text: c.sub })]);
    }),
  ]);
}

// The step table's rows: each quantity with its formula and both models' numbers.
function stepRows(r) {
  const hw = r.hardware, bpw = DTYPES[r.inputs.dtype], ctxLen = r.inputs.context;
  const s = r.at_batch, m = r.models;
  const each = (fn) => ({ dense: fn("dense", s.dense, m.dense), moe: fn("moe", s.moe, m.moe) });
  const micro = (st) => count(st.micro_seqs);
  return [
    row("GPUs", "replicas × GPUs each; each: ⌈(weights + KV × users ÷ replicas × context) ÷ (HBM × 0.9)⌉, rounded to 1, 2, 4, 8 or whole nodes",
      each((side, st) => ({
        key: `gpus_${side}`, value: st.total_gpus, text: fmtNum(st.total_gpus),
        sub: `${st.replicas} × ${st.gpus} (needs ${st.needed}): ${st.stages} stage${st.stages > 1 ? "s" : ""} × ${st.gpus / st.stages}, ${st.microbatches} microbatch${st.microbatches > 1 ? "es" : ""} of ${micro(st)}`,
      }))),
    row("Weights read", "dense: every weight × bytes; MoE: (always-on + MoE layers × experts touched × one expert) × bytes",
      each((side, st, md) => ({
        key: `weight_bytes_${side}`, value: st.weight_bytes, text: fmtBytes(st.weight_bytes),
        sub: md.is_moe
          ? `(${params(md.always_params)} + ${md.moe_layers} × ${count(st.experts_touched)} × ${params(md.expert_params)}) × ${bpw} B`
          : `${params(md.params)} × ${bpw} B`,
      }))),
    row("Experts touched", "a layer's distinct experts for u tokens: E(1 − (1 − k/E)^u)",
      { moe: { key: "experts_touched", value: s.moe.experts_touched, text: `${count(s.moe.experts_touched)} of ${m.moe.experts}`,
        sub: `${m.moe.experts} × (1 − (1 − ${m.moe.top_k}/${m.moe.experts})^${micro(s.moe)})` } }),
    row("Per-expert batch", "tokens each routed expert sees: u × k / E",
      { moe: { key: "per_expert_batch", value: s.moe.per_expert_batch, text: count(s.moe.per_expert_batch),
        sub: `${micro(s.moe)} × ${m.moe.top_k} / ${m.moe.experts}` } }),
    row("KV read", "u sequences × context × KV bytes per token",
      each((side, st, md) => ({ key: `kv_bytes_${side}`, value: st.kv_bytes, text: fmtBytes(st.kv_bytes),
        sub: `${micro(st)} × ${fmtNum(ctxLen)} × ${fmtBytes(md.kv_bytes_per_token)}` }))),
    row("FLOPs", "u × (2 × active weights + attention FLOPs per cached token × context)",
      each((side, st, md) => ({ key: `flops_${side}`, value: st.flops, text: flops(st.flops),
        sub: `${micro(st)} × (2 × ${params(md.active)} + ${fmtNum(md.attention_flops / 1e6, 3)}M × ${fmtNum(ctxLen)})` }))),
    row("Memory time", "(weights + KV) ÷ stages ÷ (GPUs a stage × bandwidth)",
      each((side, st) => ({ key: `memory_ms_${side}`, value: st.memory_s * 1e3, text: fmtMs(st.memory_s * 1e3),
        sub: `${fmtBytes(st.weight_bytes + st.kv_bytes)} ÷ ${st.stages} ÷ (${st.gpus / st.stages} × ${fmtNum(hw.bandwidth_tb_s)} TB/s)` }))),
    row("Compute time", "FLOPs ÷ stages ÷ (GPUs a stage × FLOP/s)",
      each((side, st) => ({ key: `compute_ms_${side}`, value: st.compute_s * 1e3, text: fmtMs(st.compute_s * 1e3),
        sub: `${flops(st.flops)} ÷ ${st.stages} ÷ (${st.gpus / st.stages} × ${fmtNum(hw.tflops)} TFLOP/s)` }))),
    row("Communication", "layers ÷ stages × 2 all-reduces × (2(g − 1)/g × u × hidden × 2 B ÷ NVLink + latency), + a hand-off between stages",
      each((side, st, md) => ({ key: `comm_ms_${side}`, value: st.comm_s * 1e3, text: fmtMs(st.comm_s * 1e3),
        sub: st.gpus / st.stages === 1 && st.stages === 1 ? "one GPU: nothing to exchange"
          : `${fmtNum(md.layers / st.stages, 3)} × 2 × (${fmtBytes(st.micro_seqs * md.hidden * 2)} over ${st.gpus / st.stages} GPUs + ${fmtNum(hw.latency_us)} µs)` }))),
    row("Pipeline bubble", "idle share with p stages and m microbatches: (p − 1) ÷ (m + p − 1)",
      each((side, st) => ({ key: `bubble_${side}`, value: st.bubble, text: fmtPct(st.bubble, 0),
        sub: `(${st.stages} − 1) ÷ (${st.microbatches} + ${st.stages} − 1)` }))),
    row("Step time", "(m + p − 1) × (max(memory, compute) + communication)",
      each((side, st) => ({ key: `step_ms_${side}`, value: st.step_s * 1e3, text: fmtMs(st.step_s * 1e3),
        sub: `${st.microbatches + st.stages - 1} × (${fmtMs(Math.max(st.memory_s, st.compute_s) * 1e3)} + ${fmtMs(st.comm_s * 1e3)}), ${st.bound}-bound` }))),
    row("Tokens per second", "users ÷ step time (each user: 1 ÷ step time)",
      each((side, st) => ({ key: `tokens_per_s_${side}`, value: st.tokens_per_s, text: fmtNum(st.tokens_per_s, 4),
        sub: `${fmtNum(st.concurrency)} ÷ ${fmtMs(st.step_s * 1e3)}; ${fmtNum(st.user_tokens_per_s, 3)} tok/s each` }))),
    row("Cost per million tokens", "GPUs × price ÷ (tokens per second × 3600) × 10⁶",
      each((side, st) => ({ key: `cost_${side}`, value: st.cost_per_mtok, text: money(st.cost_per_mtok),
        sub: `${st.total_gpus} × $${fmtNum(hw.price_per_hour)} ÷ (${fmtNum(st.tokens_per_s, 4)} × 3600) × 10⁶` }))),
  ];
}

function renderStep(v, r) {
  const bpw = DTYPES[r.inputs.dtype], m = r.models, e = r.at_batch.moe, s = r.at_batch;
  const micro = (st) => count(st.micro_seqs);
  v.stepHead.textContent = `At ${fmtNum(r.inputs.batch)} concurrent users, ${fmtNum(r.inputs.context)} tokens of context each, ${r.inputs.dtype} weights: `
    + `${m.dense.name} against ${m.moe.name}.`;
  const rows = stepRows(r);
  v.stepTable.replaceChildren(
    el("div", { class: "econ-row econ-head", role: "row" }, [el("span", { role: "columnheader", text: "u = users in one microbatch" }),
      el("span", { role: "columnheader", class: "is-dense", text: m.dense.name }), el("span", { role: "columnheader", class: "is-moe", text: m.moe.name })]),
    ...rows);
  v.stepNote.textContent = `${m.moe.name} reads ${fmtBytes(e.weight_bytes)} of its ${fmtBytes(m.moe.params * bpw)} of weights for ${micro(e)} tokens: `
    + `${count(e.experts_touched)} of ${m.moe.experts} experts a layer, each seeing ${count(e.per_expert_batch)} tokens. `
    + `Its weights need ${e.gpus} GPUs, paid for whether the users keep them busy or not; ${m.dense.name} fits on ${s.dense.gpus}.`;
}

function renderSizing(v, r) {
  const hw = r.hardware, moe = r.sizing.find((x) => x.preset === r.inputs.moe);
  v.gpusNeeded.set(r.gpus_needed, fmtNum(r.gpus_needed));
  v.sizingFormula.textContent = `${moe.label}: ⌈(weights + KV per token × users × context) ÷ (HBM × ${hw.usable_hbm})⌉ = `
    + `⌈(${fmtBytes(moe.weight_bytes)} + ${fmtBytes(moe.kv_bytes_per_token)} × ${fmtNum(r.inputs.batch)} × ${fmtNum(r.inputs.context)}) ÷ `
    + `(${fmtNum(hw.hbm_gb)} GB × ${hw.usable_hbm})⌉ = ⌈${fmtBytes(moe.weight_bytes + moe.kv_bytes)} ÷ ${fmtBytes(hw.hbm_gb * 1e9 * hw.usable_hbm)}⌉ = ${r.gpus_needed}`;
  const most = Math.max(...r.sizing.map((x) => x.weight_bytes + x.kv_bytes));
  v.sizing.replaceChildren(
    el("div", { class: "econ-size-row econ-head", role: "row" }, ["model", "weights and KV", "GPUs"].map((t) => el("span", { role: "columnheader", text: t }))),
    ...r.sizing.map((x) => {
      const gpus = el("span", { class: "econ-size-gpus", role: "cell", text: fmtNum(x.gpus_needed) });
      gpus.dataset.figure = `gpus_needed_${x.preset}`;
      gpus.dataset.value = String(x.gpus_needed);
      const w = (100 * x.weight_bytes) / most, k = (100 * x.kv_bytes) / most;
      return el("div", { class: "econ-size-row", role: "row" }, [
        el("span", { class: "econ-size-name", role: "cell" }, [el("strong", { text: x.label }),
          el("span", { class: "econ-sub", text: `${fmtBytes(x.weight_bytes)} weights + ${fmtBytes(x.kv_bytes)} KV${x.beyond_window ? `; beyond its ${fmtNum(x.window)}-token window` : ""}` })]),
        el("span", { class: "econ-bar", role: "cell" }, [el("span", { class: "econ-fill is-weights", style: { width: `${w}%` } }),
          el("span", { class: "econ-fill is-kv", style: { width: `${k}%` } })]),
        gpus,
      ]);
    }));
}

async function render(v, r) {
  const hw = r.hardware, d = r.curves.dense, e = r.curves.moe;
  v.costDense.set(r.cost_per_mtok_dense, money(r.cost_per_mtok_dense));
  v.costMoe.set(r.cost_per_mtok_moe, money(r.cost_per_mtok_moe));
  for (const [tile, side] of [[v.costDense, "dense"], [v.costMoe, "moe"]]) {
    tile.node.querySelector(".stat-label").textContent = `${r.models[side].name}, ${fmtNum(r.inputs.batch)} users`;
  }
  const lo = (pts) => pts.reduce((a, p) => (p.cost_per_mtok < a.cost_per_mtok ? p : a));
  v.chartNote.textContent = `For one user ${r.models.dense.name} costs ${money(d[0].cost_per_mtok)} per million tokens on ${d[0].gpus} GPU${d[0].gpus > 1 ? "s" : ""} `
    + `and ${r.models.moe.name} ${money(e[0].cost_per_mtok)} on ${e[0].gpus}. The cheapest points: ${money(lo(d).cost_per_mtok)} at ${fmtNum(lo(d).concurrency)} users `
    + `and ${money(lo(e).cost_per_mtok)} at ${fmtNum(lo(e).concurrency)}. Each point is the cheapest deployment for that many users (hover for it); `
    + `the circles mark ${fmtNum(r.inputs.batch)} users, the step taken apart below.`;
  renderStep(v, r);
  renderSizing(v, r);
  v.assumptions.replaceChildren(
    el("li", { text: `Hardware: $${fmtNum(hw.price_per_hour)} per GPU-hour, ${fmtNum(hw.hbm_gb)} GB of HBM (${fmtPct(hw.usable_hbm, 0)} usable), `
      + `${fmtNum(hw.bandwidth_tb_s)} TB/s, ${fmtNum(hw.tflops)} TFLOP/s, NVLink ${fmtNum(hw.link_gb_s)} GB/s and network ${fmtNum(hw.network_gb_s)} GB/s a GPU, `
      + `${hw.gpus_per_node} GPUs a node, ${fmtNum(hw.latency_us)} µs a collective. The defaults are an H100 SXM-like GPU (datasheet figures, fp8) at an assumed cloud price.` }),
    el("li", { text: `Shapes from the public configs: ${r.models.moe.name} ${params(r.models.moe.params)} weights, ${params(r.models.moe.active)} active, `
      + `${r.models.moe.experts} routed experts of ${params(r.models.moe.expert_params)}, top-${r.models.moe.top_k}, ${r.models.moe.moe_layers} MoE layers of ${r.models.moe.layers}; `
      + `${r.models.dense.name} ${params(r.models.dense.params)}. KV cache in ${r.kv_dtype}.` }),
    ...r.assumptions.map((a) => el("li", { text: a })),
  );
  await drawChart(v, r);
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress });
  const life = measuring(root, ctx, {
    job, delay: 300, charts: [v.chart], typed: Object.values(v.inputs),   // a select fires "input" too
    measure() {
      const request = values(v.inputs);
      const problem = invalid(request);
      if (problem) { v.progress.textContent = problem; return Promise.resolve(); }
      ctx.setOptions(request, OPTIONS);
      return job.run({ type: "economics", ...request }, {
        running: "Computing both curves…",
        onProgress: (p) => `Computing: ${p.note} (${percent(p)})…`,
        render: (r) => render(v, r),
      });
    },
  });
  return life.unmount;
}

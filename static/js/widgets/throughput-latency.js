// Section 13, "Throughput against latency": the real engine (an engine beside the serving one)
// under Poisson load at the arrival rates and batch limits the reader picks. Each run is one
// point: output tokens/s against TTFT and TPOT (p50 and p99, as vLLM's serving benchmark defines
// them); the runs with one batch limit form a curve. Every run is a cached job on the server.

import { describeChart, el, field, scrollBox } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuredAt, measuring, progressLine, threadsOn, view } from "../lib/measure.js";

const MAX_RATES = 4, MAX_LIMITS = 3, MIN_RATE = 0.5, MAX_RATE = 100, MAX_SEQS = 32, MAX_REQUESTS = 32;
const COLORS = ["#2f5fd0", "#d0702f", "#2f9a5f"];

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  rates: { type: "string", default: "1,4,16", maxLength: 60 },
  max_num_seqs: { type: "string", default: "1,8", maxLength: 30 },
  num_requests: { type: "int", default: 12, min: 2, max: MAX_REQUESTS },
};

// "1,4,16" -> [1, 4, 16], or a message saying what is wrong.
function parseList(text, { name, max, lo, hi, integer }) {
  const parts = text.split(",").map((s) => s.trim()).filter(Boolean);
  if (parts.length < 1 || parts.length > max) return { error: `${name}: give 1 to ${max} values, comma-separated.` };
  const values = parts.map(Number);
  if (values.some((v) => !Number.isFinite(v) || v < lo || v > hi || (integer && !Number.isInteger(v)))) {
    return { error: `${name}: each value must be ${integer ? "a whole number " : ""}from ${lo} to ${hi}.` };
  }
  return { values: [...new Set(values)].sort((a, b) => a - b) };
}

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  ttftChart: "div.chart.tl-chart", table: "table.tl-table", tpotChart: "div.chart.tl-chart", machineLine: "p.note.machine",
  throughput: ["Output throughput", "throughput_tok_s", "tokens/s, busiest run"], ttft: ["TTFT p99", "ttft_p99_ms", "same run"],
  tpot: ["TPOT p99", "tpot_p99_ms", "same run"], headline: "p.note",
};

function build(opts) {
  const v = {
    rates: el("input", { type: "text", class: "text-input", name: "rates", value: opts.rates, "aria-label": "Arrival rates, requests per second" }),
    limits: el("input", { type: "text", class: "text-input tl-short", name: "max_num_seqs", value: opts.max_num_seqs, "aria-label": "Batch limits (max_num_seqs)" }),
    count: el("input", { type: "number", min: 2, max: MAX_REQUESTS, step: 1, name: "num_requests", value: String(opts.num_requests), "aria-label": "Requests per run" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    points: [],
    ...view(VIEW),
  };
  // the table below holds every point of both charts in words
  describeChart(v.ttftChart, "TTFT against output throughput", v.table);
  describeChart(v.tpotChart, "TPOT against output throughput", v.table);
  v.nodes = [
    el("div", { class: "controls" }, [
      field("arrival rates (req/s)", v.rates), field("batch limits", v.limits), field("requests", v.count), v.again,
    ]),
    v.progress, v.machineLine,
    figure("The busiest run", ["measured"], [el("div", { class: "stats" }, [v.throughput.node, v.ttft.node, v.tpot.node]), v.headline]),
    el("div", { class: "tl-grid" }, [
      figure("Time to first token against throughput", ["measured"], [v.ttftChart]),
      figure("Time per output token against throughput", ["measured"], [v.tpotChart]),
    ]),
    figure("Every run", ["measured"], [scrollBox(el("div", { class: "tl-scroll" }, [v.table]), "Every run, scrollable")]),
  ];
  return v;
}

function curves(points, metric) {
  const limitsSeen = [...new Set(points.map((p) => p.max_num_seqs))].sort((a, b) => a - b);
  return limitsSeen.flatMap((seqs, i) => {
    const pts = points.filter((p) => p.max_num_seqs === seqs).sort((a, b) => a.rate - b.rate);
    const x = pts.map((p) => p.throughput_tok_s);
    const text = pts.map((p) => `${p.rate} req/s`);
    const color = COLORS[i % COLORS.length];
    return ["p99", "p50"].map((q) => ({
      type: "scatter", mode: "lines+markers", name: `max_num_seqs ${seqs}, ${q}`, x, text,
      y: pts.map((p) => p[`${metric}_${q}_ms`]),
      line: { color, width: 2, dash: q === "p50" ? "dot" : "solid" }, marker: { size: q === "p50" ? 5 : 8, color },
      hovertemplate: `%{text}: %{x:.1f} tok/s, ${q} %{y:.0f} ms<extra>max_num_seqs ${seqs}</extra>`,
    }));
  });
}

function chart(node, points, metric, label) {
  return plot(node, curves(points, metric), {
    height: 260, showlegend: true, legend: { orientation: "h", y: -0.3, x: 0, font: { size: 10 } }, margin: { t: 8, b: 80, l: 56 },
    xaxis: { title: { text: "output throughput (tokens/s)", font: { size: 10 } }, rangemode: "tozero" },
    yaxis: { title: { text: `${label} (ms)`, font: { size: 10 } }, rangemode: "tozero" },
  });
}

function renderTable(v) {
  const head = el("tr", {}, ["rate (req/s)", "max_num_seqs", "tokens/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "steps"]
    .map((t) => el("th", { text: t })));
  const rows = [...v.points].sort((a, b) => a.max_num_seqs - b.max_num_seqs || a.rate - b.rate).map((p) => el("tr", {}, [
    fmtNum(p.rate), String(p.max_num_seqs), fmtNum(p.throughput_tok_s), fmtMs(p.ttft_p50_ms), fmtMs(p.ttft_p99_ms),
    fmtMs(p.tpot_p50_ms), fmtMs(p.tpot_p99_ms), String(p.steps),
  ].map((t) => el("td", { text: t }))));
  v.table.replaceChildren(head, ...rows);
}

async function render(v) {
  const best = v.points.reduce((a, b) => (b.throughput_tok_s > a.throughput_tok_s ? b : a));
  v.throughput.set(best.throughput_tok_s, fmtNum(best.throughput_tok_s));
  v.ttft.set(best.ttft_p99_ms, fmtMs(best.ttft_p99_ms));
  v.tpot.set(best.tpot_p99_ms, fmtMs(best.tpot_p99_ms));
  v.headline.textContent = `${best.num_requests} requests of ${best.prompt_tokens} prompt + ${best.output_tokens} output tokens, `
    + `arriving at ${best.rate} per second with at most ${best.max_num_seqs} running at once.`;
  const m = best.machine;
  v.machineLine.textContent = `Measured here: ${m.processor}, ${threadsOn(m)}, `
    + `${measuredAt(m)}, on an engine beside the serving one (its clock counts only its own steps).`;
  renderTable(v);
  await Promise.all([chart(v.ttftChart, v.points, "ttft", "TTFT"), chart(v.tpotChart, v.points, "tpot", "TPOT")]);
}

// The reader's runs, or a message saying what is wrong with the inputs.
function plan(v) {
  const r = parseList(v.rates.value, { name: "Arrival rates", max: MAX_RATES, lo: MIN_RATE, hi: MAX_RATE });
  const s = parseList(v.limits.value, { name: "Batch limits", max: MAX_LIMITS, lo: 1, hi: MAX_SEQS, integer: true });
  const n = Number(v.count.value);
  const error = r.error || s.error || (!Number.isInteger(n) || n < 2 || n > MAX_REQUESTS ? `Requests: 2 to ${MAX_REQUESTS}.` : null);
  if (error) return { error };
  return { n, runs: s.values.flatMap((seqs) => r.values.map((rate) => ({ rate, seqs }))) };
}

// One call per point, in a row; `call` throws once a newer measure has aborted this one.
function measure(ctx, job, v, run) {
  const { error, n, runs } = plan(v);
  if (error) { v.progress.textContent = error; return Promise.resolve(); }
  ctx.setOptions({ rates: v.rates.value.trim(), max_num_seqs: v.limits.value.trim(), num_requests: n }, OPTIONS);
  v.points = [];
  return job.run(async (call) => {
    for (const [i, { rate, seqs }] of runs.entries()) {
      v.progress.textContent = `Run ${i + 1} of ${runs.length}: ${rate} req/s, max_num_seqs ${seqs}…`;
      const point = await call({ type: "throughput_latency", rate, max_num_seqs: seqs, num_requests: n, run },
        (p) => `Run ${i + 1} of ${runs.length} (${rate} req/s, max_num_seqs ${seqs}): ${p.note}`);
      v.points.push(point);
      await render(v);
    }
  }, { done: `${runs.length} runs of ${n} requests each.` });
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress });
  const life = measuring(root, ctx, {
    job, button: v.again, typed: [v.rates, v.limits], changed: [v.count], delay: 900, charts: [v.ttftChart, v.tpotChart],
    measure: (run) => measure(ctx, job, v, run),
  });
  return life.unmount;
}

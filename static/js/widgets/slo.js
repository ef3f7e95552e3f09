// Section 21, "Optimize the metric you care about": a seeded Poisson load served by the real engine
// with several batch limits, each with admission control off and on; per setting, throughput
// (requests/s, tokens/s) beside goodput (requests/s that met the reader's TTFT and TPOT objective),
// and the best setting by each metric. Measured here, on engines beside the serving one.

import { el, field } from "../lib/dom.js";
import { figure } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuring, numberInput, progressLine, shareBar, threadsOn, view } from "../lib/measure.js";

const OPTIONS = {
  rate: { type: "number", default: 4, min: 0.5, max: 200 },
  requests: { type: "int", default: 16, min: 4, max: 32 },
  batch: { type: "string", default: "2,8", maxLength: 40 },
  waiting: { type: "int", default: 2, min: 1, max: 32 },
  ttft: { type: "number", default: 1000, min: 1, max: 60000 },
  tpot: { type: "number", default: 250, min: 1, max: 10000 },
  seed: { type: "int", default: 0, min: 0, max: 1000000 },
};
const NUMBERS = [  // option, label, step
  ["rate", "Arrival rate, requests per second", 0.5], ["requests", "Requests per run", 1],
  ["waiting", "Admission limit: the most waiting requests", 1], ["ttft", "TTFT objective in ms", 50],
  ["tpot", "TPOT objective in ms", 10], ["seed", "Seed of the workload", 1],
];

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  goodput: ["Best goodput", "goodput_rps", "requests/s within the objective"],
  bestSeqs: ["Its batch limit", "best_max_num_seqs", "max_num_seqs of the best by goodput"],
  bestThroughput: ["Best by throughput", null, "output tokens/s"], verdict: "p.slo-verdict", machine: "p.note.slo-machine",
};

function build(opts) {
  const inputs = Object.fromEntries(NUMBERS.map(([key, label, step]) => [key, numberInput(key, label, opts[key], OPTIONS[key], { class: "text-input", step })]));
  inputs.batch = el("input", { class: "text-input", name: "batch", "aria-label": "Batch limits, comma separated", value: opts.batch });
  const v = {
    inputs,
    button: el("button", { type: "button", class: "slo-go", text: "Measure" }),
    progress: progressLine(),
    table: el("div", { class: "slo-table", role: "table", "aria-label": "Throughput and goodput per setting" }),
    ...view(VIEW),
  };
  const legend = el("p", { class: "note slo-legend" }, [
    el("span", { class: "slo-key is-throughput", text: "throughput (completed requests/s)" }),
    el("span", { class: "slo-key is-goodput", text: "goodput (requests/s within the objective)" }),
  ]);
  v.nodes = [
    el("div", { class: "controls slo-controls" }, [
      field("arrivals/s", inputs.rate), field("requests", inputs.requests), field("batch limits", inputs.batch),
      field("admit ≤ waiting", inputs.waiting), field("TTFT ≤ ms", inputs.ttft), field("TPOT ≤ ms", inputs.tpot),
      field("seed", inputs.seed), v.button,
    ]),
    v.progress,
    figure("The best setting depends on the metric", ["measured"], [
      el("div", { class: "stats slo-stats" }, [v.goodput.node, v.bestSeqs.node, v.bestThroughput.node]), v.verdict, v.machine]),
    figure("Throughput and goodput, setting by setting", ["measured"], [legend, v.table]),
  ];
  return v;
}

function settingName(run) {
  return `batch ≤ ${run.max_num_seqs}, ${run.max_waiting === null ? "admit all" : `reject beyond ${run.max_waiting} waiting`}`;
}

// The 99th percentile, linearly interpolated as numpy does (vLLM's benchmark uses numpy).
function p99(values) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b), pos = 0.99 * (s.length - 1), lo = Math.floor(pos);
  return s[lo] + (s[Math.min(lo + 1, s.length - 1)] - s[lo]) * (pos - lo);
}

function renderRow(x, i, r, max) {
  const served = x.requests.filter((q) => !q.rejected && q.finished_s !== null);
  const tags = [i === r.best_by_throughput ? el("span", { class: "slo-tag is-throughput", text: "best throughput" }) : null,
    i === r.best_by_goodput ? el("span", { class: "slo-tag is-goodput", text: "best goodput" }) : null];
  return el("div", { class: "slo-tr slo-run", role: "row", "data-goodput": x.goodput_rps, "data-throughput": x.throughput_rps }, [
    el("span", { role: "cell", class: "slo-setting" }, [el("strong", { text: `batch ≤ ${x.max_num_seqs}` }),
      el("span", { text: x.max_waiting === null ? "admit all" : `reject beyond ${x.max_waiting} waiting` }), el("span", { class: "slo-tags" }, tags)]),
    el("span", { role: "cell", class: "slo-num", text: `${x.completed} / ${x.rejected}` }),
    el("span", { role: "cell", class: "slo-num", text: fmtNum(x.output_tok_s) }),
    el("span", { role: "cell", class: "slo-num", text: `${fmtMs(p99(served.map((q) => q.ttft_ms)))} · ${fmtMs(p99(served.map((q) => q.tpot_ms)))}` }),
    el("span", { role: "cell", class: "slo-bars" }, [
      shareBar("slo", "is-throughput", x.throughput_rps, max, fmtNum(x.throughput_rps)),
      shareBar("slo", "is-goodput", x.goodput_rps, max, fmtNum(x.goodput_rps)),
    ]),
  ]);
}

function renderTable(v, r) {
  const max = Math.max(...r.runs.map((x) => x.throughput_rps), 1e-9);
  const head = el("div", { class: "slo-tr slo-th", role: "row" },
    ["setting", "done / rejected", "tokens/s", "p99 TTFT · TPOT", "throughput vs goodput (req/s)"].map((text) => el("span", { role: "columnheader", text })));
  v.table.replaceChildren(head, ...r.runs.map((x, i) => renderRow(x, i, r, max)));
}

function render(v, r) {
  const g = r.runs[r.best_by_goodput], t = r.runs[r.best_by_throughput];
  v.goodput.set(r.goodput_rps, `${fmtNum(r.goodput_rps)} req/s`);
  v.bestSeqs.set(r.best_max_num_seqs, String(r.best_max_num_seqs));
  v.bestThroughput.set(t.output_tok_s, `${fmtNum(t.output_tok_s)} tok/s`);
  v.verdict.textContent = r.best_by_goodput === r.best_by_throughput
    ? `Here one setting wins on both counts: ${settingName(g)}. Tighten the objective or raise the rate, and they part.`
    : `Optimizing throughput picks “${settingName(t)}” (${fmtNum(t.output_tok_s)} tok/s, goodput ${fmtNum(t.goodput_rps)} req/s); `
      + `optimizing goodput picks “${settingName(g)}” (${fmtNum(g.goodput_rps)} req/s within the objective, ${fmtNum(g.output_tok_s)} tok/s).`;
  const m = r.machine, inp = r.inputs;
  v.machine.textContent = `Measured here on ${m.measured_at}: ${threadsOn(m)} (${m.processor}). `
    + `${inp.requests} requests, Poisson arrivals at ${fmtNum(inp.rate)}/s (this sample's mean gap ${fmtMs(1000 * r.mean_interarrival_s)}), `
    + `each run on a fresh engine beside the serving one. Time is the sum of the measured engine steps (idle gaps skipped to the next arrival), `
    + "so other readers' work between steps does not count; the machine is shared, so timings vary from run to run.";
  renderTable(v, r);
}

function values(inputs) {
  const out = Object.fromEntries(NUMBERS.map(([key]) => [key, Number(inputs[key].value)]));
  return { ...out, batch: inputs.batch.value.trim() };
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.button });
  const life = measuring(root, ctx, {
    job, button: v.button,
    measure(run) {
      const x = values(v.inputs);
      ctx.setOptions(x, OPTIONS);
      const limits = x.batch.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
      return job.run({
        type: "slo", rate: x.rate, requests: x.requests, seed: x.seed, batch_limits: limits,
        max_waiting: x.waiting, ttft_ms: x.ttft, tpot_ms: x.tpot, run: run + 1,
      }, {
        running: "Generating the arrivals and starting an engine beside the serving one…",
        onProgress: (p) => `Serving ${p.note} (${p.done} of ${p.total} arrived)…`,
        render: (r) => render(v, r),
      });
    },
  });
  return life.unmount;
}

// Section 21, "Optimize the metric you care about": a seeded Poisson load served by the real engine
// with several batch limits, each with admission control off and on; per setting, throughput
// (requests/s, tokens/s) beside goodput (requests/s that met the reader's TTFT and TPOT objective),
// and the best setting by each metric. Measured here, on engines beside the serving one.

import { el, field, setState } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";

const OPTIONS = {
  rate: { type: "number", default: 4, min: 0.5, max: 200 },
  requests: { type: "int", default: 16, min: 4, max: 32 },
  batch: { type: "string", default: "2,8", maxLength: 40 },
  waiting: { type: "int", default: 2, min: 1, max: 32 },
  ttft: { type: "number", default: 1000, min: 1, max: 60000 },
  tpot: { type: "number", default: 250, min: 1, max: 10000 },
  seed: { type: "int", default: 0, min: 0, max: 1000000 },
};

function numberInput(name, label, value, attrs = {}) {
  return el("input", { class: "text-input", type: "number", name, "aria-label": label, value: String(value), ...attrs });
}

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { run: 0 };

  const inputs = {
    rate: numberInput("rate", "Arrival rate, requests per second", opts.rate, { min: 0.5, max: 200, step: 0.5 }),
    requests: numberInput("requests", "Requests per run", opts.requests, { min: 4, max: 32, step: 1 }),
    batch: el("input", { class: "text-input", name: "batch", "aria-label": "Batch limits, comma separated", value: opts.batch }),
    waiting: numberInput("waiting", "Admission limit: the most waiting requests", opts.waiting, { min: 1, max: 32, step: 1 }),
    ttft: numberInput("ttft", "TTFT objective in ms", opts.ttft, { min: 1, max: 60000, step: 50 }),
    tpot: numberInput("tpot", "TPOT objective in ms", opts.tpot, { min: 1, max: 10000, step: 10 }),
    seed: numberInput("seed", "Seed of the workload", opts.seed, { min: 0, max: 1000000, step: 1 }),
  };
  const button = el("button", { type: "button", class: "slo-go", text: "Measure" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress, button: button });

  const goodput = stat("Best goodput", { key: "goodput_rps", note: "requests/s within the objective" });
  const bestSeqs = stat("Its batch limit", { key: "best_max_num_seqs", note: "max_num_seqs of the best by goodput" });
  const bestThroughput = stat("Best by throughput", { note: "output tokens/s" });
  const verdict = el("p", { class: "slo-verdict" });
  const machine = el("p", { class: "note slo-machine" });
  const table = el("div", { class: "slo-table", role: "table", "aria-label": "Throughput and goodput per setting" });
  const legend = el("p", { class: "note slo-legend" }, [
    el("span", { class: "slo-key is-throughput", text: "throughput (completed requests/s)" }),
    el("span", { class: "slo-key is-goodput", text: "goodput (requests/s within the objective)" }),
  ]);

  root.append(
    el("div", { class: "controls slo-controls" }, [
      field("arrivals/s", inputs.rate), field("requests", inputs.requests), field("batch limits", inputs.batch),
      field("admit ≤ waiting", inputs.waiting), field("TTFT ≤ ms", inputs.ttft), field("TPOT ≤ ms", inputs.tpot),
      field("seed", inputs.seed), button,
    ]),
    progress,
    figure("The best setting depends on the metric", ["measured"], [
      el("div", { class: "stats slo-stats" }, [goodput.node, bestSeqs.node, bestThroughput.node]), verdict, machine]),
    figure("Throughput and goodput, setting by setting", ["measured"], [legend, table]),
  );

  function settingName(run) {
    return `batch ≤ ${run.max_num_seqs}, ${run.max_waiting === null ? "admit all" : `reject beyond ${run.max_waiting} waiting`}`;
  }

  function render(r) {
    const runs = r.runs, g = runs[r.best_by_goodput], t = runs[r.best_by_throughput];
    goodput.set(r.goodput_rps, `${fmtNum(r.goodput_rps)} req/s`);
    bestSeqs.set(r.best_max_num_seqs, String(r.best_max_num_seqs));
    bestThroughput.set(t.output_tok_s, `${fmtNum(t.output_tok_s)} tok/s`);
    verdict.textContent = r.best_by_goodput === r.best_by_throughput
      ? `Here one setting wins on both counts: ${settingName(g)}. Tighten the objective or raise the rate, and they part.`
      : `Optimizing throughput picks “${settingName(t)}” (${fmtNum(t.output_tok_s)} tok/s, goodput ${fmtNum(t.goodput_rps)} req/s); `
        + `optimizing goodput picks “${settingName(g)}” (${fmtNum(g.goodput_rps)} req/s within the objective, ${fmtNum(g.output_tok_s)} tok/s).`;
    const m = r.machine, inp = r.inputs;
    machine.textContent = `Measured here on ${m.measured_at}: ${m.threads} torch thread${m.threads === 1 ? "" : "s"} on ${m.cpu_count} CPU${m.cpu_count === 1 ? "" : "s"} (${m.processor}). `
      + `${inp.requests} requests, Poisson arrivals at ${fmtNum(inp.rate)}/s (this sample's mean gap ${fmtMs(1000 * r.mean_interarrival_s)}), `
      + `each run on a fresh engine beside the serving one. Time is the sum of the measured engine steps (idle gaps skipped to the next arrival), `
      + "so other readers' work between steps does not count; the machine is shared, so timings vary from run to run.";
    drawTable(runs, r);
  }

  function drawTable(runs, r) {
    const max = Math.max(...runs.map((x) => x.throughput_rps), 1e-9);
    const head = el("div", { class: "slo-tr slo-th", role: "row" },
      ["setting", "done / rejected", "tokens/s", "p99 TTFT · TPOT", "throughput vs goodput (req/s)"].map((text) => el("span", { role: "columnheader", text })));
    table.replaceChildren(head, ...runs.map((x, i) => {
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
          bar("is-throughput", x.throughput_rps, max), bar("is-goodput", x.goodput_rps, max),
        ]),
      ]);
    }));
  }

  function bar(kind, value, max) {
    return el("span", { class: "slo-bar" }, [el("span", { class: `slo-fill ${kind}`, style: { width: `${(100 * value) / max}%` } }),
      el("span", { class: "slo-bar-text", text: fmtNum(value) })]);
  }

  function values() {
    return {
      rate: Number(inputs.rate.value), requests: Number(inputs.requests.value), batch: inputs.batch.value.trim(),
      waiting: Number(inputs.waiting.value), ttft: Number(inputs.ttft.value), tpot: Number(inputs.tpot.value), seed: Number(inputs.seed.value),
    };
  }

  function run() {
    const v = values();
    ctx.setOptions(v, OPTIONS);
    state.run += 1;
    const limits = v.batch.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
    return job.run({
      type: "slo", rate: v.rate, requests: v.requests, seed: v.seed, batch_limits: limits,
      max_waiting: v.waiting, ttft_ms: v.ttft, tpot_ms: v.tpot, run: state.run,
    }, {
      running: "Generating the arrivals and starting an engine beside the serving one…",
      onProgress: (p) => `Serving ${p.note} (${p.done} of ${p.total} arrived)…`,
      render,
    });
  }

  button.addEventListener("click", run);
  client.ready().then(run).catch((err) => setState(root, "error", err.message));
  return () => {
    job.stop();
    root.replaceChildren();
  };
}

// The 99th percentile, linearly interpolated as numpy does (vLLM's benchmark uses numpy).
function p99(values) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b), pos = 0.99 * (s.length - 1), lo = Math.floor(pos);
  return s[lo] + (s[Math.min(lo + 1, s.length - 1)] - s[lo]) * (pos - lo);
}

// Section 13, "Throughput against latency": the real engine (an engine beside the serving one)
// under Poisson load at the arrival rates and batch limits the reader picks. Each run is one
// point: output tokens/s against TTFT and TPOT (p50 and p99, as vLLM's serving benchmark defines
// them); the runs with one batch limit form a curve. Every run is a cached job on the server.

import { el, field, debounce } from "../lib/dom.js";
import { plot, purge } from "../lib/chart.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { run: 0, points: [] };
  const cleanups = [];

  const rates = el("input", { type: "text", class: "text-input", name: "rates", "aria-label": "Arrival rates, requests per second" });
  rates.value = opts.rates;
  const limits = el("input", { type: "text", class: "text-input tl-short", name: "max_num_seqs", "aria-label": "Batch limits (max_num_seqs)" });
  limits.value = opts.max_num_seqs;
  const count = el("input", { type: "number", min: 2, max: MAX_REQUESTS, step: 1, name: "num_requests", "aria-label": "Requests per run" });
  count.value = String(opts.num_requests);
  const again = el("button", { type: "button", class: "primary", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress });
  const machineLine = el("p", { class: "note machine" });

  const throughput = stat("Output throughput", { key: "throughput_tok_s", note: "tokens/s, busiest run" });
  const ttft = stat("TTFT p99", { key: "ttft_p99_ms", note: "same run" });
  const tpot = stat("TPOT p99", { key: "tpot_p99_ms", note: "same run" });
  const headline = el("p", { class: "note" });
  const ttftChart = el("div", { class: "chart tl-chart", "aria-label": "TTFT against output throughput" });
  const tpotChart = el("div", { class: "chart tl-chart", "aria-label": "TPOT against output throughput" });
  const table = el("table", { class: "tl-table" });

  root.append(
    el("div", { class: "controls" }, [
      field("arrival rates (req/s)", rates), field("batch limits", limits), field("requests", count), again,
    ]),
    progress, machineLine,
    figure("The busiest run", ["measured"], [el("div", { class: "stats" }, [throughput.node, ttft.node, tpot.node]), headline]),
    el("div", { class: "tl-grid" }, [
      figure("Time to first token against throughput", ["measured"], [ttftChart]),
      figure("Time per output token against throughput", ["measured"], [tpotChart]),
    ]),
    figure("Every run", ["measured"], [el("div", { class: "tl-scroll" }, [table])]),
  );

  function curves(metric) {
    const limitsSeen = [...new Set(state.points.map((p) => p.max_num_seqs))].sort((a, b) => a - b);
    return limitsSeen.flatMap((seqs, i) => {
      const pts = state.points.filter((p) => p.max_num_seqs === seqs).sort((a, b) => a.rate - b.rate);
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

  function chart(node, metric, label) {
    return plot(node, curves(metric), {
      height: 260, showlegend: true, legend: { orientation: "h", y: -0.3, x: 0, font: { size: 10 } }, margin: { t: 8, b: 80, l: 56 },
      xaxis: { title: { text: "output throughput (tokens/s)", font: { size: 10 } }, rangemode: "tozero" },
      yaxis: { title: { text: `${label} (ms)`, font: { size: 10 } }, rangemode: "tozero" },
    });
  }

  function drawTable() {
    const head = el("tr", {}, ["rate (req/s)", "max_num_seqs", "tokens/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "steps"]
      .map((t) => el("th", { text: t })));
    const rows = [...state.points].sort((a, b) => a.max_num_seqs - b.max_num_seqs || a.rate - b.rate).map((p) => el("tr", {}, [
      fmtNum(p.rate), String(p.max_num_seqs), fmtNum(p.throughput_tok_s), fmtMs(p.ttft_p50_ms), fmtMs(p.ttft_p99_ms),
      fmtMs(p.tpot_p50_ms), fmtMs(p.tpot_p99_ms), String(p.steps),
    ].map((t) => el("td", { text: t }))));
    table.replaceChildren(head, ...rows);
  }

  async function render() {
    const best = state.points.reduce((a, b) => (b.throughput_tok_s > a.throughput_tok_s ? b : a));
    throughput.set(best.throughput_tok_s, fmtNum(best.throughput_tok_s));
    ttft.set(best.ttft_p99_ms, fmtMs(best.ttft_p99_ms));
    tpot.set(best.tpot_p99_ms, fmtMs(best.tpot_p99_ms));
    headline.textContent = `${best.num_requests} requests of ${best.prompt_tokens} prompt + ${best.output_tokens} output tokens, `
      + `arriving at ${best.rate} per second with at most ${best.max_num_seqs} running at once.`;
    const m = best.machine;
    machineLine.textContent = `Measured here: ${m.processor}, ${m.threads} torch threads on ${m.cpu_count} CPU cores, `
      + `at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}, on an engine beside the serving one `
      + "(its clock counts only its own steps).";
    drawTable();
    await Promise.all([chart(ttftChart, "ttft", "TTFT"), chart(tpotChart, "tpot", "TPOT")]);
  }

  function sync() {
    ctx.setOptions({ rates: rates.value.trim(), max_num_seqs: limits.value.trim(), num_requests: Number(count.value) }, OPTIONS);
  }

  async function measure() {
    const r = parseList(rates.value, { name: "Arrival rates", max: MAX_RATES, lo: MIN_RATE, hi: MAX_RATE });
    const s = parseList(limits.value, { name: "Batch limits", max: MAX_LIMITS, lo: 1, hi: MAX_SEQS, integer: true });
    const n = Number(count.value);
    const error = r.error || s.error || (!Number.isInteger(n) || n < 2 || n > MAX_REQUESTS ? `Requests: 2 to ${MAX_REQUESTS}.` : null);
    if (error) { progress.textContent = error; return; }
    sync();
    const runs = s.values.flatMap((seqs) => r.values.map((rate) => ({ rate, seqs })));
    state.points = [];
    // one call per point, in a row; `call` throws once a newer measure() has aborted this one
    return job.run(async (call) => {
      for (const [i, { rate, seqs }] of runs.entries()) {
        progress.textContent = `Run ${i + 1} of ${runs.length}: ${rate} req/s, max_num_seqs ${seqs}…`;
        const point = await call({ type: "throughput_latency", rate, max_num_seqs: seqs, num_requests: n, run: state.run },
          (p) => `Run ${i + 1} of ${runs.length} (${rate} req/s, max_num_seqs ${seqs}): ${p.note}`);
        state.points.push(point);
        await render();
      }
    }, { done: `${runs.length} runs of ${n} requests each.` });
  }

  const onInput = debounce(measure, 900);
  rates.addEventListener("input", onInput);
  limits.addEventListener("input", onInput);
  count.addEventListener("change", measure);
  again.addEventListener("click", () => { state.run += 1; measure(); });
  cleanups.push(ctx.connected(() => measure()));
  return () => {
    onInput.cancel();
    job.stop();
    cleanups.forEach((fn) => fn());
    purge(ttftChart);
    purge(tpotChart);
    root.replaceChildren();
  };
}

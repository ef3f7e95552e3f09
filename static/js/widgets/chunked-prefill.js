// Section 15, "Chunked prefill": a long prompt arrives while several requests decode, run twice
// on a sibling engine of this server: once with the whole prompt in one step, once in chunks of
// the reader's token budget. The chart: the decoders' inter-token latency over time, one line per
// run, with the long prompt's arrival at 0; the stall without chunking is the tall spike.

import { describeChart, el, field } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtMs } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { measuredAt, measuring, numberInput, progressLine, threadsOn, view } from "../lib/measure.js";

const OPTIONS = {
  decoders: { type: "int", default: 4, min: 1, max: 8 },
  prompt_tokens: { type: "int", default: 256, min: 32, max: 512 },
  budget: { type: "int", default: 64, min: 16, max: 256 },
};
const COLORS = { unchunked: "#b8323f", chunked: "#2f5fd0" };

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  chart: "div.chart.cp-chart", note: "p.note", threads: ["Threads", "threads", "torch threads used"], machineLine: "p.note.machine",
  maxUnchunked: ["Max ITL, one piece", "max_itl_ms_unchunked", "worst gap, prompt in one step"],
  maxChunked: ["Max ITL, chunked", "max_itl_ms_chunked", "worst gap, prompt in chunks"],
  ttftUnchunked: ["Long prompt's TTFT, one piece", "long_ttft_ms_unchunked", null],
  ttftChunked: ["Long prompt's TTFT, chunked", "long_ttft_ms_chunked", null], steps: "p.note.cp-steps",
};

function build(opts) {
  const v = {
    decoders: numberInput("decoders", "Decoding requests", opts.decoders, OPTIONS.decoders),
    promptTokens: numberInput("prompt_tokens", "Long prompt tokens", opts.prompt_tokens, OPTIONS.prompt_tokens),
    budget: numberInput("budget", "Token budget per step", opts.budget, OPTIONS.budget),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    ...view(VIEW),
  };
  describeChart(v.chart, "Inter-token latency over time", v.note);
  v.nodes = [
    el("div", { class: "controls" }, [field("decoding requests", v.decoders), field("long prompt (tokens)", v.promptTokens),
      field("token budget a step", v.budget), v.again]),
    v.progress,
    el("div", { class: "cp-machine" }, [v.threads.node, v.machineLine]),
    figure("The decoders' gaps between tokens, as the long prompt arrives", ["measured"], [
      v.chart, el("div", { class: "stats" }, [v.maxUnchunked.node, v.maxChunked.node, v.ttftUnchunked.node, v.ttftChunked.node]), v.note, v.steps]),
  ];
  return v;
}

function values(v) {
  return { decoders: Number(v.decoders.value), prompt_tokens: Number(v.promptTokens.value), budget: Number(v.budget.value) };
}

function invalid(values) {
  for (const [key, spec] of Object.entries(OPTIONS)) {
    const x = values[key];
    if (!Number.isInteger(x) || x < spec.min || x > spec.max) return `${key.replace("_", " ")} must be a whole number from ${spec.min} to ${spec.max}.`;
  }
  if (values.budget >= values.prompt_tokens) return "The budget must be less than the long prompt, or there is nothing to chunk.";
  return null;
}

// The decoders' gaps, one point per token at the time it came (every decoder gets its token in
// the same step, so x follows the first decoder and y is the worst of them); the line holds each
// gap's value over the interval it spans ("vh"), so a stall reads as a plateau.
function series(run, mode) {
  const first = run.decoders[0];
  const worst = first.map((_, i) => Math.max(...run.decoders.map((d) => d[i]?.itl_ms ?? 0)));
  return {
    type: "scatter", mode: "lines+markers", name: mode === "chunked" ? `chunked (budget ${run.step_budget})` : "one piece",
    x: first.map((g) => g.t_ms), y: worst, line: { color: COLORS[mode], width: 2, shape: "vh" }, marker: { size: 6, color: COLORS[mode] },
    hovertemplate: `${mode}: token at %{x:.0f} ms, gap %{y:.1f} ms<extra></extra>`,
  };
}

function renderNotes(v, r) {
  const u = r.runs.unchunked, c = r.runs.chunked;
  v.note.textContent = `${r.decoders} requests were decoding when a ${r.prompt_tokens}-token prompt arrived (time 0). In one piece, one step held all `
    + `${u.max_prefill_tokens_in_a_step} prompt tokens and every decoder waited ${fmtMs(r.max_itl_ms_unchunked)} for its next token. `
    + `With a budget of ${r.budget} tokens a step, the prompt took ${c.prefill_steps} steps of at most ${c.max_prefill_tokens_in_a_step} tokens, `
    + `and the worst gap was ${fmtMs(r.max_itl_ms_chunked)}; the long prompt's own first token came after ${fmtMs(c.long_ttft_ms)} instead of ${fmtMs(u.long_ttft_ms)}.`;
  const describe = (run) => run.steps.map((s) => `${s.prefill_tokens ? `P${s.prefill_tokens}+` : ""}D${s.decode_tokens}`).join(" · ");
  v.steps.textContent = `Steps after the arrival (P = prompt tokens, D = decode tokens). One piece: ${describe(u)}. Chunked: ${describe(c)}.`;
}

async function render(v, r) {
  const m = r.machine, u = r.runs.unchunked, c = r.runs.chunked;
  v.threads.set(m.threads, `${m.threads} of ${m.cpu_count}`);
  v.machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${threadsOn(m)}, torch ${m.torch}, `
    + `${measuredAt(m)}. The machine is shared: times move from run to run.`;
  v.maxUnchunked.set(r.max_itl_ms_unchunked, fmtMs(r.max_itl_ms_unchunked));
  v.maxChunked.set(r.max_itl_ms_chunked, fmtMs(r.max_itl_ms_chunked));
  v.ttftUnchunked.set(u.long_ttft_ms, fmtMs(u.long_ttft_ms));
  v.ttftChunked.set(c.long_ttft_ms, fmtMs(c.long_ttft_ms));
  renderNotes(v, r);
  await plot(v.chart, [series(u, "unchunked"), series(c, "chunked")], {
    height: 300, showlegend: true, legend: { orientation: "h", y: 1.12, x: 0, font: { size: 10 } },
    margin: { t: 24, b: 44, l: 56 },
    xaxis: { title: { text: "ms since the long prompt arrived", font: { size: 10 } }, zeroline: true },
    yaxis: { title: { text: "inter-token latency (ms)", font: { size: 10 } }, rangemode: "tozero" },
    shapes: [{ type: "line", x0: 0, x1: 0, yref: "paper", y0: 0, y1: 1, line: { color: "#9aa0a8", width: 1, dash: "dot" } }],
  });
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const life = measuring(root, ctx, {
    job, button: v.again, changed: [v.decoders, v.promptTokens, v.budget], charts: [v.chart],
    measure(run) {
      const request = values(v);
      const problem = invalid(request);
      if (problem) { v.progress.textContent = problem; return Promise.resolve(); }
      ctx.setOptions(request, OPTIONS);
      return job.run({ type: "chunked-prefill", ...request, run }, {
        running: "Running the two engines…",
        onProgress: (p) => `Measuring: ${p.note} (${percent(p)})…`,
        render: (r) => render(v, r),
        done: "Both runs measured, one engine step at a time.",
      });
    },
  });
  return life.unmount;
}

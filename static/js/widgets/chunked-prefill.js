// Section 15, "Chunked prefill": a long prompt arrives while several requests decode, run twice
// on a sibling engine of this server: once with the whole prompt in one step, once in chunks of
// the reader's token budget. The chart: the decoders' inter-token latency over time, one line per
// run, with the long prompt's arrival at 0; the stall without chunking is the tall spike.

import { el, field } from "../lib/dom.js";
import { plot, purge } from "../lib/chart.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";

const OPTIONS = {
  decoders: { type: "int", default: 4, min: 1, max: 8 },
  prompt_tokens: { type: "int", default: 256, min: 32, max: 512 },
  budget: { type: "int", default: 64, min: 16, max: 256 },
};
const COLORS = { unchunked: "#b8323f", chunked: "#2f5fd0" };

function numberInput(name, label, value, spec) {
  const input = el("input", { type: "number", name, min: spec.min, max: spec.max, step: 1, "aria-label": label });
  input.value = String(value);
  return input;
}

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { run: 0 };

  const decoders = numberInput("decoders", "Decoding requests", opts.decoders, OPTIONS.decoders);
  const promptTokens = numberInput("prompt_tokens", "Long prompt tokens", opts.prompt_tokens, OPTIONS.prompt_tokens);
  const budget = numberInput("budget", "Token budget per step", opts.budget, OPTIONS.budget);
  const again = el("button", { type: "button", class: "primary", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const threads = stat("Threads", { key: "threads", note: "torch threads used" });
  const machineLine = el("p", { class: "note machine" });
  const job = jobRunner(root, { client, progress, button: again });

  const chart = el("div", { class: "chart cp-chart", "aria-label": "Inter-token latency over time" });
  const maxUnchunked = stat("Max ITL, one piece", { key: "max_itl_ms_unchunked", note: "worst gap, prompt in one step" });
  const maxChunked = stat("Max ITL, chunked", { key: "max_itl_ms_chunked", note: "worst gap, prompt in chunks" });
  const ttftUnchunked = stat("Long prompt's TTFT, one piece", { key: "long_ttft_ms_unchunked" });
  const ttftChunked = stat("Long prompt's TTFT, chunked", { key: "long_ttft_ms_chunked" });
  const note = el("p", { class: "note" });
  const steps = el("p", { class: "note cp-steps" });

  root.append(
    el("div", { class: "controls" }, [field("decoding requests", decoders), field("long prompt (tokens)", promptTokens),
      field("token budget a step", budget), again]),
    progress,
    el("div", { class: "cp-machine" }, [threads.node, machineLine]),
    figure("The decoders' gaps between tokens, as the long prompt arrives", ["measured"], [
      chart, el("div", { class: "stats" }, [maxUnchunked.node, maxChunked.node, ttftUnchunked.node, ttftChunked.node]), note, steps]),
  );

  function values() {
    return { decoders: Number(decoders.value), prompt_tokens: Number(promptTokens.value), budget: Number(budget.value) };
  }

  function invalid(v) {
    for (const [key, spec] of Object.entries(OPTIONS)) {
      if (!Number.isInteger(v[key]) || v[key] < spec.min || v[key] > spec.max) return `${key.replace("_", " ")} must be a whole number from ${spec.min} to ${spec.max}.`;
    }
    if (v.budget >= v.prompt_tokens) return "The budget must be less than the long prompt, or there is nothing to chunk.";
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

  async function render(r) {
    const m = r.machine;
    threads.set(m.threads, `${m.threads} of ${m.cpu_count}`);
    machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${m.threads} torch threads on ${m.cpu_count} CPU cores, torch ${m.torch}, `
      + `at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}. The machine is shared: times move from run to run.`;
    const u = r.runs.unchunked, c = r.runs.chunked;
    maxUnchunked.set(r.max_itl_ms_unchunked, fmtMs(r.max_itl_ms_unchunked));
    maxChunked.set(r.max_itl_ms_chunked, fmtMs(r.max_itl_ms_chunked));
    ttftUnchunked.set(u.long_ttft_ms, fmtMs(u.long_ttft_ms));
    ttftChunked.set(c.long_ttft_ms, fmtMs(c.long_ttft_ms));
    note.textContent = `${r.decoders} requests were decoding when a ${r.prompt_tokens}-token prompt arrived (time 0). In one piece, one step held all `
      + `${u.max_prefill_tokens_in_a_step} prompt tokens and every decoder waited ${fmtMs(r.max_itl_ms_unchunked)} for its next token. `
      + `With a budget of ${r.budget} tokens a step, the prompt took ${c.prefill_steps} steps of at most ${c.max_prefill_tokens_in_a_step} tokens, `
      + `and the worst gap was ${fmtMs(r.max_itl_ms_chunked)}; the long prompt's own first token came after ${fmtMs(c.long_ttft_ms)} instead of ${fmtMs(u.long_ttft_ms)}.`;
    const describe = (run) => run.steps.map((s) => `${s.prefill_tokens ? `P${s.prefill_tokens}+` : ""}D${s.decode_tokens}`).join(" · ");
    steps.textContent = `Steps after the arrival (P = prompt tokens, D = decode tokens). One piece: ${describe(u)}. Chunked: ${describe(c)}.`;
    await plot(chart, [series(u, "unchunked"), series(c, "chunked")], {
      height: 300, showlegend: true, legend: { orientation: "h", y: 1.12, x: 0, font: { size: 10 } },
      margin: { t: 24, b: 44, l: 56 },
      xaxis: { title: { text: "ms since the long prompt arrived", font: { size: 10 } }, zeroline: true },
      yaxis: { title: { text: "inter-token latency (ms)", font: { size: 10 } }, rangemode: "tozero" },
      shapes: [{ type: "line", x0: 0, x1: 0, yref: "paper", y0: 0, y1: 1, line: { color: "#9aa0a8", width: 1, dash: "dot" } }],
    });
  }

  function measure() {
    const v = values();
    const problem = invalid(v);
    if (problem) {
      progress.textContent = problem;
      return Promise.resolve();
    }
    ctx.setOptions(v, OPTIONS);
    return job.run({ type: "chunked-prefill", ...v, run: state.run }, {
      running: "Running the two engines…",
      onProgress: (p) => `Measuring: ${p.note} (${percent(p)})…`,
      render,
      done: "Both runs measured, one engine step at a time.",
    });
  }

  again.addEventListener("click", () => { state.run += 1; measure(); });
  for (const input of [decoders, promptTokens, budget]) input.addEventListener("change", measure);
  const offStatus = ctx.connected(() => measure());
  return () => {
    job.stop();
    offStatus();
    purge(chart);
    root.replaceChildren();
  };
}

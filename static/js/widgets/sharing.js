// Sections 11 and 14, "Blocks shared and taken back": on a small engine beside the serving one,
// n samples of one prompt sharing its KV blocks (reference counts, the copy-on-write step, the
// blocks saved against n separate requests), a beam search forking and pruning, and a pool too
// small for its requests, preempted by recompute and by swap. Every number is from the run.

import { el } from "../lib/dom.js";
import { figure } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuring, numberInput, progressLine, threadsOn, view } from "../lib/measure.js";

const OPTIONS = {
  scenario: { type: "string", default: "samples", choices: ["samples", "beams", "preemption"] },
  n: { type: "int", default: 4, min: 2, max: 8 },
  beam_width: { type: "int", default: 3, min: 2, max: 4 },
};
const SCENARIOS = { samples: "n samples of one prompt", beams: "beam search", preemption: "a pool too small: recompute vs swap" };

const VIEW = {
  copies: ["Copy-on-write copies", "copies", "one per sample that diverged in a shared block"],
  shared: ["Blocks, shared", "peak_blocks_shared", "most in use at once, n samples"],
  apart: ["Blocks, separate", "peak_blocks_separate", "the same n as separate requests"],
  saved: ["Blocks saved", "blocks_saved", "separate − shared, measured"],
  recompute: ["Recompute: steps' time", "recompute_ms", "steps that recomputed, measured"],
  swapMs: ["Swap: copy time here", "swap_ms", "memcpy of the blocks, measured"],
  link: ["Swap over a host link", "host_link_ms", "", "computed"],
  same: ["Same tokens both ways", "same_tokens", "recompute and swap"],
  note: "p.note.sh-machine", steps: "div.sh-steps", detail: "div.sh-detail", runs: "div.sh-runs",
};

function build(opts) {
  const scenario = el("select", { name: "scenario", "aria-label": "Scenario" },
    Object.entries(SCENARIOS).map(([k, t]) => el("option", { value: k, text: t })));
  scenario.value = opts.scenario;
  const v = {
    scenario,
    n: numberInput("n", "Samples", opts.n, OPTIONS.n),
    width: numberInput("beam_width", "Beam width", opts.beam_width, OPTIONS.beam_width),
    button: el("button", { type: "button", class: "sh-run", text: "Run again" }),
    slider: el("input", { type: "range", min: 0, max: 0, value: 0, "aria-label": "Step", class: "sh-slider" }),
    stepLabel: el("span", { class: "sh-step-label", "aria-live": "polite" }),
    progress: progressLine(),
    result: null,
    ...view(VIEW),
  };
  v.samplesFig = figure("n samples: the prompt's blocks shared by reference count", ["live", "measured"], [
    el("div", { class: "stats" }, [v.copies.node, v.shared.node, v.apart.node, v.saved.node])]);
  v.preemptFig = figure("Preemption: recompute against swap", ["live", "measured", "computed"], [
    el("div", { class: "stats" }, [v.recompute.node, v.swapMs.node, v.link.node, v.same.node]), v.runs]);
  v.stepsFig = figure("Block tables, step by step", ["live"], [
    el("div", { class: "sh-stepper" }, [v.slider, v.stepLabel]), v.steps, v.detail]);
  v.nField = el("label", { class: "field" }, ["n ", v.n]);
  v.widthField = el("label", { class: "field" }, ["beam width ", v.width]);
  v.nodes = [
    el("div", { class: "controls" }, [
      el("label", { class: "field" }, ["scenario ", v.scenario]), v.nField, v.widthField, v.button]),
    v.progress, v.samplesFig, v.preemptFig, v.stepsFig, v.note,
  ];
  return v;
}

// One sequence's row: its name, then each block as a chip with its reference count.
function tableRow(t, copiedStep) {
  return el("div", { class: "sh-row" }, [
    el("span", { class: "sh-name", text: `${t.name} (${t.tokens} tokens)` }),
    el("span", { class: "sh-blocks" }, t.blocks.map((b, i) => el("span", {
      class: `sh-block${t.refs[i] > 1 ? " is-shared" : ""}${copiedStep && i === t.blocks.length - 1 && t.refs[i] === 1 ? " is-copied" : ""}`,
      title: `block ${b}: ${t.refs[i]} sequence${t.refs[i] === 1 ? " reads" : "s read"} it`,
      text: t.refs[i] > 1 ? `${b}×${t.refs[i]}` : String(b),
    }))),
  ]);
}

function renderStep(v, i) {
  const r = v.result, s = r.steps[i];
  if (!s) return;
  v.slider.value = String(i);
  const copied = s.copied > 0;
  v.stepLabel.textContent = `step ${i + 1} of ${r.steps.length}: ${fmtNum(s.used)} block${s.used === 1 ? "" : "s"} in use`
    + (copied ? `, ${s.copied} block${s.copied === 1 ? "" : "s"} copied on write` : "");
  v.steps.replaceChildren(...s.tables.map((t) => tableRow(t, copied)));
  v.steps.classList.toggle("is-cow", copied);
  const lines = [];
  if (s.beams) {
    for (const b of s.beams) lines.push(`${b.name}: “${b.text}” (log p ${b.cum_logprob.toFixed(2)})`);
    if (s.forked.length) lines.push(`forked: ${s.forked.join(", ")} (sharing their parent's blocks)`);
    if (s.pruned.length) lines.push(`pruned: ${s.pruned.join(", ")} (their blocks freed at once)`);
  } else if (s.preempted) {
    lines.push(`running ${s.running}, waiting ${s.waiting}, swapped ${s.swapped}`);
    if (s.preempted.length) lines.push(`preempted: ${s.preempted.join(", ")}`);
    if (s.swapped_in.length) lines.push(`swapped back in: ${s.swapped_in.join(", ")}`);
  }
  v.detail.replaceChildren(...lines.map((t) => el("p", { text: t })));
}

function renderRuns(v, r) {
  const row = (mode, m) => el("div", { class: "sh-tr", role: "row" }, [
    el("span", { role: "cell", text: mode }), el("span", { role: "cell", text: fmtNum(m.preemptions) }),
    el("span", { role: "cell", text: fmtNum(m.recomputed_tokens) }), el("span", { role: "cell", text: fmtNum(m.blocks_swapped) }),
    el("span", { role: "cell", text: fmtMs(m.total_ms) })]);
  const head = el("div", { class: "sh-tr sh-th", role: "row" }, ["mode", "preemptions", "tokens recomputed", "blocks swapped", "all steps"]
    .map((t) => el("span", { role: "columnheader", text: t })));
  v.runs.replaceChildren(el("div", { class: "sh-table", role: "table", "aria-label": "Recompute against swap" },
    [head, row("recompute", r.runs.recompute), row("swap", r.runs.swap)]));
  const swap = r.runs.swap, rec = r.runs.recompute;
  v.recompute.set(rec.recompute_ms, fmtMs(rec.recompute_ms));
  v.swapMs.set(swap.swap_ms, fmtMs(swap.swap_ms));
  v.link.set(swap.host_link_ms, `${fmtMs(swap.host_link_ms)} (${r.host_link.name}, ${r.host_link.gb_s} GB/s)`);
  v.same.set(r.same_tokens ? 1 : 0, r.same_tokens ? "yes" : "no");
}

function render(v, r) {
  v.result = r;
  const steps = r.scenario === "preemption" ? r.runs.swap.steps.map((s) => ({ ...s, tables: [] })) : r.steps;
  v.result = { ...r, steps };
  v.samplesFig.hidden = r.scenario !== "samples";
  v.preemptFig.hidden = r.scenario !== "preemption";
  v.stepsFig.hidden = false;
  if (r.scenario === "samples") {
    v.copies.set(r.copies);
    v.shared.set(r.peak_blocks_shared);
    v.apart.set(r.peak_blocks_separate);
    v.saved.set(r.blocks_saved);
  }
  if (r.scenario === "preemption") renderRuns(v, r);
  v.slider.max = String(Math.max(0, steps.length - 1));
  // start where it happens: the copy-on-write step, or the first preemption
  const first = steps.findIndex((s) => s.copied > 0 || (s.preempted && s.preempted.length > 0));
  renderStep(v, first >= 0 ? first : 0);
  const m = r.machine;
  v.note.textContent = `Run here at ${m.measured_at.slice(11, 16)} UTC on ${threadsOn(m)}, on an engine beside the serving one `
    + `with blocks of ${r.block_size} tokens. Times are measured on a shared machine and vary from run to run.`;
}

function measure(ctx, job, v, run) {
  const opts = { scenario: v.scenario.value, n: Number(v.n.value), beam_width: Number(v.width.value) };
  ctx.setOptions(opts, OPTIONS);
  return job.run({ type: "sharing", ...opts, run: run + 1 }, {
    running: "Starting a small engine beside the serving one…",
    onProgress: (p) => `${p.note}…`,
    render: (r) => render(v, r),
  });
}

// Only the field the chosen scenario reads: n for samples, beam width for beams.
function showFields(v) {
  v.nField.hidden = v.scenario.value !== "samples";
  v.widthField.hidden = v.scenario.value !== "beams";
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  showFields(v);
  v.scenario.addEventListener("change", () => showFields(v));
  v.slider.addEventListener("input", () => renderStep(v, Number(v.slider.value)));
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.button });
  return measuring(root, ctx, { job, button: v.button, changed: [v.scenario, v.n, v.width],
    measure: (run) => measure(ctx, job, v, run) }).unmount;
}

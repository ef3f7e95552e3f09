// Section 9, "The KV cache": N tokens generated twice on this server, with the cache and without
// it (every step recomputes the whole prefix). Left: tokens pushed through the layers at each step,
// the growing triangle against the flat line; right: each step's measured time. Below: the two
// greedy outputs, token by token, shown equal.

import { describeChart, el, field } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { measuredAt, measuring, progressLine, threadsOn, view } from "../lib/measure.js";
import { tokenChips } from "../lib/tokens.js";

const MAX_TOKENS = 64;
const DEFAULT_TEXT = "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who mended every clock in the valley. One winter morning,";

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 1000 },
  max_tokens: { type: "int", default: 16, min: 1, max: MAX_TOKENS },
};

const COLORS = { without: "#d0702f", with: "#2f5fd0" };

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  workChart: "div.chart.kv-chart", workNote: "p.note", timeChart: "div.chart.kv-chart", timeNote: "p.note",
  machineLine: "p.note.machine", withTokens: ["With the cache", "tokens_computed_with_cache", "tokens through the layers"],
  withoutTokens: ["Without", "tokens_computed_without_cache", "tokens through the layers"],
  speedup: ["Speedup", "speedup", "time without ÷ time with"], withMs: ["With the cache", "with_cache_ms", "all N steps"],
  withoutMs: ["Without", "without_cache_ms", "all N steps"], verdict: "p.kv-verdict",
};

function build(opts) {
  const v = {
    input: el("input", { type: "text", class: "text-input", name: "text", value: opts.text, "aria-label": "Prompt" }),
    maxTokens: el("input", { type: "number", min: 1, max: MAX_TOKENS, step: 1, name: "max_tokens", value: String(opts.max_tokens), "aria-label": "Tokens to generate" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }), progress: progressLine(),
    withRow: el("div", { class: "kv-tokens", role: "group", "aria-label": "Tokens generated with the cache" }),
    withoutRow: el("div", { class: "kv-tokens", role: "group", "aria-label": "Tokens generated without the cache" }),
    ...view(VIEW),
  };
  describeChart(v.workChart, "Tokens pushed through the layers per step", v.workNote);
  describeChart(v.timeChart, "Time of each step", v.timeNote);
  v.nodes = [
    el("div", { class: "controls" }, [v.input, field("tokens", v.maxTokens), v.again]),
    v.progress,
    v.machineLine,
    el("div", { class: "kv-grid" }, [
      figure("Work per step: a triangle against a flat line", ["computed"], [
        v.workChart, el("div", { class: "stats" }, [v.withTokens.node, v.withoutTokens.node]), v.workNote,
      ]),
      figure("Time per step", ["measured"], [
        v.timeChart, el("div", { class: "stats" }, [v.speedup.node, v.withMs.node, v.withoutMs.node]), v.timeNote,
      ]),
    ]),
    figure("Same answer either way", ["live"], [
      v.verdict,
      el("p", { class: "kv-label", text: "with the cache" }), v.withRow,
      el("p", { class: "kv-label", text: "without the cache" }), v.withoutRow,
    ]),
  ];
  return v;
}

// The work: orange bars, one per step, growing by a token a step (the triangle); the cached
// steps as a blue line, one prompt's worth at step 1 and then a single token (the flat line).
function bars(v, r) {
  const x = r.with_cache.steps.map((_, i) => i + 1);
  return plot(v.workChart, [
    { type: "bar", name: "without the cache", x, y: r.without_cache.steps.map((s) => s.tokens), marker: { color: COLORS.without },
      hovertemplate: "step %{x}: %{y} tokens recomputed<extra></extra>" },
    { type: "scatter", mode: "lines+markers", name: "with the cache", x, y: r.with_cache.steps.map((s) => s.tokens),
      line: { color: COLORS.with, width: 3 }, marker: { size: 7, color: COLORS.with },
      hovertemplate: "step %{x}: %{y} token(s)<extra></extra>" },
  ], {
    height: 240, bargap: 0.15, showlegend: true,
    legend: { orientation: "h", y: 1.15, x: 0, font: { size: 10 } }, margin: { t: 24, b: 40, l: 48 },
    xaxis: { title: { text: "generation step", font: { size: 10 } }, dtick: Math.max(1, Math.ceil(x.length / 10)) },
    yaxis: { title: { text: "tokens through the layers", font: { size: 10 } }, rangemode: "tozero" },
  });
}

function times(v, r) {
  const x = r.with_cache.steps.map((_, i) => i + 1);
  return plot(v.timeChart, [
    { type: "scatter", mode: "lines+markers", name: "without the cache", x, y: r.without_cache.steps.map((s) => s.ms),
      line: { color: COLORS.without, width: 2 }, marker: { size: 5 }, hovertemplate: "step %{x}: %{y:.1f} ms<extra></extra>" },
    { type: "scatter", mode: "lines+markers", name: "with the cache", x, y: r.with_cache.steps.map((s) => s.ms),
      line: { color: COLORS.with, width: 2 }, marker: { size: 5 }, hovertemplate: "step %{x}: %{y:.1f} ms<extra></extra>" },
  ], {
    height: 240, showlegend: true, legend: { orientation: "h", y: 1.15, x: 0, font: { size: 10 } }, margin: { t: 24, b: 40, l: 48 },
    xaxis: { title: { text: "generation step", font: { size: 10 } }, dtick: Math.max(1, Math.ceil(x.length / 10)) },
    yaxis: { title: { text: "step time (ms)", font: { size: 10 } }, rangemode: "tozero" },
  });
}

function chips(side, other) {
  return tokenChips(side.token_ids.map((id, i) => ({ id, text: side.tokens[i] })), {
    className: (tok, i) => (other.token_ids[i] === tok.id ? "kv-same" : "kv-differs"),
    breakLines: false,
  });
}

function renderNotes(v, r) {
  const P = r.prompt_tokens, N = r.max_tokens;
  v.workNote.textContent = `The prompt is ${P} tokens. Without the cache, step n recomputes all ${P} + n − 1 tokens: `
    + `${N} × ${P} + ${N} × ${N - 1} / 2 = ${fmtNum(r.tokens_computed_without_cache)} in all. With it, step 1 computes the prompt once and `
    + `every later step one token: ${P} + ${N} − 1 = ${fmtNum(r.tokens_computed_with_cache)}.`;
  const lastWith = r.with_cache.steps[N - 1], lastWithout = r.without_cache.steps[N - 1];
  v.timeNote.textContent = N > 1
    ? `At step ${N}, ${lastWithout.tokens} tokens went through the layers without the cache, in ${fmtMs(lastWithout.ms)}, `
      + `against ${lastWith.tokens} with it, in ${fmtMs(lastWith.ms)}. A step of a few tokens costs little more than a step of one, `
      + "because both read every weight once (see the two phases); the saving grows as the recomputed prefix gets longer."
    : "With one token there is nothing to reuse yet: both ways run the same prefill.";
  v.verdict.textContent = r.same
    ? `Identical: the same ${N} tokens both ways (greedy decoding). The cache changes the cost, not the answer.`
    : "The two differ at the marked tokens: two near-equal candidates swapped by float rounding.";
  v.verdict.classList.toggle("differs", !r.same);
}

async function render(v, r) {
  const m = r.machine;
  v.machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${threadsOn(m)}, `
    + `${measuredAt(m)}, on an engine beside the serving one.`;
  v.withTokens.set(r.tokens_computed_with_cache, fmtNum(r.tokens_computed_with_cache));
  v.withoutTokens.set(r.tokens_computed_without_cache, fmtNum(r.tokens_computed_without_cache));
  v.speedup.set(r.speedup, r.speedup === null ? "–" : `${fmtNum(r.speedup, 3)}×`);
  v.withMs.set(r.with_cache_ms, fmtMs(r.with_cache_ms));
  v.withoutMs.set(r.without_cache_ms, fmtMs(r.without_cache_ms));
  renderNotes(v, r);
  v.withRow.replaceChildren(...chips(r.with_cache, r.without_cache));
  v.withoutRow.replaceChildren(...chips(r.without_cache, r.with_cache));
  await Promise.all([bars(v, r), times(v, r)]);
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress });
  const life = measuring(root, ctx, {
    job, button: v.again, typed: [v.input], changed: [v.maxTokens], charts: [v.workChart, v.timeChart],
    measure(run) {
      const n = Number(v.maxTokens.value);
      if (!Number.isInteger(n) || n < 1 || n > MAX_TOKENS) {
        v.progress.textContent = `Tokens must be a whole number from 1 to ${MAX_TOKENS}.`;
        return Promise.resolve();
      }
      if (!v.input.value.trim()) return Promise.resolve();
      ctx.setOptions({ text: v.input.value, max_tokens: n }, OPTIONS);
      return job.run({ type: "kv_cache", text: v.input.value, max_tokens: n, run }, {
        running: "Generating both ways…",
        onProgress: (p) => `Generating ${p.note} (${percent(p)})…`,
        render: (r) => render(v, r),
        done: (r) => `${r.max_tokens} tokens after a ${r.prompt_tokens}-token prompt, both ways.`,
      });
    },
  });
  return life.unmount;
}

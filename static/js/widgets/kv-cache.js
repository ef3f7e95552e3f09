// Section 9, "The KV cache": N tokens generated twice on this server, with the cache and without
// it (every step recomputes the whole prefix). Left: tokens pushed through the layers at each step,
// the growing triangle against the flat line; right: each step's measured time. Below: the two
// greedy outputs, token by token, shown equal.

import { el, field, debounce } from "../lib/dom.js";
import { plot, purge } from "../lib/chart.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";

const MAX_TOKENS = 64;
const DEFAULT_TEXT = "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who mended every clock in the valley. One winter morning,";

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 1000 },
  max_tokens: { type: "int", default: 16, min: 1, max: MAX_TOKENS },
};

const COLORS = { without: "#d0702f", with: "#2f5fd0" };

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { result: null, run: 0 };
  const cleanups = [];

  // ---- controls ----
  const input = el("input", { type: "text", class: "text-input", name: "text", "aria-label": "Prompt" });
  input.value = opts.text;
  const maxTokens = el("input", { type: "number", min: 1, max: MAX_TOKENS, step: 1, name: "max_tokens", "aria-label": "Tokens to generate" });
  maxTokens.value = String(opts.max_tokens);
  const again = el("button", { type: "button", class: "primary", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress });
  const machineLine = el("p", { class: "note machine" });

  // ---- figures ----
  const workChart = el("div", { class: "chart kv-chart", "aria-label": "Tokens pushed through the layers per step" });
  const timeChart = el("div", { class: "chart kv-chart", "aria-label": "Time of each step" });
  const withTokens = stat("With the cache", { key: "tokens_computed_with_cache", note: "tokens through the layers" });
  const withoutTokens = stat("Without", { key: "tokens_computed_without_cache", note: "tokens through the layers" });
  const workNote = el("p", { class: "note" });
  const speedup = stat("Speedup", { key: "speedup", note: "time without ÷ time with" });
  const withMs = stat("With the cache", { key: "with_cache_ms", note: "all N steps" });
  const withoutMs = stat("Without", { key: "without_cache_ms", note: "all N steps" });
  const timeNote = el("p", { class: "note" });
  const verdict = el("p", { class: "kv-verdict" });
  const withRow = el("div", { class: "kv-tokens", "aria-label": "Tokens generated with the cache" });
  const withoutRow = el("div", { class: "kv-tokens", "aria-label": "Tokens generated without the cache" });

  root.append(
    el("div", { class: "controls" }, [input, field("tokens", maxTokens), again]),
    progress,
    machineLine,
    el("div", { class: "kv-grid" }, [
      figure("Work per step: a triangle against a flat line", ["computed"], [
        workChart, el("div", { class: "stats" }, [withTokens.node, withoutTokens.node]), workNote,
      ]),
      figure("Time per step", ["measured"], [
        timeChart, el("div", { class: "stats" }, [speedup.node, withMs.node, withoutMs.node]), timeNote,
      ]),
    ]),
    figure("Same answer either way", ["live"], [
      verdict,
      el("p", { class: "kv-label", text: "with the cache" }), withRow,
      el("p", { class: "kv-label", text: "without the cache" }), withoutRow,
    ]),
  );

  // ---- drawing ----
  // The work: orange bars, one per step, growing by a token a step (the triangle); the cached
  // steps as a blue line, one prompt's worth at step 1 and then a single token (the flat line).
  function bars(r) {
    const x = r.with_cache.steps.map((_, i) => i + 1);
    return plot(workChart, [
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

  function times(r) {
    const x = r.with_cache.steps.map((_, i) => i + 1);
    return plot(timeChart, [
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

  async function render(r) {
    state.result = r;
    const P = r.prompt_tokens, N = r.max_tokens;
    const m = r.machine;
    machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${m.threads} torch threads on ${m.cpu_count} CPU cores, `
      + `at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}, on an engine beside the serving one.`;
    withTokens.set(r.tokens_computed_with_cache, fmtNum(r.tokens_computed_with_cache));
    withoutTokens.set(r.tokens_computed_without_cache, fmtNum(r.tokens_computed_without_cache));
    speedup.set(r.speedup, r.speedup === null ? "–" : `${fmtNum(r.speedup, 3)}×`);
    withMs.set(r.with_cache_ms, fmtMs(r.with_cache_ms));
    withoutMs.set(r.without_cache_ms, fmtMs(r.without_cache_ms));
    workNote.textContent = `The prompt is ${P} tokens. Without the cache, step n recomputes all ${P} + n − 1 tokens: `
      + `${N} × ${P} + ${N} × ${N - 1} / 2 = ${fmtNum(r.tokens_computed_without_cache)} in all. With it, step 1 computes the prompt once and `
      + `every later step one token: ${P} + ${N} − 1 = ${fmtNum(r.tokens_computed_with_cache)}.`;
    const lastWith = r.with_cache.steps[N - 1], lastWithout = r.without_cache.steps[N - 1];
    timeNote.textContent = N > 1
      ? `At step ${N}, ${lastWithout.tokens} tokens went through the layers without the cache, in ${fmtMs(lastWithout.ms)}, `
        + `against ${lastWith.tokens} with it, in ${fmtMs(lastWith.ms)}. A step of a few tokens costs little more than a step of one, `
        + "because both read every weight once (see the two phases); the saving grows as the recomputed prefix gets longer."
      : "With one token there is nothing to reuse yet: both ways run the same prefill.";
    verdict.textContent = r.same
      ? `Identical: the same ${N} tokens both ways (greedy decoding). The cache changes the cost, not the answer.`
      : "The two differ at the marked tokens: two near-equal candidates swapped by float rounding.";
    verdict.classList.toggle("differs", !r.same);
    withRow.replaceChildren(...chips(r.with_cache, r.without_cache));
    withoutRow.replaceChildren(...chips(r.without_cache, r.with_cache));
    await Promise.all([bars(r), times(r)]);
  }

  // ---- asking the server ----
  function syncOptions() {
    ctx.setOptions({ text: input.value, max_tokens: Number(maxTokens.value) }, OPTIONS);
  }

  function measure() {
    const n = Number(maxTokens.value);
    if (!Number.isInteger(n) || n < 1 || n > MAX_TOKENS) {
      progress.textContent = `Tokens must be a whole number from 1 to ${MAX_TOKENS}.`;
      return Promise.resolve();
    }
    if (!input.value.trim()) return Promise.resolve();
    syncOptions();
    return job.run({ type: "kv_cache", text: input.value, max_tokens: n, run: state.run }, {
      running: "Generating both ways…",
      onProgress: (p) => `Generating ${p.note} (${percent(p)})…`,
      render,
      done: (r) => `${r.max_tokens} tokens after a ${r.prompt_tokens}-token prompt, both ways.`,
    });
  }

  const onInput = debounce(measure, 700);
  input.addEventListener("input", onInput);
  maxTokens.addEventListener("change", measure);
  again.addEventListener("click", () => { state.run += 1; measure(); });

  cleanups.push(ctx.connected(() => measure()));
  return () => {
    onInput.cancel();
    job.stop();
    cleanups.forEach((fn) => fn());
    purge(workChart);
    purge(timeChart);
    root.replaceChildren();
  };
}

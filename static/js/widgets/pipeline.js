// Section 18, "Pipeline parallelism": the model's layers cut into stages, one worker process each,
// with microbatches sent from stage to stage. Which layers each stage holds, the measured
// timeline of the reader's schedule (fill, steady state, drain shaded), and the bubble, the idle
// share, measured for m = 1, 2, 4, 8 microbatches and the reader's m, beside GPipe's formula.

import { el, field, select, svg } from "../lib/dom.js";
import { plot, purge } from "../lib/chart.js";
import { figure, stat } from "../lib/figures.js";
import { fmtBytes, fmtMs, fmtPct } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";

const OPTIONS = {
  stages: { type: "int", default: 3, min: 2, max: 4 },
  microbatches: { type: "int", default: 4, min: 1, max: 8 },
  tokens: { type: "int", default: 16, min: 4, max: 64 },
};
const STAGE_COLORS = ["#2f5fd0", "#d0702f", "#1d7a4f", "#8a3f8f"];
const PHASES = { fill: "#e8eefc", drain: "#fbeee2" };

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { run: 0 };

  const stages = select([2, 3, 4].map((n) => [n, String(n)]), opts.stages, { name: "stages", "aria-label": "Stages" });
  const microbatches = select([1, 2, 3, 4, 5, 6, 7, 8].map((n) => [n, String(n)]), opts.microbatches, { name: "microbatches", "aria-label": "Microbatches" });
  const tokens = el("input", { type: "number", name: "tokens", min: 4, max: 64, step: 1, "aria-label": "Tokens per microbatch" });
  tokens.value = String(opts.tokens);
  const again = el("button", { type: "button", class: "primary", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress, button: again });

  const layers = el("div", { class: "pp-layers" });
  const layersNote = el("p", { class: "note" });
  const stagesStat = stat("Stages", { key: "stages", note: "worker processes" });
  const mStat = stat("Microbatches", { key: "microbatches", note: "in the timeline" });
  const measured = stat("Bubble, measured", { key: "bubble_fraction_measured", note: "idle share of the stages" });
  const formula = stat("Bubble, formula", { key: "bubble_fraction_formula", note: "(p − 1) / (m + p − 1)" });
  const timeline = el("div", { class: "chart pp-timeline", "aria-label": "Each stage's timeline" });
  const timelineLegend = el("div", { class: "legend" }, [
    el("span", {}, [el("span", { class: "swatch", style: { background: STAGE_COLORS[0] } }), "computing a microbatch (its number inside)"]),
    el("span", {}, [el("span", { class: "swatch line" }), "waiting to receive"]),
    el("span", {}, [el("span", { class: "swatch", style: { background: PHASES.fill } }), "fill"]),
    el("span", {}, [el("span", { class: "swatch", style: { background: PHASES.drain } }), "drain"]),
  ]);
  const timelineNote = el("p", { class: "note" });
  const machineLine = el("p", { class: "note machine" });
  const bubble = el("div", { class: "chart pp-bubble", "aria-label": "Bubble against the number of microbatches" });
  const formulaLabel = el("span");
  const bubbleLegend = el("div", { class: "legend" }, [
    el("span", {}, [el("span", { class: "swatch", style: { background: STAGE_COLORS[0] } }), "measured here"]),
    el("span", {}, [el("span", { class: "swatch", style: { background: "#b8323f" } }), "your m"]),
    el("span", {}, [el("span", { class: "swatch line dashed" }), formulaLabel]),
  ]);
  const bubbleNote = el("p", { class: "note" });
  const check = el("p", { class: "note pp-check" });

  root.append(
    el("div", { class: "controls" }, [field("stages", stages), field("microbatches", microbatches),
      field("tokens each", tokens), again]),
    progress,
    figure("Which layers each stage holds", ["live"], [layers, layersNote, check]),
    figure("The measured timeline", ["measured", "computed"], [
      el("div", { class: "stats" }, [stagesStat.node, mStat.node, measured.node, formula.node]), timeline, timelineLegend, timelineNote, machineLine]),
    figure("The bubble against the number of microbatches", ["measured", "computed"], [bubble, bubbleLegend, bubbleNote]),
  );

  function drawLayers(r) {
    const L = r.num_layers, cell = 18, pad = 2, top = 22, left = 90;
    const parts = [];
    r.stage_layers.forEach(([a, b], s) => {
      const color = STAGE_COLORS[s % STAGE_COLORS.length];
      for (let i = a; i < b; i += 1) {
        parts.push(svg("rect", { x: left + i * (cell + pad), y: top, width: cell, height: cell, rx: 3, fill: color, "fill-opacity": 0.75 },
          [svg("title", { text: `layer ${i}: stage ${s}` })]));
      }
      const mid = left + ((a + b) / 2) * (cell + pad) - pad / 2;
      parts.push(svg("text", { x: mid, y: top - 5, "text-anchor": "middle", "font-size": 13, fill: color, "font-weight": 600, text: `stage ${s}` }));
      parts.push(svg("text", { x: mid, y: top + cell + 15, "text-anchor": "middle", "font-size": 12, fill: "#6a6f78", text: `layers ${a}–${b - 1}` }));
    });
    parts.push(svg("text", { x: left - 6, y: top + 14, "text-anchor": "end", "font-size": 12, fill: "#6a6f78", text: "embedding →" }));
    const end = left + L * (cell + pad);
    parts.push(svg("text", { x: end + 4, y: top + 14, "font-size": 12, fill: "#6a6f78", text: "→ norm, LM head" }));
    return svg("svg", { viewBox: `0 0 ${end + 124} ${top + cell + 22}`, role: "img", "aria-label": "The layers, coloured by the stage that holds them" }, parts);
  }

  // One bar per (stage, microbatch) computed; a thin grey line where a stage waited to receive.
  function timelineTraces(run) {
    const compute = run.spans.filter((s) => s[2] === "compute");
    const waits = run.spans.filter((s) => s[2] === "wait");
    const x = [], y = [];
    for (const s of waits) x.push(s[3], s[4], null), y.push(`stage ${s[0]}`, `stage ${s[0]}`, null);
    return [
      { type: "scatter", mode: "lines", name: "waiting to receive", x, y, line: { color: "#9aa0a8", width: 2, dash: "dot" }, hoverinfo: "skip" },
      { type: "bar", orientation: "h", name: "computing a microbatch", y: compute.map((s) => `stage ${s[0]}`), base: compute.map((s) => s[3]),
        x: compute.map((s) => s[4] - s[3]), width: 0.62, text: compute.map((s) => String(s[1] + 1)), textposition: "inside", insidetextanchor: "middle",
        marker: { color: compute.map((s) => STAGE_COLORS[s[0] % STAGE_COLORS.length]), line: { color: "#fff", width: 1 } },
        customdata: compute.map((s) => [s[1] + 1, s[4] - s[3]]),
        hovertemplate: "microbatch %{customdata[0]}: %{customdata[1]:.1f} ms<extra>%{y}</extra>" },
    ];
  }

  // Fill: until the last stage starts its first microbatch; drain: after the first stage ends its last.
  function phaseShapes(run, p) {
    const compute = run.spans.filter((s) => s[2] === "compute");
    const lastStageStart = Math.min(...compute.filter((s) => s[0] === p - 1).map((s) => s[3]));
    const firstStageEnd = Math.max(...compute.filter((s) => s[0] === 0).map((s) => s[4]));
    const end = Math.max(...compute.map((s) => s[4]));
    const band = (x0, x1, color) => ({ type: "rect", xref: "x", yref: "paper", x0, x1, y0: 0, y1: 1, fillcolor: color, line: { width: 0 }, layer: "below" });
    const label = (x0, x1, text) => ({ x: (x0 + x1) / 2, y: 1.02, xref: "x", yref: "paper", text, showarrow: false, font: { size: 9, color: "#6a6f78" }, yanchor: "bottom" });
    const shapes = [band(0, lastStageStart, PHASES.fill), band(Math.max(firstStageEnd, lastStageStart), end, PHASES.drain)];
    const annotations = [label(0, lastStageStart, "fill")];
    if (firstStageEnd > lastStageStart) annotations.push(label(lastStageStart, firstStageEnd, "steady"));
    annotations.push(label(Math.max(firstStageEnd, lastStageStart), end, "drain"));
    return { shapes, annotations };
  }

  async function render(r) {
    const p = r.stages, m = r.microbatches, mc = r.machine;
    layers.replaceChildren(drawLayers(r));
    layersNote.textContent = `${r.num_layers} layers in ${p} contiguous stages. Stage 0 also holds the embedding table and the last stage the final norm and `
      + `the LM head, which is the same table (tied weights), so both ends keep a copy. Between stages only the residual stream travels: `
      + `${r.tokens} tokens × ${r.activation_bytes / r.tokens / 4} floats = ${fmtBytes(r.activation_bytes)} a microbatch.`;
    check.textContent = r.bit_equal
      ? `Output: bit-equal to the whole model in one process for all ${r.checked_microbatches} microbatches (each stage runs the same blocks on the same floats, and a send copies them exactly).`
      : `Output: differs from one process by at most ${r.max_abs_diff.toExponential(2)}.`;
    stagesStat.set(p, String(p));
    mStat.set(m, String(m));
    measured.set(r.bubble_fraction_measured, fmtPct(r.bubble_fraction_measured));
    formula.set(r.bubble_fraction_formula, `${fmtPct(r.bubble_fraction_formula)} = ${p - 1}/${m + p - 1}`);
    const run = r.runs.find((x) => x.microbatches === m);
    const compute = run.spans.filter((s) => s[2] === "compute");
    const span = Math.max(...compute.map((s) => s[4]));
    const perStage = Array.from({ length: p }, (_, s) => compute.filter((c) => c[0] === s).reduce((a, c) => a + c[4] - c[3], 0) / m);
    const { shapes, annotations } = phaseShapes(run, p);
    await plot(timeline, timelineTraces(run), {
      height: 70 + 36 * p, barmode: "overlay", margin: { t: 22, b: 40, l: 56 }, shapes, annotations,
      xaxis: { title: { text: "ms since the first stage started", font: { size: 10 } }, range: [0, span * 1.01] },
      yaxis: { autorange: "reversed", type: "category", categoryarray: Array.from({ length: p }, (_, s) => `stage ${s}`) },
    });
    timelineNote.textContent = `${m} microbatch${m > 1 ? "es" : ""} of ${r.tokens} tokens through ${p} stages in ${fmtMs(span)}. A stage took `
      + perStage.map((t, s) => `${fmtMs(t)} (stage ${s})`).join(", ") + " a microbatch on average. "
      + `Stage s starts only when stage s − 1 hands over its first microbatch (fill), and stops early once it has passed on the last (drain): `
      + `between the first start and the last end, the stages were idle ${fmtPct(r.bubble_fraction_measured)} of the time, against ${fmtPct(r.bubble_fraction_formula)} for equal stages and free sends.`;
    machineLine.textContent = `Measured here: ${p} worker processes with ${mc.threads_per_worker} torch thread each, on ${mc.cpu_count} CPU cores (${mc.system} ${mc.processor}, torch ${mc.torch}), `
      + `at ${mc.measured_at.slice(11, 16)} UTC on ${mc.measured_at.slice(0, 10)}, sending over gloo on this machine. `
      + (p > mc.cpu_count ? `${p} processes share ${mc.cpu_count} cores: in the steady state the busy stages take turns on the cores, so a microbatch takes longer there than in the fill, and the bars stretch. ` : "")
      + `The machine is shared with the server and other work (load average ${mc.load_average} over the last minute, on ${mc.cpu_count} cores; the workers run at a lower priority than the server): times move from run to run.`;

    formulaLabel.textContent = `formula (p − 1)/(m + p − 1), p = ${p}`;
    const curveM = Array.from({ length: 71 }, (_, i) => 1 + i * 0.1);
    await plot(bubble, [
      { type: "scatter", mode: "lines", name: `formula (p − 1)/(m + p − 1), p = ${p}`, x: curveM, y: curveM.map((x) => (p - 1) / (x + p - 1)),
        line: { color: "#6a6f78", width: 2, dash: "dash" }, hovertemplate: "m = %{x:.1f}: %{y:.1%}<extra>formula</extra>" },
      { type: "scatter", mode: "markers+lines", name: "measured here", x: r.runs.map((x) => x.microbatches), y: r.runs.map((x) => x.bubble_measured),
        marker: { size: 9, color: r.runs.map((x) => (x.microbatches === m ? "#b8323f" : STAGE_COLORS[0])) }, line: { color: STAGE_COLORS[0], width: 1 },
        hovertemplate: "m = %{x}: %{y:.1%} idle<extra>measured</extra>" },
    ], { height: 240, margin: { t: 8, b: 44, l: 56 },
      xaxis: { title: { text: "microbatches m", font: { size: 10 } }, dtick: 1, range: [0.7, 8.3] },
      yaxis: { title: { text: "bubble (idle share)", font: { size: 10 } }, tickformat: ".0%", range: [0, 1] } });
    bubbleNote.textContent = `The same ${p} processes ran the schedule with m = ${r.schedules.join(", ")}. More microbatches shrink the fill and drain against the whole. `
      + "The formula assumes stages of equal cost and instant sends; here stages differ by a layer, a send and a wake-up cost real time, and processes share the cores, "
      + "so the points sit off the curve.";
  }

  function values() {
    return { stages: Number(stages.value), microbatches: Number(microbatches.value), tokens: Number(tokens.value) };
  }

  function measure() {
    const v = values();
    if (!Number.isInteger(v.tokens) || v.tokens < OPTIONS.tokens.min || v.tokens > OPTIONS.tokens.max) {
      progress.textContent = `Tokens each must be a whole number from ${OPTIONS.tokens.min} to ${OPTIONS.tokens.max}.`;
      return Promise.resolve();
    }
    ctx.setOptions(v, OPTIONS);
    return job.run({ type: "pipeline", ...v, run: state.run }, {
      running: `Starting ${v.stages} worker processes…`,
      onProgress: (pr) => `${pr.note}…`,
      render,
      done: (r) => `Measured on ${r.stages} worker processes, which have exited.`,
    });
  }

  again.addEventListener("click", () => { state.run += 1; measure(); });
  for (const input of [stages, microbatches, tokens]) input.addEventListener("change", measure);
  const offStatus = ctx.connected((hello) => {
    // a model with fewer layers than stages cannot be cut that finely (the tiny test model has 2)
    for (const option of stages.options) option.disabled = Number(option.value) > hello.num_layers;
    if (Number(stages.value) > hello.num_layers) stages.value = String(Math.min(hello.num_layers, OPTIONS.stages.max));
    return measure();
  });
  return () => {
    job.stop();
    offStatus();
    purge(timeline);
    purge(bubble);
    root.replaceChildren();
  };
}

// Section 18, "Pipeline parallelism": the model's layers cut into stages, one worker process each,
// with microbatches sent from stage to stage. Which layers each stage holds, the measured
// timeline of the reader's schedule (fill, steady state, drain shaded), and the bubble, the idle
// share, measured for m = 1, 2, 4, 8 microbatches and the reader's m, beside GPipe's formula.

import { describeChart, el, field, select, svg } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtBytes, fmtMs, fmtPct } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuring, progressLine, view, workersLine } from "../lib/measure.js";

const OPTIONS = {
  stages: { type: "int", default: 3, min: 2, max: 4 },
  microbatches: { type: "int", default: 4, min: 1, max: 8 },
  tokens: { type: "int", default: 16, min: 4, max: 64 },
};
const STAGE_COLORS = ["#2f5fd0", "#d0702f", "#1d7a4f", "#8a3f8f"];
const PHASES = { fill: "#e8eefc", drain: "#fbeee2" };

const swatch = (background, text) => el("span", {}, [el("span", { class: "swatch", style: { background } }), text]);

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  timeline: "div.chart.pp-timeline", timelineNote: "p.note", bubble: "div.chart.pp-bubble", bubbleNote: "p.note",
  formulaLabel: "span", layers: "div.pp-layers", layersNote: "p.note", check: "p.note.pp-check",
  stagesStat: ["Stages", "stages", "worker processes"], mStat: ["Microbatches", "microbatches", "in the timeline"],
  measured: ["Bubble, measured", "bubble_fraction_measured", "idle share of the stages"],
  formula: ["Bubble, formula", "bubble_fraction_formula", "(p − 1) / (m + p − 1)"], machineLine: "p.note.machine",
};

function build(opts) {
  const v = {
    stages: select([2, 3, 4].map((n) => [n, String(n)]), opts.stages, { name: "stages", "aria-label": "Stages" }),
    microbatches: select([1, 2, 3, 4, 5, 6, 7, 8].map((n) => [n, String(n)]), opts.microbatches, { name: "microbatches", "aria-label": "Microbatches" }),
    tokens: el("input", { type: "number", name: "tokens", min: 4, max: 64, step: 1, value: String(opts.tokens), "aria-label": "Tokens per microbatch" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    ...view(VIEW),
  };
  describeChart(v.timeline, "Each stage's timeline", v.timelineNote);
  describeChart(v.bubble, "Bubble against the number of microbatches", v.bubbleNote);
  const timelineLegend = el("div", { class: "legend" }, [swatch(STAGE_COLORS[0], "computing a microbatch (its number inside)"),
    el("span", {}, [el("span", { class: "swatch line" }), "waiting to receive"]), swatch(PHASES.fill, "fill"), swatch(PHASES.drain, "drain")]);
  const bubbleLegend = el("div", { class: "legend" }, [swatch(STAGE_COLORS[0], "measured here"), swatch("#b8323f", "your m"),
    el("span", {}, [el("span", { class: "swatch line dashed" }), v.formulaLabel])]);
  v.nodes = [
    el("div", { class: "controls" }, [field("stages", v.stages), field("microbatches", v.microbatches), field("tokens each", v.tokens), v.again]),
    v.progress,
    figure("Which layers each stage holds", ["live"], [v.layers, v.layersNote, v.check]),
    figure("The measured timeline", ["measured", "computed"], [
      el("div", { class: "stats" }, [v.stagesStat.node, v.mStat.node, v.measured.node, v.formula.node]), v.timeline, timelineLegend, v.timelineNote, v.machineLine]),
    figure("The bubble against the number of microbatches", ["measured", "computed"], [v.bubble, bubbleLegend, v.bubbleNote]),
  ];
  return v;
}

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

function renderLayers(v, r) {
  const p = r.stages;
  v.layers.replaceChildren(drawLayers(r));
  v.layersNote.textContent = `${r.num_layers} layers in ${p} contiguous stages. Stage 0 also holds the embedding table and the last stage the final norm and `
    + `the LM head, which is the same table (tied weights), so both ends keep a copy. Between stages only the residual stream travels: `
    + `${r.tokens} tokens × ${r.activation_bytes / r.tokens / 4} floats = ${fmtBytes(r.activation_bytes)} a microbatch.`;
  v.check.textContent = r.bit_equal
    ? `Output: bit-equal to the whole model in one process for all ${r.checked_microbatches} microbatches (each stage runs the same blocks on the same floats, and a send copies them exactly).`
    : `Output: differs from one process by at most ${r.max_abs_diff.toExponential(2)}.`;
}

function timelineText(v, r, run) {
  const p = r.stages, m = r.microbatches, mc = r.machine;
  const compute = run.spans.filter((s) => s[2] === "compute");
  const span = Math.max(...compute.map((s) => s[4]));
  const perStage = Array.from({ length: p }, (_, s) => compute.filter((c) => c[0] === s).reduce((a, c) => a + c[4] - c[3], 0) / m);
  v.timelineNote.textContent = `${m} microbatch${m > 1 ? "es" : ""} of ${r.tokens} tokens through ${p} stages in ${fmtMs(span)}. A stage took `
    + perStage.map((t, s) => `${fmtMs(t)} (stage ${s})`).join(", ") + " a microbatch on average. "
    + `Stage s starts only when stage s − 1 hands over its first microbatch (fill), and stops early once it has passed on the last (drain): `
    + `between the first start and the last end, the stages were idle ${fmtPct(r.bubble_fraction_measured)} of the time, against ${fmtPct(r.bubble_fraction_formula)} for equal stages and free sends.`;
  v.machineLine.textContent = workersLine(mc, p, "sending", `${p} processes share ${mc.cpu_count} cores: in the steady state the busy stages take turns `
    + "on the cores, so a microbatch takes longer there than in the fill, and the bars stretch. ");
  return span;
}

function drawTimeline(v, r) {
  const p = r.stages;
  const run = r.runs.find((x) => x.microbatches === r.microbatches);
  const span = timelineText(v, r, run);
  const { shapes, annotations } = phaseShapes(run, p);
  return plot(v.timeline, timelineTraces(run), {
    height: 70 + 36 * p, barmode: "overlay", margin: { t: 22, b: 40, l: 56 }, shapes, annotations,
    xaxis: { title: { text: "ms since the first stage started", font: { size: 10 } }, range: [0, span * 1.01] },
    yaxis: { autorange: "reversed", type: "category", categoryarray: Array.from({ length: p }, (_, s) => `stage ${s}`) },
  });
}

function drawBubble(v, r) {
  const p = r.stages, m = r.microbatches;
  v.formulaLabel.textContent = `formula (p − 1)/(m + p − 1), p = ${p}`;
  v.bubbleNote.textContent = `The same ${p} processes ran the schedule with m = ${r.schedules.join(", ")}. More microbatches shrink the fill and drain against the whole. `
    + "The formula assumes stages of equal cost and instant sends; here stages differ by a layer, a send and a wake-up cost real time, and processes share the cores, "
    + "so the points sit off the curve.";
  const curveM = Array.from({ length: 71 }, (_, i) => 1 + i * 0.1);
  return plot(v.bubble, [
    { type: "scatter", mode: "lines", name: `formula (p − 1)/(m + p − 1), p = ${p}`, x: curveM, y: curveM.map((x) => (p - 1) / (x + p - 1)),
      line: { color: "#6a6f78", width: 2, dash: "dash" }, hovertemplate: "m = %{x:.1f}: %{y:.1%}<extra>formula</extra>" },
    { type: "scatter", mode: "markers+lines", name: "measured here", x: r.runs.map((x) => x.microbatches), y: r.runs.map((x) => x.bubble_measured),
      marker: { size: 9, color: r.runs.map((x) => (x.microbatches === m ? "#b8323f" : STAGE_COLORS[0])) }, line: { color: STAGE_COLORS[0], width: 1 },
      hovertemplate: "m = %{x}: %{y:.1%} idle<extra>measured</extra>" },
  ], { height: 240, margin: { t: 8, b: 44, l: 56 },
    xaxis: { title: { text: "microbatches m", font: { size: 10 } }, dtick: 1, range: [0.7, 8.3] },
    yaxis: { title: { text: "bubble (idle share)", font: { size: 10 } }, tickformat: ".0%", range: [0, 1] } });
}

async function render(v, r) {
  const p = r.stages, m = r.microbatches;
  renderLayers(v, r);
  v.stagesStat.set(p, String(p));
  v.mStat.set(m, String(m));
  v.measured.set(r.bubble_fraction_measured, fmtPct(r.bubble_fraction_measured));
  v.formula.set(r.bubble_fraction_formula, `${fmtPct(r.bubble_fraction_formula)} = ${p - 1}/${m + p - 1}`);
  await drawTimeline(v, r);
  await drawBubble(v, r);
}

// A model with fewer layers than stages cannot be cut that finely (the tiny test model has 2).
function fitStages(v, hello) {
  for (const option of v.stages.options) option.disabled = Number(option.value) > hello.num_layers;
  if (Number(v.stages.value) > hello.num_layers) v.stages.value = String(Math.min(hello.num_layers, OPTIONS.stages.max));
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const life = measuring(root, ctx, {
    job, button: v.again, changed: [v.stages, v.microbatches, v.tokens], charts: [v.timeline, v.bubble],
    onHello: (hello) => fitStages(v, hello),
    measure(run) {
      const x = { stages: Number(v.stages.value), microbatches: Number(v.microbatches.value), tokens: Number(v.tokens.value) };
      if (!Number.isInteger(x.tokens) || x.tokens < OPTIONS.tokens.min || x.tokens > OPTIONS.tokens.max) {
        v.progress.textContent = `Tokens each must be a whole number from ${OPTIONS.tokens.min} to ${OPTIONS.tokens.max}.`;
        return Promise.resolve();
      }
      ctx.setOptions(x, OPTIONS);
      return job.run({ type: "pipeline", ...x, run }, {
        running: `Starting ${x.stages} worker processes…`,
        onProgress: (pr) => `${pr.note}…`,
        render: (r) => render(v, r),
        done: (r) => `Measured on ${r.stages} worker processes, which have exited.`,
      });
    },
  });
  return life.unmount;
}

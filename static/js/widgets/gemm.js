// Section 12, "Batching turns a trickle into a matrix": matrix-multiply time for 1 to 256 rows at
// SmolLM2's own layer shapes, measured on this server through the engine's kernels (core/model/linear.py).
// Left: time per row against rows, one line per shape (falling: a row is nearly free until the
// knee). Right: the roofline from this machine's measured bandwidth and peak, every point on it.

import { describeChart, el, field, scrollBox, select } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtNum } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { measuredAt, measuring, progressLine, threadsOn, view } from "../lib/measure.js";

const OPTIONS = {
  format: { type: "string", default: "fp32", choices: ["fp32", "bf16", "q4_1"] },
  max_rows: { type: "int", default: 256, choices: [64, 128, 256] },
};
const COLORS = ["#2f5fd0", "#1d7a4f", "#d0702f", "#8a3fb8", "#b8323f"];
const ROOF = "#9aa0a8";

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  rowChart: "div.chart.gemm-chart", rowNote: "p.note", roofChart: "div.chart.gemm-chart", roofNote: "p.note",
  threads: ["Threads", "threads", "torch threads used"], machineLine: "p.note.machine",
  speedup: ["64 rows vs 1", "speedup_64", "throughput ratio, gate/up"],
  peak: ["Peak", "peak_gflops", "GFLOP/s, square matmul, best of 3"],
  bandwidth: ["Memory bandwidth", "bandwidth_gb_s", "GB/s read, best of 3"],
  kneeRows: ["Knee", "knee_rows", "rows where gate/up turns compute-bound"], table: "table.gemm-table",
};

function build(opts) {
  const v = {
    format: select([["fp32", "fp32 (the reference)"], ["bf16", "bf16"], ["q4_1", "q4_1 (4-bit, what the chat runs)"]], opts.format, { name: "format", "aria-label": "Weight format" }),
    maxRows: select([64, 128, 256].map((n) => [n, `${n} rows`]), opts.max_rows, { name: "max_rows", "aria-label": "Most rows" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    ...view(VIEW),
  };
  describeChart(v.rowChart, "Time per row against rows", v.rowNote);
  describeChart(v.roofChart, "Roofline", v.roofNote);
  v.nodes = [
    el("div", { class: "controls" }, [field("weights", v.format), field("up to", v.maxRows), v.again]),
    v.progress,
    el("div", { class: "gemm-machine machine-line" }, [v.threads.node, v.machineLine]),
    el("div", { class: "gemm-grid two-up" }, [
      figure("Time per row: one weight read serves every row", ["measured"], [v.rowChart, el("div", { class: "stats" }, [v.speedup.node]), v.rowNote]),
      figure("Roofline of this machine", ["measured", "computed"], [v.roofChart, el("div", { class: "stats" }, [v.peak.node, v.bandwidth.node, v.kneeRows.node]), v.roofNote]),
    ]),
    figure("Each shape of the model", ["measured", "computed"], [scrollBox(el("div", { class: "gemm-scroll" }, [v.table]), "Each shape of the model, scrollable")]),
  ];
  return v;
}

function drawRows(v, r) {
  const data = r.shapes.map((s, i) => {
    const pts = r.points.filter((p) => p.shape === s.name);
    return {
      type: "scatter", mode: "lines+markers", name: `${s.name} ${s.k}→${s.n}`, x: pts.map((p) => p.rows), y: pts.map((p) => p.us_per_row),
      line: { color: COLORS[i % COLORS.length], width: 2 }, marker: { size: 6 },
      customdata: pts.map((p) => [p.ms, p.rows_per_s]),
      hovertemplate: `${s.name}: %{x} rows, %{customdata[0]:.3f} ms a call, %{y:.1f} µs a row, %{customdata[1]:,.0f} rows/s<extra></extra>`,
    };
  });
  return plot(v.rowChart, data, {
    height: 280, showlegend: true, legend: { orientation: "h", y: -0.3, x: 0, font: { size: 10 } },
    margin: { t: 8, b: 80, l: 56 },
    xaxis: { type: "log", tickvals: r.points.filter((p) => p.shape === r.shapes[0].name).map((p) => p.rows), title: { text: "rows (tokens in the batch)", font: { size: 10 } } },
    yaxis: { type: "log", title: { text: "µs per row (log)", font: { size: 10 } } },
  });
}

function drawRoof(v, r) {
  const xs = r.points.map((p) => p.intensity);
  const lo = Math.min(...xs, r.machine_balance) / 2, hi = Math.max(...xs, r.machine_balance) * 2;
  const roofX = [lo, r.machine_balance, hi];
  const roofY = roofX.map((x) => Math.min(r.peak_gflops, r.bandwidth_gb_s * x));
  const data = [{
    type: "scatter", mode: "lines", name: "roof", x: roofX, y: roofY, line: { color: ROOF, width: 2, dash: "dash" },
    hovertemplate: "roof: %{x:.1f} FLOPs/byte → %{y:.1f} GFLOP/s<extra></extra>",
  }].concat(r.shapes.map((s, i) => {
    const pts = r.points.filter((p) => p.shape === s.name);
    return {
      type: "scatter", mode: "markers", name: s.name, x: pts.map((p) => p.intensity), y: pts.map((p) => p.gflop_s),
      marker: { size: 7, color: COLORS[i % COLORS.length] }, customdata: pts.map((p) => p.rows),
      hovertemplate: `${s.name}, %{customdata} rows: %{x:.1f} FLOPs/byte, %{y:.1f} GFLOP/s<extra></extra>`,
    };
  }));
  return plot(v.roofChart, data, {
    height: 280, margin: { t: 8, b: 80, l: 56 },
    xaxis: { type: "log", title: { text: "arithmetic intensity (FLOPs per byte moved)", font: { size: 10 } } },
    yaxis: { type: "log", title: { text: "GFLOP/s (log)", font: { size: 10 } } },
    shapes: [{ type: "line", x0: r.machine_balance, x1: r.machine_balance, yref: "paper", y0: 0, y1: 1, line: { color: ROOF, width: 1, dash: "dot" } }],
    annotations: [{ x: Math.log10(r.machine_balance), y: 1, yref: "paper", text: "knee", showarrow: false, font: { size: 10, color: "#555" }, xanchor: "left" }],
  });
}

function renderTable(v, r) {
  const head = el("tr", {}, ["shape", "K → N", "weights", "1 row", "64 rows", "64 vs 1", "knee"].map((t) => el("th", { text: t })));
  const rows = r.shapes.map((s) => {
    const pts = r.points.filter((p) => p.shape === s.name);
    const one = pts.find((p) => p.rows === 1), sixtyFour = pts.find((p) => p.rows === 64);
    return el("tr", {}, [
      s.name, `${s.k} → ${s.n}`, `${fmtNum(s.weight_bytes / 1e6, 3)} MB`, `${fmtNum(one.ms, 3)} ms`, `${fmtNum(sixtyFour.ms, 3)} ms`,
      `${fmtNum(s.speedup_64, 3)}×`, s.knee_rows === null ? "never" : `${fmtNum(s.knee_rows, 3)} rows`,
    ].map((t) => el("td", { text: t })));
  });
  v.table.replaceChildren(el("thead", {}, [head]), el("tbody", {}, rows));
}

function renderNotes(v, r) {
  v.rowNote.textContent = `${r.format} weights through the engine's own kernels. At one row a call reads the whole matrix for one multiply-add per weight; `
    + `64 rows of gate/up went through at ${fmtNum(r.speedup_64, 3)} times the rows per second of one. `
    + "Past the knee each extra row costs its own arithmetic, and the time per row stops falling.";
  v.roofNote.textContent = `The roof is the lesser of ${fmtNum(r.peak_gflops, 3)} GFLOP/s and ${fmtNum(r.bandwidth_gb_s, 3)} GB/s × intensity; `
    + `they meet at ${fmtNum(r.machine_balance, 3)} FLOPs per byte. An R-row product does 2·R·K·N FLOPs over its weights and rows: `
    + `in ${r.format} that reaches the ridge near ${r.knee_rows === null ? "no row count" : `${fmtNum(r.knee_rows, 3)} rows`}. Points under the roof are the kernels' own losses.`
    + overRoof(r);
}

// Points above the roof: the peak and the bandwidth were timed at other moments than those points,
// and on a shared machine the cores a moment gets move; said, not hidden.
function overRoof(r) {
  const over = r.points.filter((p) => p.gflop_s > Math.min(r.peak_gflops, r.bandwidth_gb_s * p.intensity)).length;
  return over === 0 ? "" : ` ${over} of ${r.points.length} points lie above it: the roof was timed at another moment, `
    + "and on a shared machine the share of the cores a moment gets moves (the peak is a best of 3, not a bound).";
}

async function render(v, r) {
  const m = r.machine;
  v.threads.set(m.threads, `${m.threads} of ${m.cpu_count}`);
  v.machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${threadsOn(m)}, torch ${m.torch}, `
    + `${measuredAt(m)}; each point is the best of up to ${r.repeats} calls. The machine is shared: times move from run to run.`;
  v.peak.set(r.peak_gflops, fmtNum(r.peak_gflops, 3));
  v.bandwidth.set(r.bandwidth_gb_s, fmtNum(r.bandwidth_gb_s, 3));
  v.kneeRows.set(r.knee_rows, r.knee_rows === null ? "never" : fmtNum(r.knee_rows, 3));
  v.speedup.set(r.speedup_64, `${fmtNum(r.speedup_64, 3)}×`);
  renderNotes(v, r);
  renderTable(v, r);
  await Promise.all([drawRows(v, r), drawRoof(v, r)]);
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const life = measuring(root, ctx, {
    job, button: v.again, changed: [v.format, v.maxRows], charts: [v.rowChart, v.roofChart],
    measure(run) {
      ctx.setOptions({ format: v.format.value, max_rows: Number(v.maxRows.value) }, OPTIONS);
      return job.run({ type: "gemm", format: v.format.value, max_rows: Number(v.maxRows.value), run }, {
        running: "Timing the matrix multiplies…",
        onProgress: (p) => `Timing: ${p.note} (${percent(p)})…`,
        render: (r) => render(v, r),
        done: (r) => `Timed ${r.points.length} products: ${r.shapes.length} shapes × ${r.points.length / r.shapes.length} row counts.`,
      });
    },
  });
  return life.unmount;
}

// The benchmark page (/benchmark): plots of the latest `python -m bench` run, drawn from the view the
// server embeds in the page (app/benchmark.py); the tables beside them carry every number with
// data-figure. The root main.bench gets data-state "ready" once every plot is drawn.

import { plot } from "./lib/chart.js";
import { describeChart, scrollBox, setState } from "./lib/dom.js";

const COLORS = {
  "ours fp32": "#8fa8e6", "ours bf16": "#2f5fd0", "ours q4_1": "#12306e",
  "transformers fp32": "#f0b27a", "transformers bf16": "#d9822b", "llama.cpp Q4_1": "#1d7a4f",
};
const AXIS_FONT = { size: 10 };
const VERDICT_COLORS = { yes: "#1d7a4f", no: "#b8323f", "not decided": "#c08a1a" };
const LEGEND = { orientation: "h", yanchor: "bottom", y: 1.02, x: 0, font: { size: 10 } };

// Room above the plot for a legend of `entries` items, which wraps on a narrow screen.
function top(node, entries) {
  const perRow = Math.max(1, Math.floor(node.clientWidth / 150));
  return 16 + 22 * Math.ceil(entries / perRow);
}

const byScenario = (view, rows, scenario) => rows.find((r) => r.scenario === scenario);

// Bars grouped by system, one colour a trace, the legend above them; yTitle names the axis.
function groupedBars(node, traces, yTitle) {
  return plot(node, traces, {
    height: 300 + top(node, traces.length), barmode: "group", showlegend: true, legend: LEGEND,
    margin: { t: top(node, traces.length), b: 70, l: 52 },
    xaxis: { tickfont: { size: 9 }, automargin: true },
    yaxis: { title: { text: yTitle, font: AXIS_FONT }, rangemode: "tozero" },
  });
}

function decodeChart(view, node) {
  const names = view.systems.map((s) => s.name);
  const alone = byScenario(view, view.single, "decode_1");
  const busy = byScenario(view, view.single, "decode_1_contended");
  const limits = Object.fromEntries(view.weights.map((w) => [w.system, w.limit]));
  const traces = [];
  if (alone) traces.push({ type: "bar", name: "alone", x: names, y: alone.cells.map((c) => c.value), marker: { color: "#2f5fd0" },
    hovertemplate: "%{x}: %{y:.1f} tok/s alone<extra></extra>" });
  if (busy) traces.push({ type: "bar", name: "beside a busy process", x: names, y: busy.cells.map((c) => c.value),
    marker: { color: "#9fb3e6" }, hovertemplate: "%{x}: %{y:.1f} tok/s beside a busy process<extra></extra>" });
  const limited = names.filter((n) => limits[n]);
  if (limited.length) traces.push({ type: "scatter", mode: "markers", name: "bandwidth limit", x: limited, y: limited.map((n) => limits[n]),
    marker: { symbol: "line-ew-open", size: 28, color: "#1d1f23", line: { width: 2, color: "#1d1f23" } }, hovertemplate: "%{x}: at most %{y:.0f} tok/s<extra></extra>" });
  return groupedBars(node, traces, "decode, tokens per second");
}

function prefillChart(view, node) {
  const names = view.systems.map((s) => s.name);
  const traces = [["prefill_512", "512-token prompt", "#d9822b"], ["prefill_4096", "4,096-token prompt", "#f0c08f"]]
    .map(([scenario, label, color]) => [byScenario(view, view.single, scenario), label, color])
    .filter(([row]) => row)
    .map(([row, label, color]) => ({ type: "bar", name: label, x: names, y: row.cells.map((c) => c.value),
      marker: { color }, hovertemplate: `%{x}: %{y:.0f} tok/s, ${label}<extra></extra>` }));
  return groupedBars(node, traces, "prefill, prompt tokens per second");
}

// Per system across the concurrency levels it ran at (a system that skipped a level has a gap).
function series(view, pick) {
  return view.systems.map((s, i) => ({
    name: s.name, x: view.serve.map((r) => r.n), y: view.serve.map((r) => pick(r.cells[i])),
  })).filter((t) => t.y.some((v) => v !== null && v !== undefined));
}

function serveChart(view, node) {
  const traces = series(view, (c) => c.value).map((t) => ({ ...t, type: "scatter", mode: "lines+markers",
    line: { color: COLORS[t.name], width: 2 }, marker: { color: COLORS[t.name], size: 7 },
    hovertemplate: `${t.name}: %{x} requests, %{y:.0f} tok/s<extra></extra>` }));
  return plot(node, traces, {
    height: 300 + top(node, traces.length), showlegend: true, legend: LEGEND, margin: { t: top(node, traces.length), b: 44, l: 52 },
    xaxis: { title: { text: "requests at once", font: AXIS_FONT }, tickvals: view.serve.map((r) => r.n) },
    yaxis: { title: { text: "output tokens per second, all", font: AXIS_FONT }, rangemode: "tozero" },
  });
}

function latencyChart(view, node) {
  const traces = [];
  for (const [metric, axis, scale] of [["ttft", "", 1], ["tpot", "2", 1000]]) {
    for (const [pct, dash] of [["p50", "solid"], ["p99", "dot"]]) {
      for (const t of series(view, (c) => (c.latency[`${metric}_${pct}_s`] ?? null))) {
        traces.push({ type: "scatter", mode: "lines+markers", name: t.name, legendgroup: t.name,
          showlegend: metric === "ttft" && pct === "p50", x: t.x, y: t.y.map((v) => (v === null ? null : v * scale)),
          xaxis: `x${axis}`, yaxis: `y${axis}`, line: { color: COLORS[t.name], width: 1.5, dash }, marker: { color: COLORS[t.name], size: 5 },
          hovertemplate: `${t.name}: %{x} requests, ${metric.toUpperCase()} ${pct} %{y:.${scale === 1 ? 2 : 0}f} ${scale === 1 ? "s" : "ms"}<extra></extra>` });
      }
    }
  }
  const ticks = view.serve.map((r) => r.n);
  return plot(node, traces, {
    height: 300 + top(node, view.systems.length), showlegend: true, legend: LEGEND,
    margin: { t: top(node, view.systems.length), b: 44, l: 52, r: 12 },
    xaxis: { domain: [0, 0.44], tickvals: ticks, title: { text: "requests (solid p50, dotted p99)", font: AXIS_FONT } },
    yaxis: { title: { text: "TTFT (s)", font: AXIS_FONT }, rangemode: "tozero" },
    xaxis2: { domain: [0.58, 1], tickvals: ticks, anchor: "y2", title: { text: "requests", font: AXIS_FONT } },
    yaxis2: { anchor: "x2", title: { text: "TPOT (ms)", font: AXIS_FONT }, rangemode: "tozero" },
  });
}

// A target's bar label: its number in the table's order and its name, cut to `chars`.
const targetLabel = (t, i, chars) => `${i + 1}. ${t.target.length > chars ? `${t.target.slice(0, chars - 1)}…` : t.target}`;

function targetsChart(view, node) {
  const rows = view.targets.filter((t) => t.measured !== null);
  const narrow = node.clientWidth < 600;   // a phone: shorter labels leave the bars room, the axis title in two lines
  const labels = rows.map((t, i) => targetLabel(t, i, narrow ? 22 : 44));
  const axisTitle = narrow ? "ratio: 1x is as fast as<br>the peer or the limit" : "ratio (1x = as fast as the peer or the limit)";
  // the whisker: each line's spread over its rounds, from the lowest ratio to the highest
  const spread = (t, side) => (t.spread ? Math.abs(t.spread[side] - t.measured) : 0);
  return plot(node, [
    { type: "bar", orientation: "h", name: "median of the rounds", y: labels, x: rows.map((t) => t.measured),
      marker: { color: rows.map((t) => VERDICT_COLORS[t.met] ?? "#8b8f97") },
      error_x: { type: "data", symmetric: false, array: rows.map((t) => spread(t, 1)),
        arrayminus: rows.map((t) => spread(t, 0)), color: "#1d1f23", thickness: 1.5, width: 4 },
      customdata: rows.map((t) => [t.target, t.met, t.spread ? `${t.spread[0].toFixed(2)}–${t.spread[1].toFixed(2)}x` : "one value"]),
      hovertemplate: "%{customdata[0]}: %{x:.2f}x (spread %{customdata[2]}), met: %{customdata[1]}<extra></extra>" },
    { type: "scatter", mode: "markers", name: "goal", y: labels, x: rows.map((t) => t.goal),
      marker: { symbol: "line-ns-open", size: 18, color: "#1d1f23", line: { width: 2.5, color: "#1d1f23" } }, hovertemplate: "goal %{x}x<extra></extra>" },
  ], {
    height: 60 + 34 * rows.length + top(node, 2), showlegend: true, legend: LEGEND,
    margin: { t: top(node, 2), b: narrow ? 56 : 40, l: 10, r: 12 },
    xaxis: { title: { text: axisTitle, font: AXIS_FONT }, rangemode: "tozero" },
    yaxis: { autorange: "reversed", automargin: true, tickfont: { size: 10 } },
  });
}

// A chart is an image to a screen reader, summed up by its section's prose and table of numbers.
function describe(node) {
  const section = node.closest("section");
  const parts = [section?.querySelector(".prose"), section?.querySelector("table")].filter(Boolean);
  parts.forEach((part, i) => { if (!part.id) part.id = `${node.id}-summary-${i}`; });
  describeChart(node, node.getAttribute("aria-label") || node.id);
  if (parts.length) node.setAttribute("aria-describedby", parts.map((p) => p.id).join(" "));
}

async function main() {
  const root = document.querySelector("main.bench");
  const source = document.getElementById("bench-view");
  if (!root || !source) return;
  try {
    const view = JSON.parse(source.textContent);
    const draw = [["chart-decode", decodeChart], ["chart-prefill", prefillChart], ["chart-serve", serveChart],
      ["chart-latency", latencyChart], ["chart-targets", targetsChart]];
    await Promise.all(draw.map(([id, fn]) => fn(view, document.getElementById(id))));
    for (const [id] of draw) describe(document.getElementById(id));
    for (const box of root.querySelectorAll(".bench-scroll")) {
      scrollBox(box, `Table: ${box.closest("section")?.querySelector("h2")?.textContent ?? "the numbers"}`);
    }
    setState(root, "ready");
  } catch (err) {
    console.error(err);
    setState(root, "error", `The plots could not be drawn: ${err.message}`);
  }
}

main();

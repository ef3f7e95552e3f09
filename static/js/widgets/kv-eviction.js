// Section 20, "Efficiency tricks": KV eviction on the real model. A long held-out text's perplexity
// with full attention, and with only a window of the last w tokens' keys and values, alone and with
// a few attention sinks (the first tokens, kept as StreamingLLM keeps them), beside the KV memory
// each keeps. A chart of perplexity against the window, and the table of every figure.

import { describeChart, el, field } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { fmtBytes, fmtNum } from "../lib/format.js";
import { percent } from "../lib/job.js";
import { measuredAt, measuring, measuringView, numberInput, progressLine, threadsOn, view } from "../lib/measure.js";

const WINDOWS = [32, 64, 128, 256, 512];

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  windows: { type: "string", default: "64,256", maxLength: 40 },
  sinks: { type: "int", default: 4, min: 1, max: 16 },
};

const COLORS = { window: "#d0702f", sinks: "#2f5fd0", full: "#777777" };

const VIEW = { machineLine: "p.note.machine", chart: "div.chart.kve-chart", chartNote: "p.note", tableNote: "p.note",
  fullPpl: ["Full attention", "perplexity_full", "perplexity, every key kept", "live"],
  fullBytes: ["KV kept", "kv_bytes_full", "the whole text's keys and values", "computed"] };

// "64,128" -> [64, 128] when every size is one the server takes; null otherwise.
function parseWindows(text) {
  const sizes = text.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
  if (!sizes.length || sizes.some((w) => !WINDOWS.includes(w)) || new Set(sizes).size !== sizes.length) return null;
  return sizes.sort((a, b) => a - b);
}

function build(opts) {
  const v = {
    windows: el("input", { type: "text", class: "text-input", name: "windows", value: opts.windows, "aria-label": "Window sizes" }),
    sinks: numberInput("sinks", "Attention sinks", opts.sinks, OPTIONS.sinks),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }), progress: progressLine(),
    table: el("table", { class: "kve-table figure-table" }), ...view(VIEW),
  };
  describeChart(v.chart, "Perplexity against the window size", v.chartNote);
  v.nodes = [
    el("div", { class: "controls" }, [field(`windows (of ${WINDOWS.join(", ")})`, v.windows), field("sinks", v.sinks), v.again]),
    v.progress, v.machineLine,
    figure("What a window costs", ["live", "computed"], [
      el("div", { class: "stats" }, [v.fullPpl.node, v.fullBytes.node]), v.chart, v.chartNote,
      el("div", { class: "kve-scroll", tabindex: "0", role: "region", "aria-label": "Every window's figures" }, [v.table]), v.tableNote,
    ]),
  ];
  return v;
}

function cell(key, value, text) {
  return el("td", {}, [el("span", { "data-figure": key, "data-value": String(value), text })]);
}

function renderTable(v, r) {
  const head = el("tr", {}, ["window", "perplexity: window only", `perplexity: ${r.sinks} sinks + window`, "KV kept"]
    .map((h) => el("th", { scope: "col", text: h })));
  const rows = r.rows.map((row) => el("tr", {}, [
    el("th", { scope: "row", text: `${row.window} tokens` }),
    cell(`perplexity_window_${row.window}_nosink`, row.perplexity_nosink, fmtNum(row.perplexity_nosink, 4)),
    cell(`perplexity_window_${row.window}`, row.perplexity, fmtNum(row.perplexity, 4)),
    cell(`kv_bytes_window_${row.window}`, row.kv_bytes, `${fmtBytes(row.kv_bytes)} (${fmtNum(row.kept_tokens)} tokens)`),
  ]));
  v.table.replaceChildren(el("thead", {}, [head]), el("tbody", {}, rows));
}

function renderChart(v, r) {
  const x = r.rows.map((row) => row.window);
  const narrow = v.chart.clientWidth < 520;
  const line = (name, y, color, dash) => ({ type: "scatter", mode: "lines+markers", name, x, y, line: { color, width: 2, dash },
    hovertemplate: `${name}: window %{x}, perplexity %{y:.3f}<extra></extra>` });
  return plot(v.chart, [
    line("window only", r.rows.map((row) => row.perplexity_nosink), COLORS.window, "solid"),
    line(`${r.sinks} sinks + window`, r.rows.map((row) => row.perplexity), COLORS.sinks, "solid"),
    line("full attention", x.map(() => r.perplexity_full), COLORS.full, "dot"),
  ], {
    // the legend sits above the plot, anchored by its bottom; narrow, it wraps: room for its lines
    height: narrow ? 320 : 260, showlegend: true, legend: { orientation: "h", yanchor: "bottom", y: 1.02, x: 0, font: { size: 10 } },
    margin: { t: narrow ? 64 : 30, b: 44, l: 52 },
    xaxis: { title: { text: "window (tokens kept besides the sinks)", font: { size: 10 } }, type: "log", tickvals: x },
    yaxis: { title: { text: "perplexity (log scale)", font: { size: 10 } }, type: "log" },
  });
}

function renderNotes(v, r) {
  const last = r.rows[r.rows.length - 1], first = r.rows[0];
  v.chartNote.textContent = `Perplexity of ${fmtNum(r.tokens)} held-out tokens (${r.text}). With a window of `
    + `${first.window} tokens alone it is ${fmtNum(first.perplexity_nosink, 4)}; keeping the first ${r.sinks} tokens as well brings it to `
    + `${fmtNum(first.perplexity, 4)}, against ${fmtNum(r.perplexity_full, 4)} with every key.`
    + (r.rows.length > 1 ? ` At ${last.window} tokens: ${fmtNum(last.perplexity_nosink, 4)} and ${fmtNum(last.perplexity, 4)}.` : "");
  v.tableNote.textContent = `KV kept: (sinks + window) tokens × ${fmtNum(r.kv_bytes_per_token)} bytes a token (${r.kv_cache_dtype ?? "fp32"} keys and values, every layer, as this server's pool keeps them). `
    + "The engine applies the rule as a mask in attention (its kv_window and kv_sink_tokens settings) and keeps the blocks, "
    + `so this is what an engine that frees them would hold. This server runs with ${r.engine_window ? `a window of ${r.engine_window} and ${r.engine_sinks} sinks` : "full attention"}.`;
}

async function render(v, r) {
  const m = r.machine;
  v.machineLine.textContent = `Computed here on the serving weights in fp32: ${m.system} ${m.processor}, ${threadsOn(m)}, ${measuredAt(m)}.`;
  v.fullPpl.set(r.perplexity_full, fmtNum(r.perplexity_full, 4));
  v.fullBytes.set(r.kv_bytes_full, fmtBytes(r.kv_bytes_full));
  renderTable(v, r);
  renderNotes(v, r);
  await renderChart(v, r);
}

export function mount(root, ctx) {
  const { v, job } = measuringView(root, ctx, OPTIONS, build);
  const life = measuring(root, ctx, {
    job, changed: [v.windows, v.sinks], charts: [v.chart],
    measure() {
      const windows = parseWindows(v.windows.value), sinks = Number(v.sinks.value);
      if (!windows || !Number.isInteger(sinks) || sinks < 1 || sinks > 16) {
        v.progress.textContent = `Windows: sizes from ${WINDOWS.join(", ")}, comma-separated; sinks: 1 to 16.`;
        return Promise.resolve();
      }
      ctx.setOptions({ windows: windows.join(","), sinks }, OPTIONS);
      return job.run({ type: "kv_eviction", windows, sinks }, {
        running: "Reading the long text with full attention…",
        onProgress: (p) => `Reading the text: ${p.note} (${percent(p)})…`,
        render: (r) => render(v, r),
        done: (r) => `${r.rows.length} window${r.rows.length === 1 ? "" : "s"}, with and without ${r.sinks} sinks, on ${fmtNum(r.tokens)} tokens.`,
      });
    },
  });
  return life.unmount;
}

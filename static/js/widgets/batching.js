// Section 14, "Static against continuous batching": one workload (prompt and output lengths the
// reader edits) run through both schedulers on engines beside the serving one. Each side is the
// engine's own step trace as a grid: rows are steps, columns are batch slots; P a prefill, Dn the
// n-th decode token, · a slot held but idle. Below: steps, idle slots, time, and when each request
// finished, with the check that both ways produced the same tokens.

import { el, field, scrollBox } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuredAt, measuring, progressLine, threadsOn, view } from "../lib/measure.js";

const MAX_REQUESTS = 8, MAX_PROMPT = 64, MAX_OUTPUT = 32, MAX_SLOTS = 8;
const DEFAULT_WORKLOAD = "12:4,40:16,8:8,24:2,16:12,30:6";
const MODES = ["static", "continuous"];

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  workload: { type: "string", default: DEFAULT_WORKLOAD, maxLength: 200 },
  slots: { type: "int", default: 3, min: 1, max: MAX_SLOTS },
};

// "12:4,40:16" -> [[12, 4], [40, 16]], or a message saying what is wrong.
function parseWorkload(text) {
  const parts = text.split(",").map((s) => s.trim()).filter(Boolean);
  if (parts.length < 1 || parts.length > MAX_REQUESTS) return { error: `Give 1 to ${MAX_REQUESTS} requests.` };
  const pairs = [];
  for (const part of parts) {
    const m = /^(\d+)\s*:\s*(\d+)$/.exec(part);
    const p = m && Number(m[1]), n = m && Number(m[2]);
    if (!m || p < 1 || p > MAX_PROMPT || n < 1 || n > MAX_OUTPUT) {
      return { error: `"${part}": each request is prompt:output, prompt 1–${MAX_PROMPT} tokens, output 1–${MAX_OUTPUT}.` };
    }
    pairs.push([p, n]);
  }
  return { pairs };
}

// Each side's figure keys, written out (docs/widgets.md lists them; a test finds each one here).
const KEYS = {
  static: { steps: "static_steps", idle: "static_idle_slots", total: "static_total_ms" },
  continuous: { steps: "continuous_steps", idle: "continuous_idle_slots", total: "continuous_total_ms" },
};

// One side: its three tiles, its grid of steps by slots (in a box that scrolls) and its finish list.
function buildSide(mode) {
  const keys = KEYS[mode];
  const side = {
    steps: stat("Steps", { key: keys.steps, note: "engine iterations" }),
    idle: stat("Idle slots", { key: keys.idle, note: "slot-steps with no work" }),
    total: stat("Total time", { key: keys.total, note: "sum of step times" }),
    grid: el("div", { class: "bt-grid", role: "table", "aria-label": `${mode} batching: steps by slots` }),
    done: el("ol", { class: "bt-done" }),
  };
  side.node = figure(mode === "static" ? "Static batching" : "Continuous batching", ["live", "measured"], [
    el("div", { class: "stats" }, [side.steps.node, side.idle.node, side.total.node]),
    scrollBox(el("div", { class: "bt-scroll" }, [side.grid]), `${mode} batching's steps, scrollable`),
    el("p", { class: "bt-label", text: "finished (request: step, time)" }), side.done,
  ]);
  return side;
}

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  machineLine: "p.note.machine", verdict: "p.bt-verdict",
};

function build(opts) {
  const v = {
    workload: el("input", { type: "text", class: "text-input", name: "workload", value: opts.workload, "aria-label": "Workload: prompt:output tokens per request" }),
    slots: el("input", { type: "number", min: 1, max: MAX_SLOTS, step: 1, name: "slots", value: String(opts.slots), "aria-label": "Batch slots" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    sides: Object.fromEntries(MODES.map((mode) => [mode, buildSide(mode)])),
    ...view(VIEW),
  };
  v.nodes = [
    el("div", { class: "controls" }, [field("requests (prompt:output tokens)", v.workload), field("slots", v.slots), v.again]),
    v.progress, v.machineLine, v.verdict,
    el("div", { class: "bt-sides" }, MODES.map((mode) => v.sides[mode].node)),
    el("p", { class: "note", text: "P: prefill (a chunk of at most 64 prompt tokens; the last chunk makes the first token). Dn: the n-th output token. "
      + "·: the slot is held by a finished request of a static batch, waiting for the batch's longest member. "
      + "Empty: no request left to take the slot." }),
  ];
  return v;
}

function cell(c) {
  if (!c) return el("span", { class: "bt-cell bt-empty", role: "cell", text: "" });
  return el("span", { class: `bt-cell bt-${c.kind} bt-r${c.request % 8}`, role: "cell", text: `${c.label}`,
    title: `request ${c.request + 1}: ${c.kind}${c.tokens ? `, ${c.tokens} token(s)` : ""}` }, [el("sub", { text: String(c.request + 1) })]);
}

function renderGrid(side, run, numSlots) {
  const head = el("div", { class: "bt-row bt-head", role: "row" }, [el("span", { class: "bt-step", role: "columnheader", text: "step" }),
    ...Array.from({ length: numSlots }, (_, i) => el("span", { class: "bt-cell", role: "columnheader", text: `slot ${i + 1}` }))]);
  const rows = run.trace.map((row, i) => el("div", { class: "bt-row", role: "row" }, [
    el("span", { class: "bt-step", role: "rowheader", text: String(i + 1), title: `${fmtMs(row.ms)}` }), ...row.cells.map(cell),
  ]));
  side.grid.replaceChildren(head, ...rows);
}

function renderSide(side, run, r) {
  side.steps.set(run.steps, fmtNum(run.steps));
  side.idle.set(run.idle_slots, fmtNum(run.idle_slots));
  side.total.set(run.total_ms, fmtMs(run.total_ms));
  renderGrid(side, run, r.slots);
  side.done.replaceChildren(...run.requests.map((q) => el("li", {
    text: `request ${q.index + 1} (${r.requests[q.index][0]}+${r.requests[q.index][1]}): step ${q.done_step}, ${fmtMs(q.done_ms)}`,
  })));
}

function render(v, r) {
  const m = r.machine;
  v.machineLine.textContent = `Measured here: ${m.processor}, ${threadsOn(m)}, `
    + `${measuredAt(m)}, on two engines beside the serving one.`;
  for (const mode of MODES) renderSide(v.sides[mode], r[mode], r);
  const saved = r.static_steps - r.continuous_steps;
  v.verdict.textContent = (r.same_tokens ? "Same tokens both ways (greedy). " : "The tokens differ between the two runs. ")
    + `Continuous batching took ${r.continuous_steps} steps against ${r.static_steps} (${saved >= 0 ? saved + " fewer" : -saved + " more"}), `
    + `with ${r.continuous_idle_slots} idle slot-steps against ${r.static_idle_slots}.`;
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress });
  const life = measuring(root, ctx, {
    job, button: v.again, typed: [v.workload], changed: [v.slots],
    measure(run) {
      const parsed = parseWorkload(v.workload.value);
      const n = Number(v.slots.value);
      if (parsed.error) { v.progress.textContent = parsed.error; return Promise.resolve(); }
      if (!Number.isInteger(n) || n < 1 || n > MAX_SLOTS) { v.progress.textContent = `Slots must be 1 to ${MAX_SLOTS}.`; return Promise.resolve(); }
      ctx.setOptions({ workload: v.workload.value.trim(), slots: n }, OPTIONS);
      return job.run({ type: "batching", requests: parsed.pairs, slots: n, run }, {
        running: "Running the workload both ways…",
        onProgress: (p) => `${p.note}…`,
        render: (r) => render(v, r),
        done: (r) => `${r.requests.length} requests, ${r.slots} slots.`,
      });
    },
  });
  return life.unmount;
}

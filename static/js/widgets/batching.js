// Section 14, "Static against continuous batching": one workload (prompt and output lengths the
// reader edits) run through both schedulers on engines beside the serving one. Each side is the
// engine's own step trace as a grid: rows are steps, columns are batch slots; P a prefill, Dn the
// n-th decode token, · a slot held but idle. Below: steps, idle slots, time, and when each request
// finished, with the check that both ways produced the same tokens.

import { el, field, debounce } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";

const MAX_REQUESTS = 8, MAX_PROMPT = 64, MAX_OUTPUT = 32, MAX_SLOTS = 8;
const DEFAULT_WORKLOAD = "12:4,40:16,8:8,24:2,16:12,30:6";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { run: 0 };
  const cleanups = [];

  const workload = el("input", { type: "text", class: "text-input", name: "workload", "aria-label": "Workload: prompt:output tokens per request" });
  workload.value = opts.workload;
  const slots = el("input", { type: "number", min: 1, max: MAX_SLOTS, step: 1, name: "slots", "aria-label": "Batch slots" });
  slots.value = String(opts.slots);
  const again = el("button", { type: "button", class: "primary", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress });
  const machineLine = el("p", { class: "note machine" });
  const verdict = el("p", { class: "bt-verdict" });

  const sides = {};
  const KEYS = {
    static: { steps: "static_steps", idle: "static_idle_slots", total: "static_total_ms" },
    continuous: { steps: "continuous_steps", idle: "continuous_idle_slots", total: "continuous_total_ms" },
  };
  for (const mode of ["static", "continuous"]) {
    const steps = stat("Steps", { key: KEYS[mode].steps, note: "engine iterations" });
    const idle = stat("Idle slots", { key: KEYS[mode].idle, note: "slot-steps with no work" });
    const total = stat("Total time", { key: KEYS[mode].total, note: "sum of step times" });
    const grid = el("div", { class: "bt-grid", "aria-label": `${mode} batching: steps by slots` });
    const done = el("ol", { class: "bt-done" });
    sides[mode] = { steps, idle, total, grid, done };
  }

  root.append(
    el("div", { class: "controls" }, [
      field("requests (prompt:output tokens)", workload), field("slots", slots), again,
    ]),
    progress, machineLine, verdict,
    el("div", { class: "bt-sides" }, ["static", "continuous"].map((mode) => {
      const s = sides[mode];
      return figure(mode === "static" ? "Static batching" : "Continuous batching", ["live", "measured"], [
        el("div", { class: "stats" }, [s.steps.node, s.idle.node, s.total.node]),
        el("div", { class: "bt-scroll" }, [s.grid]),
        el("p", { class: "bt-label", text: "finished (request: step, time)" }), s.done,
      ]);
    })),
    el("p", { class: "note", text: "P: prefill (a chunk of at most 64 prompt tokens; the last chunk makes the first token). Dn: the n-th output token. "
      + "·: the slot is held by a finished request of a static batch, waiting for the batch's longest member. "
      + "Empty: no request left to take the slot." }),
  );

  function drawGrid(side, run, numSlots) {
    const head = el("div", { class: "bt-row bt-head" }, [el("span", { class: "bt-step", text: "step" }),
      ...Array.from({ length: numSlots }, (_, i) => el("span", { class: "bt-cell", text: `slot ${i + 1}` }))]);
    const rows = run.trace.map((row, i) => el("div", { class: "bt-row" }, [
      el("span", { class: "bt-step", text: String(i + 1), title: `${fmtMs(row.ms)}` }),
      ...row.cells.map((c) => c
        ? el("span", { class: `bt-cell bt-${c.kind} bt-r${c.request % 8}`, text: `${c.label}`,
          title: `request ${c.request + 1}: ${c.kind}${c.tokens ? `, ${c.tokens} token(s)` : ""}` },
          [el("sub", { text: String(c.request + 1) })])
        : el("span", { class: "bt-cell bt-empty", text: "" })),
    ]));
    side.grid.replaceChildren(head, ...rows);
  }

  function render(r) {
    const m = r.machine;
    machineLine.textContent = `Measured here: ${m.processor}, ${m.threads} torch threads on ${m.cpu_count} CPU cores, `
      + `at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}, on two engines beside the serving one.`;
    for (const mode of ["static", "continuous"]) {
      const run = r[mode], side = sides[mode];
      side.steps.set(run.steps, fmtNum(run.steps));
      side.idle.set(run.idle_slots, fmtNum(run.idle_slots));
      side.total.set(run.total_ms, fmtMs(run.total_ms));
      drawGrid(side, run, r.slots);
      side.done.replaceChildren(...run.requests.map((q) => el("li", {
        text: `request ${q.index + 1} (${r.requests[q.index][0]}+${r.requests[q.index][1]}): step ${q.done_step}, ${fmtMs(q.done_ms)}`,
      })));
    }
    const saved = r.static_steps - r.continuous_steps;
    verdict.textContent = (r.same_tokens ? "Same tokens both ways (greedy). " : "The tokens differ between the two runs. ")
      + `Continuous batching took ${r.continuous_steps} steps against ${r.static_steps} (${saved >= 0 ? saved + " fewer" : -saved + " more"}), `
      + `with ${r.continuous_idle_slots} idle slot-steps against ${r.static_idle_slots}.`;
  }

  function sync() {
    ctx.setOptions({ workload: workload.value.trim(), slots: Number(slots.value) }, OPTIONS);
  }

  function measure() {
    const parsed = parseWorkload(workload.value);
    const n = Number(slots.value);
    if (parsed.error) { progress.textContent = parsed.error; return Promise.resolve(); }
    if (!Number.isInteger(n) || n < 1 || n > MAX_SLOTS) { progress.textContent = `Slots must be 1 to ${MAX_SLOTS}.`; return Promise.resolve(); }
    sync();
    return job.run({ type: "batching", requests: parsed.pairs, slots: n, run: state.run }, {
      running: "Running the workload both ways…",
      onProgress: (p) => `${p.note}…`,
      render,
      done: (r) => `${r.requests.length} requests, ${r.slots} slots.`,
    });
  }

  const onInput = debounce(measure, 700);
  workload.addEventListener("input", onInput);
  slots.addEventListener("change", measure);
  again.addEventListener("click", () => { state.run += 1; measure(); });
  cleanups.push(ctx.connected(() => measure()));
  return () => {
    onInput.cancel();
    job.stop();
    cleanups.forEach((fn) => fn());
    root.replaceChildren();
  };
}

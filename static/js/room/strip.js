// The room's step strip, in the style of the batching widget (section 14): rows are engine steps,
// newest at the top; columns are the batch's slots. A cell is coloured by the student whose
// request filled the slot: solid with "P" for a prefill chunk, lighter with "Dn" for a decode
// producing the n-th token, an outline with "·" for a slot held but idle (static batching keeps
// finished requests' slots until the batch drains), dashed and empty for no request at all.
// Over each row: the batch size (slots that did work) and the step time. Small pure functions:
// each takes data and returns DOM; names go in with textContent only.

import { el } from "../lib/dom.js";
import { blend, textOn } from "../lib/color.js";
import { fmtMs } from "../lib/format.js";
import { busySlots } from "./model.js";

// Twelve hues far apart, dark enough for white text or light enough for dark text (textOn picks).
export const PALETTE = [
  [47, 95, 208], [214, 96, 38], [29, 122, 79], [170, 52, 150], [196, 160, 0], [0, 139, 160],
  [200, 40, 60], [110, 80, 200], [120, 150, 40], [140, 90, 40], [230, 120, 170], [70, 70, 70],
];

// name -> palette index, by the order given (joining order), so a student keeps one colour.
export function colourMap(names) {
  return new Map(names.map((name, i) => [name, i % PALETTE.length]));
}

// The colour of a student (a palette index), or the first colour for a name not in the map.
export function colourOf(colours, name) {
  return PALETTE[colours.get(name) ?? 0];
}

const css = (rgb, alpha = 1) => `rgba(${rgb.join(",")},${alpha})`;

// The label of a busy or idle slot: P (prefill, with its tokens in the title), Dn, or ·.
function slotLabel(slot) {
  if (slot.kind === "prefill") return slot.recompute ? "P↻" : "P";
  if (slot.kind === "decode") return `D${slot.output_index ?? ""}`;
  return "·";
}

function slotTitle(slot) {
  const what = slot.kind === "prefill" ? `prefill, ${slot.num_tokens} prompt token${slot.num_tokens === 1 ? "" : "s"}`
    : slot.kind === "decode" ? `decode, token ${slot.output_index ?? "?"}` : "idle: slot held, no work";
  return slot.student === null || slot.student === undefined ? `${what} (a request the room no longer names)`
    : `${slot.student}: ${what} (request ${slot.request})`;
}

// One slot of one step. opts.colours: colourMap; opts.mine: the viewer's name (student page).
export function slotCell(slot, opts) {
  if (!slot) return el("span", { class: "rs-cell rs-empty", role: "cell", "data-kind": "empty", title: "empty slot" });
  const rgb = colourOf(opts.colours, slot.student);
  const fill = slot.kind === "prefill" ? rgb : slot.kind === "decode" ? blend(rgb, 0.55) : null;
  const mine = opts.mine !== undefined && opts.mine !== null && slot.student === opts.mine;
  const cell = el("span", {
    class: `rs-cell rs-${slot.kind}${mine ? " rs-mine" : ""}${opts.mine && !mine ? " rs-other" : ""}`,
    role: "cell", title: slotTitle(slot),
    "data-kind": slot.kind, "data-student": slot.student, "data-request": slot.request,
  }, [el("span", { class: "rs-who", text: slot.student }), el("span", { class: "rs-what", text: slotLabel(slot) })]);
  if (fill) {
    cell.style.background = css(fill);
    cell.style.color = textOn(fill);
  } else {
    cell.style.borderColor = css(rgb);
  }
  return cell;
}

// The head of a row: step number, batch size (slots that did work), step time.
export function stepHead(step) {
  const batch = busySlots(step).length;
  return el("span", { class: "rs-head", role: "rowheader", title: `step ${step.step}: ${batch} request${batch === 1 ? "" : "s"} in the batch, ${fmtMs(1000 * step.duration_s)}` }, [
    el("span", { class: "rs-step", text: `#${step.step}` }),
    el("span", { class: "rs-batch", text: `×${batch}` }),
    el("span", { class: "rs-time", text: fmtMs(1000 * step.duration_s) }),
  ]);
}

// One step as a row of slots, `slots` wide (a step with fewer slots is padded with empties).
export function stepRow(step, slots, opts) {
  const cells = (step.slots ?? []).map((s) => slotCell(s, opts));
  while (cells.length < slots) cells.push(slotCell(null, opts));
  const students = new Set(busySlots(step).map((s) => s.student));
  return el("div", {
    class: "rs-row", role: "row", "data-step": String(step.step),
    "data-batch": String(busySlots(step).length), "data-students": String(students.size),
  }, [stepHead(step), el("span", { class: "rs-cells" }, cells)]);
}

// The column heads: "step · batch · time", then the slots' numbers 1..n (a number alone fits a
// narrow column; its label says "slot n").
export function stripHead(slots) {
  return el("div", { class: "rs-row rs-columns", role: "row" }, [
    el("span", { class: "rs-head", role: "columnheader", text: "step · batch · time" }),
    el("span", { class: "rs-cells" }, Array.from({ length: slots }, (_, i) => el("span", { class: "rs-cell rs-slot", role: "columnheader", "aria-label": `slot ${i + 1}`, title: `slot ${i + 1}`, text: String(i + 1) }))),
  ]);
}

// The widest step among these (or the room's max_num_seqs): the strip's number of columns.
export function stripWidth(steps, settings) {
  return Math.max(1, settings?.max_num_seqs ?? 1, ...steps.map((s) => (s.slots ?? []).length));
}

// The whole strip, newest step first; at most `limit` rows.
export function stripRows(steps, opts, limit = steps.length) {
  const slots = stripWidth(steps, opts.settings);
  const rows = steps.slice(-limit).reverse().map((s) => stepRow(s, slots, opts));
  return [stripHead(slots), ...rows];
}

// The legend: what a solid, light, outlined and dashed cell mean.
export function stripLegend() {
  return el("p", { class: "rs-legend" }, [
    el("span", { class: "rs-cell rs-prefill rs-key", text: "P" }), " prefill chunk ",
    el("span", { class: "rs-cell rs-decode rs-key", text: "Dn" }), " decode, n-th token ",
    el("span", { class: "rs-cell rs-idle rs-key", text: "·" }), " slot held, idle ",
    el("span", { class: "rs-cell rs-empty rs-key" }), " empty slot",
  ]);
}

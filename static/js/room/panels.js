// The room's panels beside the step strip, as small pure render functions of the view model
// (model.js): the four badged figures and the running count in words, the live batch (one row
// per request: name, state, prompt tokens, tokens from the prefix cache, tokens generated, TTFT,
// TPOT, time waited), the KV pool per student, and the waiting queue. Names with textContent only.

import { el } from "../lib/dom.js";
import { stat } from "../lib/figures.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { stateText } from "./model.js";
import { colourOf } from "./strip.js";

// The four figures (docs: the contract's data-figure keys), each badged "live model".
const FIGURES = [
  ["students", "Students", "room_students", "joined this room"],
  ["requests", "Requests", "room_requests", "sent by the room"],
  ["steps", "Engine steps", "room_engine_steps", "passes over the weights"],
  ["mean", "Requests per step", "room_mean_requests_per_step", "mean batch size"],
];

// badgeKey: "live", or "recorded" on the replay (its figures were live when the session ran).
export function figureTiles(badgeKey = "live") {
  const tiles = Object.fromEntries(FIGURES.map(([name, label, key, note]) => [name, stat(label, { key, note, badge: badgeKey })]));
  tiles.node = el("div", { class: "stats room-figures" }, FIGURES.map(([name]) => tiles[name].node));
  return tiles;
}

export function renderFigures(tiles, totals) {
  tiles.students.set(totals.students, fmtNum(totals.students));
  tiles.requests.set(totals.requests, fmtNum(totals.requests));
  tiles.steps.set(totals.engine_steps, fmtNum(totals.engine_steps));
  tiles.mean.set(totals.mean_requests_per_step, fmtNum(totals.mean_requests_per_step, 2));
}

const plural = (n, one, many = `${one}s`) => `${fmtNum(n)} ${n === 1 ? one : many}`;

// "31 requests, 412 engine steps, 9.4 requests per step on average: one pass over the weights
// served 9 students at once."
export function runningCount(totals) {
  if (!totals.engine_steps) return `${plural(totals.students, "student")} in the room. No engine step yet: send something.`;
  const mean = totals.mean_requests_per_step;
  const head = `${plural(totals.requests, "request")}, ${plural(totals.engine_steps, "engine step")}, `
    + `${fmtNum(mean, 2)} requests per step on average`;
  const atOnce = Math.round(mean);
  return atOnce >= 2 ? `${head}: one pass over the weights served ${atOnce} requests at once.`
    : `${head}: each pass over the weights served about one request. Send together to share steps.`;
}

// A number cell: the raw value in data-value, the text rounded.
function numCell(value, text) {
  return el("td", { class: "num", "data-value": value === null || value === undefined ? null : String(value), text: text ?? fmtNum(value) });
}

const secs = (s) => (s === null || s === undefined ? "–" : fmtMs(1000 * s));

// One request of the live batch. colours: colourMap; mine: the viewer's name, or null.
export function requestRow(r, colours, mine = null) {
  const swatch = el("span", { class: "room-swatch" });
  swatch.style.background = `rgb(${colourOf(colours, r.student).join(",")})`;
  return el("tr", {
    class: `room-request state-${r.state}${mine !== null && r.student === mine ? " is-mine" : ""}`,
    "data-request-row": r.id, "data-student": r.student, "data-state": r.state,
  }, [
    el("th", { scope: "row" }, [swatch, el("span", { class: "room-name", text: r.student })]),
    el("td", { class: "room-state", text: stateText(r) }),
    numCell(r.prompt_tokens), numCell(r.cached_tokens), numCell(r.generated_tokens),
    numCell(r.ttft_s, secs(r.ttft_s)), numCell(r.tpot_s, secs(r.tpot_s)), numCell(r.waited_s, secs(r.waited_s)),
  ]);
}

const HEADS = ["student", "state", "prompt", "cached", "generated", "TTFT", "TPOT", "waited"];

// The live batch's table; newest request first, so the rows that move are at the top.
export function requestTable(requests, colours, mine = null) {
  const body = el("tbody", {}, requests.slice().reverse().map((r) => requestRow(r, colours, mine)));
  if (!requests.length) body.append(el("tr", {}, [el("td", { colspan: String(HEADS.length), class: "muted", text: "No requests yet." })]));
  return el("table", { class: "room-requests" }, [
    el("thead", {}, [el("tr", {}, HEADS.map((h, i) => el("th", { scope: "col", class: i > 1 ? "num" : null, text: h })))]),
    body,
  ]);
}

// The KV pool: blocks in use out of the pool, and one bar per student holding any.
export function kvPanel(students, kv, colours) {
  const holding = students.filter((s) => s.kv_blocks > 0);
  const total = Math.max(1, kv.total);
  const bars = holding.map((s) => {
    const fill = el("span", { class: "room-kv-fill" });
    fill.style.width = `${(100 * s.kv_blocks) / total}%`;
    fill.style.background = `rgb(${colourOf(colours, s.name).join(",")})`;
    return el("li", { "data-student": s.name, "data-kv-blocks": String(s.kv_blocks) }, [
      el("span", { class: "room-name", text: s.name }), el("span", { class: "room-kv-bar" }, [fill]),
      el("span", { class: "num", text: plural(s.kv_blocks, "block") }),
    ]);
  });
  return [
    el("p", { class: "room-kv-total", "data-kv-used": String(kv.used), "data-kv-total": String(kv.total),
      text: `${fmtNum(kv.used)} of ${plural(kv.total, "KV block")} in use` }),
    el("ul", { class: "room-kv" }, bars.length ? bars : [el("li", { class: "muted", text: "No student holds KV blocks now." })]),
  ];
}

// The queue: who waits for a slot, first in line first. count: its length, when the names are
// not known (a recording keeps only the number).
export function waitingPanel(waiting, requests, count = waiting.length) {
  const byId = new Map(requests.map((r) => [r.id, r]));
  if (!waiting.length && count) return [el("p", { class: "room-waiting-count", "data-waiting": String(count), text: `${plural(count, "request")} waiting for a slot.` })];
  if (!waiting.length) return [el("p", { class: "muted room-waiting-none", text: "Nobody waits: every request has a slot." })];
  return [el("ol", { class: "room-waiting", "data-waiting": String(waiting.length) },
    waiting.map((id) => el("li", { "data-request": id, text: byId.get(id)?.student ?? id })))];
}

// The room's settings in words, one phrase per setting, in a fixed order: [key, phrase] pairs.
export function settingsParts(s) {
  const on = (flag) => (flag ? "on" : "off");
  return [
    ["paused", s.paused ? "PAUSED: sending is off" : "sending is on"],
    ["scheduling", `${s.scheduling} batching`], ["max_num_seqs", plural(s.max_num_seqs, "batch slot")],
    ["max_tokens", `up to ${plural(s.max_tokens, "token")} an answer`], ["one_at_a_time", `one request at a time ${on(s.one_at_a_time)}`],
    ["prefix_caching", `prefix caching ${on(s.prefix_caching)}`], ["chunked_prefill", `chunked prefill ${on(s.chunked_prefill)}`],
  ];
}

// The room's settings in words, shown to the whole class: what the teacher switched.
export function settingsText(s) {
  return s ? settingsParts(s).map(([, phrase]) => phrase).join(" · ") : "";
}

// What a change of settings switched, in words: the phrases of `after` that differ from `before`
// ("static batching · 2 batch slots"); every phrase when there is no `before`.
export function settingsChangeText(before, after) {
  if (!after) return "";
  const was = new Map(before ? settingsParts(before) : []);
  const changed = settingsParts(after).filter(([key, phrase]) => was.get(key) !== phrase);
  return changed.length ? changed.map(([, phrase]) => phrase).join(" · ") : "no setting changed";
}

// The requests the table shows: every one not finished, then the newest finished ones, up to
// `limit` rows in all (a long session keeps its table short; the export keeps every record).
export function visibleRequests(requests, limit = 60) {
  const finished = (r) => r.state === "done" || r.state === "aborted";
  const active = requests.filter((r) => !finished(r));
  const room = Math.max(0, limit - active.length);
  const done = room ? requests.filter(finished).slice(-room) : [];
  const keep = new Set([...active, ...done]);
  return requests.filter((r) => keep.has(r));
}

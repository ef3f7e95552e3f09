// The student's page of a room (/room/<code>, once joined): the chat widget (mounted by main.js
// like on the walkthrough; the server sends its requests to the room's engine) and, beside it,
// "your request in the batch": the same step strip as the projector with this student's slots
// highlighted, their latest request's row, how long it waited for a slot and how many others
// shared its steps. The root is [data-view="student"][data-room][data-student].

import { getClient } from "../client.js";
import { el } from "../lib/dom.js";
import { fmtMs, fmtNum } from "../lib/format.js";
import { liveSource } from "./live.js";
import { stateText, studentsInStep } from "./model.js";
import { buildRoomView, playRoom, renderRoomView } from "./view.js";

// "Your request: decoding, waited 120 ms for a slot; its last step was shared with 4 others."
export function yourRequestText(model, name) {
  const mine = model.requests.filter((r) => r.student === name);
  const last = mine[mine.length - 1];
  if (!last) return "You have sent nothing yet. Type a message and press Send: your request joins the room's batch.";
  const waited = last.waited_s === null || last.waited_s === undefined ? "" : `, waited ${fmtMs(1000 * last.waited_s)} for a slot`;
  const shared = [...model.steps].reverse().find((s) => (s.slots ?? []).some((slot) => slot?.request === last.id));
  const others = shared ? studentsInStep(shared).size - 1 : 0;
  const with_ = shared ? (others > 0 ? `; its latest step was shared with ${fmtNum(others)} other student${others === 1 ? "" : "s"}` : "; its latest step ran alone") : "";
  return `Your request: ${stateText(last)}${waited}${with_}.`;
}

export function mountStudent(root, source) {
  const name = root.dataset.student;
  const v = buildRoomView(["strip", "table"]);
  const line = el("p", { class: "room-yours", "aria-live": "polite" });
  const slot = root.querySelector("[data-slot='batch']") ?? root;
  slot.append(line, v.count, v.panels.strip, v.panels.table);
  return playRoom(root, source, (m) => {
    // the table shows this student's requests only; the strip shows everyone's, theirs marked
    renderRoomView(v, { ...m, requests: m.requests.filter((r) => r.student === name) }, name);
    line.textContent = yourRequestText(m, name);
  });
}

function boot() {
  const root = document.querySelector('[data-view="student"][data-room][data-student]');
  if (root) mountStudent(root, liveSource(getClient(), root.dataset.room));
}

boot();

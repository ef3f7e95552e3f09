// A room's view model: what the presenter, the student page and the replay draw, built from the
// server's `room_update` messages (docs: /work/briefs/rooms-contract.md, issue 25). One function,
// applyUpdate, folds an update into the model; the live page feeds it the socket's pushes, the
// replay feeds it updates rebuilt from an exported recording (recording.js). Pure: no DOM here.
//
//   let model = emptyModel("K7QX2M9A");
//   model = applyUpdate(model, msg);   // msg: {"type":"room_update","seq":n, ...}
//   model.newSteps                     // the steps this update added, oldest first

export const MAX_STEPS = 200;           // steps kept for the strip (the server sends at most 200 at once)

export const STATES = Object.freeze(["waiting", "prefill", "decoding", "done", "aborted"]);

export function emptyModel(room) {
  return {
    room, seq: -1,
    state: "open",                      // the room's state: "open" or "closed"
    settings: null,                     // the room's settings as the server last said
    students: [],                       // [{ name, kv_blocks }] in joining order
    requests: [],                       // [record] in first-seen order
    steps: [],                          // StepTrace rows, oldest first, at most MAX_STEPS
    newSteps: [],                       // the rows the last update added
    full: true,                         // the last update replaced everything (redraw the strip)
    waiting: [],                        // request ids in queue order
    waitingCount: 0,                    // its length (a recording keeps only this)
    kv: { used: 0, total: 0 },
    totals: { students: 0, requests: 0, engine_steps: 0, mean_requests_per_step: 0 },
  };
}

// The update's request records over the model's: a record the update names replaces the old one
// in place; new ones go last. A full update (the first after a watch) is the whole list.
function mergeRequests(old, incoming, full) {
  if (full) return incoming.slice();
  const byId = new Map(incoming.map((r) => [r.id, r]));
  const merged = old.map((r) => byId.get(r.id) ?? r);
  const known = new Set(old.map((r) => r.id));
  return merged.concat(incoming.filter((r) => !known.has(r.id)));
}

// The steps after this update: a full update replaces them, a later one appends its new rows
// (a row the model already has, by step number, is not added twice).
function mergeSteps(old, incoming, full) {
  const last = full || !old.length ? -Infinity : old[old.length - 1].step;
  const fresh = incoming.filter((s) => s.step > last);
  const steps = (full ? fresh : old.concat(fresh)).slice(-MAX_STEPS);
  return { steps, fresh };
}

// An update is full when it is the first the model sees, or when it says so (`full: true`, which
// the server may send after a clear). Its seq must be newer than the model's; an older one is
// dropped (the model is returned unchanged).
export function applyUpdate(model, msg) {
  if (msg.type !== "room_update") throw new Error(`applyUpdate: msg.type must be room_update, got ${msg.type}`);
  if (model.seq >= 0 && typeof msg.seq === "number" && msg.seq <= model.seq) return model;
  const full = model.seq < 0 || msg.full === true;
  const { steps, fresh } = mergeSteps(model.steps, msg.steps ?? [], full);
  return {
    ...model,
    seq: typeof msg.seq === "number" ? msg.seq : model.seq + 1,
    state: msg.state ?? model.state,
    settings: msg.settings ?? model.settings,
    students: msg.students ?? model.students,
    requests: msg.requests ? mergeRequests(model.requests, msg.requests, full) : model.requests,
    steps, newSteps: fresh, full,
    waiting: msg.waiting ?? model.waiting,
    waitingCount: msg.waiting_count ?? msg.waiting?.length ?? model.waitingCount,
    kv: msg.kv ?? model.kv,
    totals: msg.totals ?? model.totals,
  };
}

// The slots of a step that did work (a prefill chunk or a decode; not idle, not empty).
export function busySlots(step) {
  return (step.slots ?? []).filter((s) => s && s.kind !== "idle");
}

// The distinct students whose work shared this step.
export function studentsInStep(step) {
  return new Set(busySlots(step).map((s) => s.student));
}

// A request's state in words: "prefill chunk 2 of 3", "decoding", "waiting".
export function stateText(r) {
  if (r.state === "prefill" && r.prefill_chunks) return `prefill chunk ${r.prefill_chunk ?? 1} of ${r.prefill_chunks}`;
  return r.state;
}

// The students in a fixed order for colours: joining order, then any name seen only in steps.
export function studentOrder(model) {
  const names = model.students.map((s) => s.name);
  const seen = new Set(names);
  for (const r of model.requests) if (!seen.has(r.student)) { seen.add(r.student); names.push(r.student); }
  return names;
}

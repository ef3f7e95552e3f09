// A room's exported session (GET /room/<code>/export, schema "sendlens.room/1") turned back into
// the `room_update` messages the live room would have pushed, one per recorded engine step, so the
// replay draws with the same model and view as the live presenter. Pure: no DOM, no timers.
//
// What the recording keeps is the step trace and each request's final record; what a request
// looked like in between is read off the trace: it appears with its first slot, is in prefill
// (chunk k of n) or decoding while its slots say so, and takes its recorded end state once the
// trace lists it finished. The queue's names are not recorded, only its length (each step's
// `waiting`); the KV pool per student neither, only the pool's use.
//
//   const cursor = recordingCursor(exportJson);
//   cursor.length;          // recorded steps
//   cursor.next();          // the update after the next step, or null at the end
//   cursor.changes;         // the teacher's settings changes: [{ step, before, settings }]
//
// The settings each update carries are the ones in force when its step ran (settingsAt), from
// the export's settings_log; a file without one replays with no settings shown.

export const SCHEMA = "sendlens.room/1";

// A slot as the live updates carry it: { request, student, kind, ... }, from either shape.
function slotOf(s, names) {
  if (!s) return null;
  const request = s.request ?? s.request_id ?? null;
  return { ...s, request, student: s.student ?? names.get(request) ?? null };
}

// The settings in force when the newest of the first `done` steps ran: the last log entry made
// before that step. An entry's `step` counts the room's steps done when the teacher changed the
// setting, so it holds from the step of that number on: replayed to `done` steps, the view shows
// what the live presenter showed when step #done-1 came in. At the end (`end`), every entry: a
// change made after the last step is the room's last setting. An entry without a step (a file
// from before steps were logged) holds from the start.
export function settingsAt(log, done, end = false) {
  let current = log[0]?.settings ?? null;
  for (const entry of log) if (end || (entry.step ?? 0) < done) current = entry.settings;
  return current;
}

// The teacher's changes after the room's start, in order: { step, before, settings } (the
// settings before and after; step: the first step that ran with them). Entries at the same step
// (one control each, sent between the same two steps) are one change.
export function settingsChanges(log) {
  const changes = [];
  log.forEach((entry, i) => {
    if (i === 0) return;
    const step = entry.step ?? 0, last = changes[changes.length - 1];
    if (last && last.step === step) last.settings = entry.settings;
    else changes.push({ step, before: log[i - 1].settings, settings: entry.settings });
  });
  return changes;
}

function checkExport(exp) {
  if (!exp || typeof exp !== "object") throw new Error("the recording is not a JSON object");
  if (exp.schema !== SCHEMA) throw new Error(`the recording's schema is ${JSON.stringify(exp.schema)}, not ${SCHEMA}`);
  for (const key of ["steps", "requests"]) {
    if (!Array.isArray(exp[key])) throw new Error(`the recording has no ${key} list`);
  }
  if (exp.settings_log !== undefined && !Array.isArray(exp.settings_log)) throw new Error("the recording's settings_log is not a list");
}

// Each request's prefill chunks in the whole trace, for "chunk k of n".
function prefillChunks(steps) {
  const chunks = new Map();
  for (const step of steps) for (const s of step.slots) {
    if (s?.kind === "prefill") chunks.set(s.request, (chunks.get(s.request) ?? 0) + 1);
  }
  return chunks;
}

// A request's record as it stood after this step: seen (its slots so far), then its end state.
function recordNow(rec, seen, ended) {
  const done = ended.has(rec.id);
  const base = { ...rec, prefill_chunk: null, prefill_chunks: null };
  if (done) return { ...base, state: rec.state === "aborted" ? "aborted" : "done" };
  const now = { ...base, generated_tokens: seen.generated, ttft_s: seen.generated ? rec.ttft_s : null, tpot_s: null };
  // the last prefill chunk makes a token: from then on the live room says decoding
  if (seen.kind === "prefill" && !seen.emitted) return { ...now, state: "prefill", prefill_chunk: seen.chunks, prefill_chunks: seen.totalChunks };
  return { ...now, state: seen.kind === "decode" || seen.generated ? "decoding" : "waiting" };
}

export function recordingCursor(exp) {
  checkExport(exp);
  const names = new Map(exp.requests.map((r) => [r.id, r.student]));
  const steps = exp.steps.map((step) => ({ ...step, slots: (step.slots ?? []).map((s) => slotOf(s, names)) }));
  const records = new Map(exp.requests.map((r) => [r.id, r]));
  const chunks = prefillChunks(steps);
  const roomStudents = (exp.room?.students ?? []).map((s) => (typeof s === "string" ? s : s.name));
  const state = { i: 0, length: steps.length, busy: 0, seen: new Map(), ended: new Set(), students: new Set(roomStudents) };
  return {
    length: steps.length,
    changes: settingsChanges(exp.settings_log ?? []),
    get position() { return state.i; },
    next() {
      if (state.i >= steps.length) return null;
      const step = steps[state.i];
      state.i += 1;
      advance(state, step, chunks);
      const settings = settingsAt(exp.settings_log ?? [], state.i, state.i === steps.length);
      return updateAfter(state, step, { records, settings, roomStudents });
    },
  };
}

// Fold one step into the cursor's running state.
function advance(state, step, chunks) {
  for (const s of step.slots) {
    if (!s) continue;
    const seen = state.seen.get(s.request) ?? { kind: null, chunks: 0, totalChunks: chunks.get(s.request) ?? 0, generated: 0 };
    if (s.kind !== "idle") seen.kind = s.kind;
    if (s.kind === "prefill") seen.chunks += 1;
    if (s.kind !== "idle") seen.emitted = Boolean(s.output_index);   // this step's work made a token
    if (s.output_index) seen.generated = Math.max(seen.generated, s.output_index);
    state.seen.set(s.request, seen);
    state.students.add(s.student);
    if (s.kind !== "idle") state.busy += 1;
  }
  for (const id of step.finished ?? []) state.ended.add(id);
}

// The update the live room would have sent after this step.
function updateAfter(state, step, { records, settings, roomStudents }) {
  // after the last step every record is in, in its end state (one aborted in the queue has no slot)
  const last = state.i === state.length;
  const requests = last ? [...records.values()].map((r) => ({ ...r, prefill_chunk: null, prefill_chunks: null }))
    : [...state.seen.keys()].filter((id) => records.has(id)).map((id) => recordNow(records.get(id), state.seen.get(id), state.ended));
  const students = [...state.students].map((name) => ({ name, kv_blocks: 0 }));
  return {
    type: "room_update", seq: state.i, settings, students, requests, steps: [step],
    waiting: [], waiting_count: step.waiting ?? 0,
    kv: { used: step.kv_blocks_used ?? 0, total: step.kv_blocks_total ?? 0 },
    totals: {
      students: roomStudents.length || state.students.size, requests: requests.length,
      engine_steps: state.i, mean_requests_per_step: state.busy / state.i,
    },
  };
}

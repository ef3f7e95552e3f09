// The room view that the presenter, the replay and the student page share: the badged figures,
// the running count, the room's settings in words, the step strip, the live batch, the KV pool
// and the waiting queue, drawn from the view model (model.js) by the pure functions of strip.js
// and panels.js. The strip grows by the new rows of each update; the rest is redrawn, at most
// once every DRAW_MS however fast updates come (the server sends at most 10 a second).

import { el, scrollBox, setState } from "../lib/dom.js";
import { figure } from "../lib/figures.js";
import { applyUpdate, emptyModel, MAX_STEPS, studentOrder } from "./model.js";
import { figureTiles, kvPanel, renderFigures, requestTable, runningCount, settingsText, visibleRequests, waitingPanel } from "./panels.js";
import { colourMap, stepRow, stripLegend, stripRows, stripWidth } from "./strip.js";

export const STRIP_ROWS = MAX_STEPS;   // steps the strip shows, newest first (it scrolls)
const DRAW_MS = 50;             // a timer, not requestAnimationFrame: a hidden tab still draws

const RECORDED = "recorded during the session by the room's engine, replayed now from the export: no engine runs";

// The empty view. parts: which panels to build ("figures", "strip", "table", "kv", "waiting");
// recorded: a replay, whose figures and panels are badged "recorded" instead of "live model".
export function buildRoomView(parts = ["figures", "strip", "table", "kv", "waiting"], recorded = false) {
  const v = { parts: new Set(parts), slots: 0 };
  const badges = [recorded ? "recorded" : "live"];
  v.figures = figureTiles(badges[0]);
  v.count = el("p", { class: "room-count", "aria-live": "polite" });
  v.settings = el("p", { class: "room-settings", "data-settings": "" });
  v.strip = scrollBox(el("div", { class: "room-strip", role: "table", "aria-label": "Engine steps by batch slots, newest first" }), "Engine steps, newest first");
  v.table = scrollBox(el("div", { class: "room-table" }), "The live batch: one row per request");
  v.kv = el("div", { class: "room-kv-panel" });
  v.waiting = el("div", { class: "room-waiting-panel" });
  v.panels = {
    figures: el("div", { class: "room-figures-panel" }, [v.figures.node, v.count]),
    strip: figure("The engine's steps", badges, [v.settings, stripLegend(), v.strip]),
    table: figure(recorded ? "The batch" : "The live batch", badges, [v.table]),
    kv: figure("KV pool in use", badges, [v.kv]),
    waiting: figure("Waiting for a slot", badges, [v.waiting]),
  };
  if (recorded) for (const node of Object.values(v.panels)) node.querySelectorAll(".badge-recorded").forEach((b) => { b.title = RECORDED; });
  return v;
}

// The strip: rebuilt when the update was full or the number of slots changed, else the new rows
// go on top and the oldest fall off past STRIP_ROWS.
function renderStrip(v, model, opts) {
  const slots = stripWidth(model.steps.slice(-STRIP_ROWS), model.settings);
  if (model.full || slots !== v.slots || v.colourCount !== opts.colours.size) {
    v.slots = slots;
    v.colourCount = opts.colours.size;
    v.strip.replaceChildren(...stripRows(model.steps, opts, STRIP_ROWS));
    return;
  }
  const head = v.strip.firstElementChild;
  for (const step of model.newSteps) head.after(stepRow(step, slots, opts));
  while (v.strip.children.length > STRIP_ROWS + 1) v.strip.lastElementChild.remove();
}

// Draw the model. mine: the viewing student's name (their cells and row highlighted), or null.
export function renderRoomView(v, model, mine = null) {
  const colours = colourMap(studentOrder(model));
  const opts = { colours, mine, settings: model.settings };
  renderFigures(v.figures, model.totals);
  v.count.textContent = runningCount(model.totals);
  v.settings.textContent = (model.state === "closed" ? "This room is closed: nobody can send. " : "") + settingsText(model.settings);
  v.settings.dataset.settings = model.settings ? JSON.stringify(model.settings) : "";
  if (v.parts.has("strip")) renderStrip(v, model, opts);
  if (v.parts.has("table")) v.table.replaceChildren(requestTable(visibleRequests(model.requests), colours, mine));
  if (v.parts.has("kv")) v.kv.replaceChildren(...kvPanel(model.students, model.kv, colours));
  if (v.parts.has("waiting")) v.waiting.replaceChildren(...waitingPanel(model.waiting, model.requests, model.waitingCount));
}

// Draw at most once every DRAW_MS: schedule(model) keeps the newest model and the steps of every
// update since the last draw (a frame that folds several updates must add all their rows).
export function frameDrawer(draw) {
  let pending = null, queued = [], full = false, timer = 0;
  const flush = () => {
    timer = 0;
    const model = { ...pending, newSteps: queued, full: full || pending.full };
    pending = null; queued = []; full = false;
    draw(model);
  };
  return {
    schedule(model) {
      pending = model;
      full = full || model.full;
      queued = model.full ? model.newSteps.slice() : queued.concat(model.newSteps);
      if (!timer) timer = setTimeout(flush, DRAW_MS);
    },
    cancel() { clearTimeout(timer); timer = 0; },
  };
}

// Play `source` (live.js or replay.js) into root: each room_update goes through the model
// (model.js applyUpdate), and `draw(model)` runs at most once a frame; the first draw marks the
// root ready, a source's error marks it error. Returns the function that stops it all.
export function playRoom(root, source, draw) {
  let model = emptyModel(root.dataset.room);
  const drawer = frameDrawer((m) => {
    draw(m);
    root.dataset.seq = String(m.seq);
    if (root.dataset.state !== "ready") setState(root, "ready");
  });
  const stop = source.start({
    reset: () => { model = emptyModel(root.dataset.room); },
    update: (msg) => { model = applyUpdate(model, msg); drawer.schedule(model); },
    error: (err) => setState(root, "error", err.message ?? String(err)),
  });
  return () => { drawer.cancel(); stop(); };
}

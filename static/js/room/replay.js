// The replay of a room's recorded session (/room/<code>/replay): the presenter view driven by the
// exported steps (recording.js) instead of the live room, with no engine work. A player source for
// presenter.js: play, pause, one step, back to the start, a speed, a slider to any recorded step,
// the teacher's settings changes (each a button to the first step that ran with them), and a file
// of the reader's own (an export saved earlier). The player's node carries data-position and
// data-total (steps shown, steps recorded) and data-playing.
//
//   mountPresenter(root, player("/room/K7QX2M9A/export"));

import { el, field, select, setDisabled } from "../lib/dom.js";
import { settingsChangeText } from "./panels.js";
import { recordingCursor } from "./recording.js";

const SPEEDS = [["2", "2 steps/s"], ["5", "5 steps/s"], ["10", "10 steps/s"], ["30", "30 steps/s"]];

function buildControls() {
  const c = {
    play: el("button", { type: "button", class: "primary", "data-control": "play", text: "Play" }),
    step: el("button", { type: "button", "data-control": "step", text: "One step" }),
    restart: el("button", { type: "button", "data-control": "restart", text: "From the start" }),
    speed: select(SPEEDS, "5", { "data-control": "speed", name: "speed" }),
    seek: el("input", { type: "range", min: "1", max: "1", step: "1", value: "1", "data-control": "seek", name: "seek" }),
    file: el("input", { type: "file", accept: "application/json,.json", "data-control": "file", name: "recording" }),
    where: el("p", { class: "room-player-where", "aria-live": "polite", text: "Loading the recording…" }),
    changes: el("ol", { class: "room-player-changes", "aria-label": "The teacher's settings changes" }),
  };
  c.node = el("section", { class: "room-player", "aria-label": "Replay controls", "data-position": "0", "data-total": "0", "data-playing": "false" }, [
    el("div", { class: "controls" }, [c.play, c.step, c.restart, field("speed", c.speed), field("or open a saved export", c.file)]),
    field("recorded step", c.seek), c.where, c.changes,
  ]);
  return c;
}

// The list of the teacher's changes: "step #12: static batching · 2 batch slots", each a button
// that shows the recording up to that step (the first one that ran with the new settings).
function changeList(changes, total, onSeek) {
  return changes.map((change) => {
    const to = Math.min(total, change.step + 1);
    const go = el("button", { type: "button", class: "room-player-change", "data-control": "seek-change", "data-step": String(change.step),
      text: change.step < total ? `step #${change.step}` : "after the last step" });
    go.addEventListener("click", () => onSeek(to));
    return el("li", { "data-settings-step": String(change.step) }, [go, ` ${settingsChangeText(change.before, change.settings)}`]);
  });
}

// The player: a source for mountPresenter that plays an export fetched from `url`.
export function player(url) {
  const c = buildControls();
  let sink = null, cursor = null, recording = null, timer = 0;
  const show = () => {
    const at = cursor?.position ?? 0, total = cursor?.length ?? 0;
    Object.assign(c.node.dataset, { position: String(at), total: String(total), playing: timer ? "true" : "false" });
    c.play.textContent = timer ? "Pause" : "Play";
    c.seek.max = String(Math.max(1, total));
    c.seek.value = String(Math.max(1, at));
    c.where.textContent = cursor ? `Step ${at} of ${total} recorded.` : c.where.textContent;
    for (const b of [c.play, c.step]) setDisabled(b, !cursor || at >= total);
    setDisabled(c.seek, !cursor || total < 2);
  };
  const pause = () => { clearInterval(timer); timer = 0; show(); };
  const stepOnce = () => {
    const msg = cursor?.next();
    if (msg) sink.update(msg);
    if (!msg || cursor.position >= cursor.length) pause();
    else show();
  };
  // Show the recording up to `position` steps: from the start again, every update folded in
  // (the view draws once, the last).
  const seek = (position) => {
    if (!recording) return;
    pause();
    cursor = recordingCursor(recording);
    sink.reset();
    let msg = null;
    while (cursor.position < Math.max(1, position) && (msg = cursor.next())) sink.update(msg);
    show();
  };
  const load = (exp) => {
    pause();
    cursor = recordingCursor(exp);   // throws on a file of another shape
    recording = exp;
    c.changes.replaceChildren(...changeList(cursor.changes, cursor.length, seek));
    sink.reset();
    stepOnce();                      // the first step, so the view is never empty
  };
  const fail = (err) => { pause(); c.where.textContent = `Cannot play it: ${err.message}`; sink.error(err); };
  c.play.addEventListener("click", () => {
    if (timer) return pause();
    timer = setInterval(stepOnce, 1000 / Number(c.speed.value));
    show();
  });
  c.speed.addEventListener("change", () => { if (timer) { pause(); c.play.click(); } });
  c.step.addEventListener("click", () => { pause(); stepOnce(); });
  c.restart.addEventListener("click", () => { if (recording) load(recording); });
  c.seek.addEventListener("input", () => seek(Number(c.seek.value)));
  c.file.addEventListener("change", () => {
    const file = c.file.files?.[0];
    if (file) file.text().then((text) => load(JSON.parse(text))).catch(fail);
  });
  // url null: no fetch, the recording comes through open()
  return {
    kind: "recording",
    node: c.node,
    open: (exp) => { try { load(exp); } catch (err) { fail(err); } },   // an export already in hand
    start(s) {
      sink = s;
      if (url === null) return pause;
      fetch(url, { credentials: "same-origin" })
        .then((resp) => { if (!resp.ok) throw new Error(`the export answered ${resp.status}`); return resp.json(); })
        .then(load).catch(fail);
      return pause;
    },
  };
}

// The presenter view of a classroom room (issue 25), made for a projector: the room's own
// requests as the demo of batching. A thin lifecycle: a source of `room_update` messages (the
// live room over the websocket, live.js, or a recording played back, replay.js) feeds one model
// function (model.js applyUpdate), and the view (view.js) draws the model. The root,
// [data-view="presenter"][data-room][data-source], gets data-state loading, ready or error.
//
//   const stop = mountPresenter(root, source);   // source: liveSource(...) or a player

import { getClient } from "../client.js";
import { el } from "../lib/dom.js";
import { controls } from "./controls.js";
import { liveSource } from "./live.js";
import { player } from "./replay.js";
import { buildRoomView, playRoom, renderRoomView } from "./view.js";

// The page's layout: the main area beside the template's side column (code, QR code, join link):
// figures and running count, the controls, then the strip beside the live batch, KV and queue.
function layout(root, v, top) {
  const main = root.querySelector("[data-slot='main']") ?? root;
  main.append(v.panels.figures, ...top, el("div", { class: "room-grid" }, [v.panels.strip, v.panels.table]),
    el("div", { class: "room-grid room-grid-low" }, [v.panels.kv, v.panels.waiting]));
}

// Mount the view on root and play `source` into it. Returns the function that stops it all.
// source: { kind, start({ reset, update, error }) -> stop, control?(action, fields) -> promise,
// node? (its own controls, e.g. the replay's play and step buttons) }.
export function mountPresenter(root, source) {
  const v = buildRoomView(undefined, source.kind === "recording");
  const teacher = source.control ? controls((action, fields) => source.control(action, fields)) : null;
  layout(root, v, [teacher?.node, source.node].filter(Boolean));
  return playRoom(root, source, (m) => {
    renderRoomView(v, m);
    teacher?.showSettings(m.settings);
    root.dataset.scheduling = m.settings?.scheduling ?? "";
    root.dataset.paused = m.settings?.paused ? "true" : "false";
  });
}

// The page's own root, if this is a presenter page: the live room, or its recording.
function boot() {
  const root = document.querySelector('[data-view="presenter"][data-room]');
  if (!root) return;
  const source = root.dataset.source === "recording"
    ? player(root.dataset.export || `/room/${encodeURIComponent(root.dataset.room)}/export`)
    : liveSource(getClient(), root.dataset.room);
  mountPresenter(root, source);
}

boot();

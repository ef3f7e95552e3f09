// Where a widget's data comes from: the live server, or a recording (docs/export.md).
//
// - A static export (the page carries <script id="sendlens-source"> with mode "export") mounts
//   every widget on a RecordingClient of that widget's recordings; its root gets
//   data-source="recording", its "live"/"measured" badges read "recorded on <machine>, <date>",
//   and, where a live server is named (the export's --server, or ?server= on the page), a
//   "Run it live" button remounts it on that server's client (data-source="live").
// - On the live site a widget mounts on a tap of the page's client (static/js/recorded.js); an
//   embed keeps the last live result it showed (localStorage). An embed whose server refuses it
//   (overloaded), cannot be reached, or closes and does not take it back at once degrades
//   instead of failing: it shows that last result, or the recording the server serves for its
//   default options (/recordings/<name>.json, the recordings_dir setting), with a badge saying
//   why; the client keeps retrying with backoff, and the first hello of a new connection
//   remounts the widget live. With neither recording, it says it lost the connection, as before.
//
// The idea is the one of graceful degradation in static-site explainers: ship precomputed data,
// and let the live engine improve on it when it is there.

import { getClient } from "./client.js";
import { el } from "./lib/dom.js";
import { RecordingClient, recordedOn, tapClient } from "./recorded.js";

const FORMAT = "sendlens-recording/1";
const STORE_MAX_CHARS = 2_000_000;    // a last live result bigger than this is not kept
const REASONS = {
  overloaded: ["server busy", "The live server is busy (overloaded)"],
  unreachable: ["server unreachable", "The live server cannot be reached"],
  closed: ["connection closed", "The connection to the live server closed"],
};

// Read once, when the module runs (a module runs after the page is parsed): a widget that mounts
// later reads the page it was loaded by, even if that document's content has been replaced since.
const pageConfig = (() => {
  const script = document.getElementById("sendlens-source");
  return script ? JSON.parse(script.textContent) : { mode: "live" };
})();
export function config() {
  return pageConfig;
}

// The live server a static export may switch to: ?server= on the page wins over the export's setting.
export function liveServer() {
  const param = new URLSearchParams(window.location.search).get("server");
  return param || config().server || null;
}

// ---- the bar above a widget that says where its data comes from ---------------------------------

function barOf(root) {
  let bar = root.previousElementSibling;
  if (!bar?.classList.contains("source-bar")) {
    bar = el("div", { class: "source-bar", role: "status" });
    root.before(bar);
  }
  return bar;
}

function setBar(root, parts) {
  barOf(root).replaceChildren(...parts.filter(Boolean));
}

// A recording's "live" and "measured" badges say where and when instead (badges drawn later too).
function markBadges(root, recording) {
  const text = recordedOn(recording);
  const cut = text.lastIndexOf(", ");               // the date never breaks at its hyphens
  const mark = () => {
    for (const b of root.querySelectorAll(".badge-live:not([data-recorded]), .badge-measured:not([data-recorded])")) {
      b.dataset.recorded = "";
      b.title = `${b.textContent}: ${text}`;
      const date = document.createElement("span");
      date.className = "badge-date";
      date.textContent = text.slice(cut + 2);
      b.replaceChildren(text.slice(0, cut + 2), date);
    }
  };
  mark();
  const observer = new MutationObserver(mark);
  observer.observe(root, { childList: true, subtree: true });
  return () => observer.disconnect();
}

// ---- mounting on a client --------------------------------------------------------------------

// Unmount what is there, then mount on `client` as `source` ("live" or "recording").
function show(root, mount, client, source, recording = null) {
  root.sendlensUnmount?.();
  root.sendlensUnbadge?.();
  root.sendlensUnbadge = null;
  root.dataset.source = source;
  root.dataset.state = "loading";
  root.sendlensUnmount = mount(client);
  if (recording) root.sendlensUnbadge = markBadges(root, recording);
}

// ---- recordings: the export's files, the last live result, the server's default -----------------

const fetchJson = (url) => fetch(url).then((r) => { if (!r.ok) throw new Error(`${url}: ${r.status}`); return r.json(); });

let exportIndex = null;
async function exported(name) {
  const base = new URL(config().recordings, document.baseURI);
  exportIndex ||= fetchJson(new URL("index.json", base));
  const entries = (await exportIndex).recordings.filter((e) => e.widget === name);
  return Promise.all(entries.map((e) => fetchJson(new URL(e.file, base))));
}

const storeKey = (name) => `sendlens:last-live:${name}:${optionsQuery()}`;

function optionsQuery() {
  const params = new URLSearchParams(window.location.search);
  params.delete("server");
  return params.toString();
}

function lastLive(name) {
  try {
    const text = window.localStorage.getItem(storeKey(name));
    return text ? JSON.parse(text) : null;
  } catch { return null; }
}

// Keep a widget's last live result; when storage is full, the other kept results make room (they
// are only fallbacks). Storage off or still full: the server's recording is the fallback then.
function keepLive(name, recording) {
  const text = JSON.stringify(recording);
  if (text.length > STORE_MAX_CHARS) return;
  for (const attempt of [0, 1]) {
    try {
      window.localStorage.setItem(storeKey(name), text);
      return;
    } catch {
      if (attempt) return;
      try {
        for (const key of Object.keys(window.localStorage)) {
          if (key.startsWith("sendlens:last-live:") && key !== storeKey(name)) window.localStorage.removeItem(key);
        }
      } catch { return; }
    }
  }
}

async function served(name) {
  const base = config().recordings;
  if (!base || optionsQuery() !== "") return null;   // the server keeps its default options' only
  try { return await fetchJson(new URL(`${encodeURIComponent(name)}.json`, new URL(base, document.baseURI))); }
  catch { return null; }
}

// The recording of what a tap saw, with this page's machine, engine and model.
function recordingOf(name, tap) {
  const c = config();
  return {
    format: FORMAT, widget: name, options: Object.fromEntries(new URLSearchParams(optionsQuery())),
    machine: c.machine, date: new Date().toISOString(), engine: c.engine, model: c.model,
    hello: tap.hello, exchanges: tap.exchanges(),
  };
}

// ---- the two modes -----------------------------------------------------------------------------

// The tap of each live widget, by name: the export's recorder reads them (app/recordings/recorder.py).
const taps = {};
window.sendlensTaps = taps;

// A static export: the widget plays its recordings; "Run it live" where a server is named. A
// server that cannot be reached, or refuses this page (its allowed_origins), sends the widget
// back to its recording, saying so.
async function startRecorded(root, name, mount) {
  const recordings = await exported(name);
  const server = liveServer();
  const host = server ? new URL(server, document.baseURI).host : null;
  let playRecording = null;
  const goLive = () => {
    const client = getClient(server);
    setBar(root, [el("span", { class: "badge badge-live", text: "live" }), ` Connecting to ${host}…`]);
    show(root, mount, client, "live");
    if (client.hello) {
      setBar(root, [el("span", { class: "badge badge-live", text: "live" }), ` Running live on ${host}.`]);
      return;
    }
    const offHello = client.onHello(() => {
      stop();
      setBar(root, [el("span", { class: "badge badge-live", text: "live" }), ` Running live on ${host}.`]);
    });
    const offStatus = client.onStatus((status) => {
      if (status !== "closed" || !playRecording) return;
      stop();
      playRecording(`The live server at ${host} could not be reached, or does not let this page's origin `
        + `(${window.location.origin}) in: its allowed_origins setting must name it. `);
    });
    const stop = () => { offHello(); offStatus(); };
  };
  if (!recordings.length) {
    if (server) return goLive();
    throw new Error("this export holds no recording of it");
  }
  const client = new RecordingClient(recordings, { liveHint: server ? " Press \"Run it live\" to send it." : "" });
  playRecording = (note = "") => {
    show(root, mount, client, "recording", recordings[0]);
    setBar(root, [
      el("span", { class: "badge badge-recorded", text: "recording" }),
      ` ${note}A recording: ${recordedOn(recordings[0])}, engine ${recordings[0].engine.version}, model ${recordings[0].model}. `,
      server ? el("button", { type: "button", class: "run-live", text: "Run it live", onclick: goLive }) : null,
    ]);
  };
  playRecording();
}

// The live site: live on a tap; an embed falls back to a recording while the server refuses it.
function startLive(root, name, mount, embed) {
  const live = getClient();
  let mode = "live";
  let tap = null;
  let saver = null;

  const goLive = () => {
    mode = "live";
    tap = tapClient(live, { onRefused: (code) => fallBack(code === "overloaded" ? "overloaded" : live.closeReason || "closed") });
    taps[name] = tap;
    barOf(root).replaceChildren();
    show(root, mount, tap, "live");
    saver?.disconnect();
    if (!embed) return;   // only an embed falls back to it
    // keep the last live result once the widget is ready and nothing is in flight
    saver = new MutationObserver(() => {
      if (root.dataset.state !== "ready" || mode !== "live") return;
      const mine = tap;
      setTimeout(() => { if (mine === tap && mine.pending === 0 && mine.exchanges().length) keepLive(name, recordingOf(name, mine)); }, 300);
    });
    saver.observe(root, { attributes: true, attributeFilter: ["data-state"] });
  };

  const reasonBar = (reason, recording) => {
    const [label, meaning] = REASONS[reason] || REASONS.closed;
    setBar(root, [
      el("span", { class: "badge badge-fallback", "data-fallback": reason, title: meaning, text: label }),
      ` ${meaning}: showing a recording (${recordedOn(recording)}). Trying live again…`,
    ]);
  };

  let falling = false;
  const fallBack = async (reason) => {
    if (!embed) return;
    if (mode === "recording") {   // already showing one: say the newest reason
      reasonBar(reason, root.sendlensRecording);
      return;
    }
    if (falling) return;
    falling = true;
    try {
      const recording = lastLive(name) || await served(name);
      if (!recording || mode !== "live" || live.hello && live.status === "open") return;
      mode = "recording";
      root.sendlensRecording = recording;
      show(root, mount, new RecordingClient([recording]), "recording", recording);
      reasonBar(reason, recording);
    } finally { falling = false; }
  };

  // A connection that closed after the server admitted it is retried at once (0.5 s): fall back
  // only if that retry fails too. A refusal or an unreachable server falls back at once.
  let failures = 0;
  live.onStatus((status) => {
    if (status !== "closed") return;
    failures += 1;
    const reason = live.closeReason || "closed";
    if (reason !== "closed" || failures >= 2) fallBack(reason);
  });
  live.onHello(() => {
    failures = 0;
    if (mode === "recording") goLive();
  });
  goLive();
}

// Mount the widget `name` in root from the page's source; mount(client) mounts it on that
// client and returns its unmount.
export function start(root, name, mount, { embed }) {
  if (config().mode === "export") return startRecorded(root, name, mount);
  return startLive(root, name, mount, embed);
}

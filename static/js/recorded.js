// Recordings on the page: a client that answers from recorded server messages, and a tap that
// records what a live client answers. Both keep client.js's interface (request, call, ready,
// onStatus, onHello, hello, status), so widgets never know which one they were given.
//
// A recording (docs/export.md, app/recordings/schema.json) is one widget's options, its machine,
// date, engine and model, the server's hello, and its exchanges: each exchange is one request
// message under its canonical key (the message's JSON with sorted keys and no "id") and the exact
// server messages that answered it, in order. Replaying looks the key up and plays the messages
// back with the new request's id: the widget draws what the engine drew when it was recorded.

import { callVia } from "./client.js";

const TERMINAL = new Set(["done", "error"]);

// The canonical key of a request message: JSON with its object keys sorted at every level and the
// top-level "id" left out (app/recordings/keys.py computes the same text).
export function canonicalKey(message) {
  const { id, ...rest } = message;
  return JSON.stringify(sortKeys(rest));
}

function sortKeys(value) {
  if (Array.isArray(value)) return value.map(sortKeys);
  if (value && typeof value === "object") {
    return Object.fromEntries(Object.keys(value).sort().map((k) => [k, sortKeys(value[k])]));
  }
  return value;
}

// Is `msg` the last reply to a request of type `kind`? (client.js's rule.)
function terminal(msg, kind) {
  return TERMINAL.has(msg.type) || (msg.type === kind && msg.type !== "generate");
}

// "recorded on AMD EPYC 7B13 (2 threads), 2026-12-04": where and when a recording was made.
export function recordedOn(recording) {
  const m = recording.machine;
  return `recorded on ${m.cpu} (${m.threads} thread${m.threads === 1 ? "" : "s"}), ${recording.date.slice(0, 10)}`;
}

// The error a request gets when no recording answers it: the reader's own input needs the server.
export const NEEDS_LIVE = "needs_live_server";

// A client that answers from recordings (a list, all of one widget: its default options and
// presets). A request whose key none of them holds is refused with code needs_live_server.
export class RecordingClient {
  constructor(recordings, { liveHint = "" } = {}) {
    if (!recordings.length) throw new Error("RecordingClient: recordings is empty");
    this.recordings = recordings;
    this.hello = recordings[0].hello;
    this.status = "open";
    this.counter = 0;
    this.liveHint = liveHint;
    this.byKey = new Map();
    for (const r of recordings) for (const ex of r.exchanges) if (!this.byKey.has(ex.key)) this.byKey.set(ex.key, ex);
  }

  ready() { return Promise.resolve(this.hello); }
  onStatus() { return () => {}; }
  onHello() { return () => {}; }

  request(body, onMessage) {
    const id = body.id ?? `${body.type}-r${++this.counter}`;
    const exchange = this.byKey.get(canonicalKey(body));
    let stopped = false;
    const replies = exchange ? exchange.replies : [{
      type: "error", code: NEEDS_LIVE,
      message: `This widget is showing a recording (${recordedOn(this.recordings[0])}); nothing was recorded for `
        + `this input, so it needs the live server.${this.liveHint}`,
    }];
    // one message a task, in order, as the socket would deliver them
    let i = 0;
    const next = () => {
      if (stopped || i >= replies.length) return;
      onMessage({ ...replies[i++], id });
      setTimeout(next, 0);
    };
    setTimeout(next, 0);
    return {
      id,
      abort: () => {
        if (stopped || i >= replies.length) return;
        stopped = true;
        onMessage({ type: "error", id, code: "aborted", message: "aborted" });
      },
    };
  }

  call(body, options = {}) { return callVia(this, body, options); }
}

// A live client whose answered exchanges are kept: `exchanges()` lists those that ended well
// (not in an error), one per key (a widget that polls keeps its latest answer), in the order each
// key first ended; `pending` counts requests not yet ended. onRefused hears a request that the
// server refused with `overloaded` or lost to a dropped connection.
export function tapClient(client, { onRefused = null } = {}) {
  const ended = new Map();   // key -> exchange
  let pending = 0;
  let lastNewAt = null;      // performance.now() when a key first ended (the recorder waits for quiet)
  const tap = {
    get hello() { return client.hello; },
    get status() { return client.status; },
    get pending() { return pending; },
    get lastNewAt() { return lastNewAt; },
    ready: () => client.ready(),
    onStatus: (fn) => client.onStatus(fn),
    onHello: (fn) => client.onHello(fn),
    exchanges: () => [...ended.values()],
    request(body, onMessage) {
      const replies = [];
      let open = true;
      pending += 1;
      const handle = client.request(body, (msg) => {
        if (msg.type !== "waiting") replies.push(msg);
        if (open && terminal(msg, body.type)) {
          open = false;
          pending -= 1;
          if (msg.type !== "error") {
            const key = canonicalKey(body);
            if (!ended.has(key)) lastNewAt = performance.now();
            ended.set(key, { key, message: { ...body, id: handle.id }, replies });
          } else if (msg.code === "overloaded" || msg.code === "disconnected") onRefused?.(msg.code);
        }
        onMessage(msg);
      });
      return handle;
    },
    call(body, options = {}) { return callVia(tap, body, options); },
  };
  return tap;
}

// The one websocket client every widget on a page shares.
//
// It connects to /ws, reconnects with backoff when the connection drops, and correlates replies
// with requests by the client-chosen "id" that the server echoes in every reply. It keeps the
// limits the server sends in `hello`: at most max_jobs_per_connection jobs and
// max_requests_per_connection generate requests in flight; the rest wait here, so a page full of
// widgets never gets `overloaded` from itself. A request the server refuses with `overloaded` and a
// short `retry_after_s` (a rate or a work budget, not a full server) is sent again by itself once
// that time has passed; its owner hears a `waiting` message meanwhile.

import { SharedSocket, WORKER_FAILED, shareable } from "./shared-socket.js";

const TERMINAL = new Set(["done", "error"]);
const IDLE_CLOSE = 4000;  // the server's close code for an idle connection
const RETRY_WAIT_MAX_S = 10;   // retry by itself only when the server says a retry succeeds this soon
const RETRIES_MAX = 3;         // ... and at most this many times for one request

// May this refusal be retried here, after msg.retry_after_s?
function retryable(msg, entry) {
  return msg.type === "error" && msg.code === "overloaded" && typeof msg.retry_after_s === "number"
    && msg.retry_after_s <= RETRY_WAIT_MAX_S && entry.retries < RETRIES_MAX;
}

// Why did the connection `c` end: "overloaded" (the server refused it; one that opened and closed
// with no word after such a refusal is taken as another), "unreachable" (it never opened) or
// "closed" (the server had admitted it).
function closeReason(c) {
  if (c.refusal?.code === "overloaded") return "overloaded";
  if (!c.opened) return "unreachable";
  if (!c.admitted && c.closeReason === "overloaded") return "overloaded";
  return "closed";
}

class Gate {
  constructor(limit) { this.limit = limit; this.active = 0; this.waiting = []; }
  acquire() {
    if (this.active < this.limit) { this.active += 1; return Promise.resolve(); }
    return new Promise((resolve, reject) => this.waiting.push({ resolve, reject }));
  }
  release() {
    const next = this.waiting.shift();
    if (next) next.resolve();
    else this.active = Math.max(0, this.active - 1);
  }
  setLimit(limit) {
    this.limit = limit;
    while (this.active < this.limit && this.waiting.length) { this.active += 1; this.waiting.shift().resolve(); }
  }
}

class Client {
  // share: open the connection through the SharedWorker (shared-socket.js) instead of a WebSocket
  constructor(url, { share = false } = {}) {
    this.url = url;
    this.share = share;
    this.pending = new Map();      // id -> { kind, onMessage, release }
    this.outbox = [];              // messages waiting for the server to admit the connection (hello)
    this.hello = null;             // the server's hello: model facts and limits
    this.helloWaiters = [];
    this.statusListeners = new Set();
    this.helloListeners = new Set();
    this.refusal = null;           // an error without an id on this connection (overloaded: full)
    this.opened = false;           // did this connection open?
    this.closeReason = null;       // why the last connection ended: "overloaded", "unreachable" or "closed"
    this.counter = 0;
    this.backoff = 500;
    this.status = "connecting";
    this.gates = { job: new Gate(1), generate: new Gate(1) };  // until hello says more
    this.jobTypes = new Set();
    this.requestTypes = new Set(["generate"]);
    this.connect();
  }

  connect() {
    this.setStatus("connecting");
    const ws = this.share ? new SharedSocket(this.url) : new WebSocket(this.url);
    this.ws = ws;
    this.refusal = null;
    this.opened = false;
    this.admitted = false;
    ws.addEventListener("open", () => {
      this.opened = true;
      this.setStatus("open");
    });
    ws.addEventListener("message", (event) => this.dispatch(JSON.parse(event.data)));
    ws.addEventListener("close", (event) => {
      if (event.code === WORKER_FAILED) {   // the browser refused the shared socket: a socket of our own
        this.share = false;
        this.connect();
        return;
      }
      this.outbox = [];  // their owners are told below that they failed: never send them later
      for (const [id, entry] of this.pending) {
        clearTimeout(entry.timer);
        entry.release();
        entry.onMessage({ type: "error", id, code: "disconnected", message: "The connection to the server was lost." });
      }
      this.pending.clear();
      this.closeReason = closeReason(this);
      if (event.code === IDLE_CLOSE) {
        // The server closed a quiet connection: reconnect only when a widget next needs it.
        this.hello = null;
        this.setStatus("idle");
        return;
      }
      this.setStatus("closed");
      setTimeout(() => this.connect(), this.backoff);
      this.backoff = Math.min(this.backoff * 2, 8000);
    });
  }

  setStatus(status) {
    this.status = status;
    for (const fn of this.statusListeners) fn(status);
  }

  onStatus(fn) {
    this.statusListeners.add(fn);
    return () => this.statusListeners.delete(fn);
  }

  dispatch(msg) {
    if (msg.type === "hello") {
      this.hello = msg;
      this.jobTypes = new Set(msg.job_types || []);
      this.requestTypes = new Set(msg.request_types || ["generate"]);
      this.gates.job.setLimit(msg.limits?.max_jobs_per_connection ?? 1);
      this.gates.generate.setLimit(msg.limits?.max_requests_per_connection ?? 1);
      this.backoff = 500;   // admitted: a refusal (overloaded, then closed) keeps backing off
      this.admitted = true;
      // Only now: a refused connection is closed with our messages unread, and a socket closed with
      // unread data is reset (RST), which can discard the refusal before it is read (through a proxy).
      for (const text of this.outbox.splice(0)) this.ws.send(text);
      for (const resolve of this.helloWaiters.splice(0)) resolve(msg);
      for (const fn of this.helloListeners) fn(msg);
      return;
    }
    const entry = msg.id !== null && msg.id !== undefined ? this.pending.get(msg.id) : undefined;
    if (!entry) {
      if (msg.type === "error") {
        if (msg.id === null || msg.id === undefined) this.refusal = msg;
        console.warn("sendlens server:", msg.message);
      }
      return;
    }
    if (retryable(msg, entry)) {
      this.retryLater(entry, msg);
      return;
    }
    if (TERMINAL.has(msg.type) || (msg.type === entry.kind && msg.type !== "generate")) {
      this.pending.delete(msg.id);
      entry.release();
    }
    entry.onMessage(msg);
  }

  // The server refused `entry` for now: tell its owner, and send it again after retry_after_s.
  retryLater(entry, msg) {
    entry.retries += 1;
    entry.onMessage({ type: "waiting", id: msg.id, retry_after_s: msg.retry_after_s, message: msg.message });
    entry.timer = setTimeout(() => {
      entry.timer = null;
      if (this.pending.get(msg.id) === entry) this.send(entry.body);
    }, msg.retry_after_s * 1000);
  }

  // Resolves with the server's hello (model facts and limits) once connected.
  ready() {
    return this.hello ? Promise.resolve(this.hello) : new Promise((resolve) => this.helloWaiters.push(resolve));
  }

  send(msg) {
    const text = JSON.stringify(msg);
    if (this.admitted && this.ws.readyState === WebSocket.OPEN) this.ws.send(text);
    else {
      this.outbox.push(text);
      if (this.status === "idle") this.connect();
    }
  }

  gateFor(type) {
    if (this.requestTypes.has(type)) return this.gates.generate;
    return this.jobTypes.has(type) ? this.gates.job : null;
  }

  // Start a request; onMessage gets every reply with its id. Returns { id, abort }. A request
  // over the server's limits waits here for a free place before it is sent.
  request(body, onMessage) {
    const id = body.id ?? `${body.type}-${++this.counter}`;
    let state = "queued";
    let gate = null;
    let released = false;
    const release = () => { if (!released) { released = true; gate?.release(); } };
    const start = () => {
      if (state !== "queued") { release(); return; }
      state = "sent";
      const entry = { kind: body.type, onMessage, release, body: { ...body, id }, retries: 0, timer: null };
      this.pending.set(id, entry);
      this.send(entry.body);
    };
    // the limits and which types are jobs are known once hello has come
    if (!this.hello && this.status === "idle") this.connect();
    (this.hello ? Promise.resolve() : this.ready())
      .then(() => { gate = this.gateFor(body.type); return gate?.acquire(); })
      .then(start);
    return {
      id,
      abort: () => {
        const entry = this.pending.get(id);
        if (state === "sent" && entry?.timer) {
          // waiting to be sent again: the server holds nothing of it
          clearTimeout(entry.timer);
          this.pending.delete(id);
          entry.release();
          onMessage({ type: "error", id, code: "aborted", message: "aborted while waiting to be sent again" });
        } else if (state === "sent" && entry) this.send({ type: "abort", id });
        else if (state === "queued") {
          state = "aborted";
          onMessage({ type: "error", id, code: "aborted", message: "aborted before it was sent" });
        }
      },
    };
  }

  // A request with one reply (template, tokenize, jobs ...): resolves with it, rejects on error.
  // options.onProgress(msg) hears the job's progress messages; options.signal (AbortSignal) aborts it.
  call(body, options = {}) {
    return callVia(this, body, options);
  }

  // fn(hello) on every hello, that is each time a connection is made and the server admits it.
  // Returns the function that stops listening.
  onHello(fn) {
    this.helloListeners.add(fn);
    return () => this.helloListeners.delete(fn);
  }
}

// `call` over any client's request(body, onMessage): shared by this client and the recorded ones
// (static/js/recorded.js), so that every client answers a widget's call alike.
export function callVia(client, body, options = {}) {
  return new Promise((resolve, reject) => {
    const handle = client.request(body, (msg) => {
      if (msg.type === "progress") options.onProgress?.(msg);
      else if (msg.type === "waiting") options.onWaiting?.(msg);
      else if (msg.type === "error") reject(Object.assign(new Error(msg.message), msg));
      else resolve(msg);
    });
    options.signal?.addEventListener("abort", () => handle.abort(), { once: true });
  });
}

let shared = null;

// The page's one client: of this server, or of `server` (a base URL) when the page names another
// (a static export's "Run it live").
export function getClient(server = null) {
  if (!shared) {
    const url = new URL("/ws", server || window.location.href);
    // a room's student page names its room, so that a browser that joined several rooms talks in this one
    const room = document.querySelector("[data-ws-room]")?.dataset.wsRoom;
    if (room) url.searchParams.set("room", room);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    // an embed in another page's frame shares one socket with the other embeds of this origin
    shared = new Client(url.href, { share: !server && !room && shareable() });
  }
  return shared;
}

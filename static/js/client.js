// The one websocket client every widget on a page shares.
//
// It connects to /ws, reconnects with backoff when the connection drops, and correlates replies
// with requests by the client-chosen "id" that the server echoes in every reply.

const TERMINAL = new Set(["done", "error"]);

class Client {
  constructor(url) {
    this.url = url;
    this.pending = new Map();      // id -> { kind, onMessage }
    this.outbox = [];              // messages waiting for the socket to open
    this.hello = null;             // the server's hello: model facts and limits
    this.helloWaiters = [];
    this.statusListeners = new Set();
    this.counter = 0;
    this.backoff = 500;
    this.status = "connecting";
    this.connect();
  }

  connect() {
    const ws = new WebSocket(this.url);
    this.ws = ws;
    ws.addEventListener("open", () => {
      this.backoff = 500;
      this.setStatus("open");
      for (const text of this.outbox.splice(0)) ws.send(text);
    });
    ws.addEventListener("message", (event) => this.dispatch(JSON.parse(event.data)));
    ws.addEventListener("close", () => {
      this.setStatus("closed");
      this.outbox = [];  // their owners are told below that they failed: never send them later
      // Requests in flight are lost with the connection: tell their owners.
      for (const [id, entry] of this.pending) {
        entry.onMessage({ type: "error", id, code: "disconnected", message: "The connection to the server was lost." });
      }
      this.pending.clear();
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
      for (const resolve of this.helloWaiters.splice(0)) resolve(msg);
      return;
    }
    const entry = msg.id !== null && msg.id !== undefined ? this.pending.get(msg.id) : undefined;
    if (!entry) {
      if (msg.type === "error") console.warn("sendlens server:", msg.message);
      return;
    }
    if (TERMINAL.has(msg.type) || (entry.kind !== "generate" && msg.type === entry.kind)) {
      this.pending.delete(msg.id);
    }
    entry.onMessage(msg);
  }

  // Resolves with the server's hello (model facts and limits) once connected.
  ready() {
    return this.hello ? Promise.resolve(this.hello) : new Promise((resolve) => this.helloWaiters.push(resolve));
  }

  send(msg) {
    const text = JSON.stringify(msg);
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(text);
    else this.outbox.push(text);
  }

  // Start a streaming request (e.g. generate); onMessage gets every reply with its id.
  request(body, onMessage) {
    const id = body.id ?? `${body.type}-${++this.counter}`;
    this.pending.set(id, { kind: body.type, onMessage });
    this.send({ ...body, id });
    return { id, abort: () => this.send({ type: "abort", id }) };
  }

  // A request with one reply (template, attention ...): resolves with it, rejects on error.
  call(body) {
    return new Promise((resolve, reject) => {
      this.request(body, (msg) => {
        if (msg.type === "error") reject(Object.assign(new Error(msg.message), msg));
        else resolve(msg);
      });
    });
  }
}

let shared = null;

export function getClient() {
  if (!shared) {
    const url = new URL("/ws", window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    shared = new Client(url.href);
  }
  return shared;
}

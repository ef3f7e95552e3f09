// A WebSocket look-alike (readyState, send, close; open, message and close events) whose
// connection is the one socket static/js/socket-worker.js holds for all sendlens embeds of this
// origin: a page full of embed iframes opens one connection, not one per iframe. client.js uses
// it in an embed that is in a frame, where the browser has SharedWorker; elsewhere it uses the
// page's own WebSocket, as before. Where the browser refuses the worker (Chromium does in some
// cross-site frames: an error event), or it does not answer within ATTACH_MS, the socket closes
// with WORKER_FAILED before it opens, and client.js opens a WebSocket of its own instead.

export const WORKER_FAILED = 4901;   // a close code of the private range: the worker did not start
const ATTACH_MS = 5000;              // a worker that has not answered by then is taken as refused

let worker = null;
let broken = false;
const onBroken = new Set();

function workerPort() {
  if (!worker) {
    worker = new SharedWorker(new URL("./socket-worker.js", import.meta.url), { name: "sendlens-socket" });
    worker.addEventListener("error", () => {
      broken = true;
      for (const fn of [...onBroken]) fn();
    });
    worker.port.start();
  }
  return worker.port;
}

// Share the socket here? An embed inside another page's frame, where the browser allows it.
export function shareable() {
  return !broken && typeof SharedWorker === "function" && document.body.classList.contains("embed")
    && window.top !== window;
}

export class SharedSocket extends EventTarget {
  constructor(url) {
    super();
    this.url = url;
    this.readyState = WebSocket.CONNECTING;
    const channel = new MessageChannel();
    this.port = channel.port1;
    this.port.onmessage = (e) => this.heard(e.data);
    this.failed = () => { if (this.readyState !== WebSocket.CLOSED) this.ended(WORKER_FAILED, "the shared socket's worker did not start"); };
    onBroken.add(this.failed);
    workerPort().postMessage({ op: "connect", url }, [channel.port2]);
    if (broken) queueMicrotask(this.failed);
    this.waiting = setTimeout(() => { broken = true; this.failed(); }, ATTACH_MS);
  }

  heard(ev) {
    if (this.readyState === WebSocket.CLOSED) return;
    if (ev.ev === "attached") {
      clearTimeout(this.waiting);
    } else if (ev.ev === "open") {
      this.readyState = WebSocket.OPEN;
      this.dispatchEvent(new Event("open"));
    } else if (ev.ev === "message") {
      this.dispatchEvent(new MessageEvent("message", { data: ev.data }));
    } else if (ev.ev === "close") {
      this.ended(ev.code, ev.reason);
    }
  }

  ended(code, reason) {
    clearTimeout(this.waiting);
    onBroken.delete(this.failed);
    this.readyState = WebSocket.CLOSED;
    this.port.close();
    this.dispatchEvent(new CloseEvent("close", { code, reason }));
  }

  send(text) {
    if (this.readyState !== WebSocket.OPEN) throw new DOMException("the socket is not open", "InvalidStateError");
    this.port.postMessage({ op: "send", text });
  }

  close() {
    if (this.readyState === WebSocket.CLOSED) return;
    this.port.postMessage({ op: "close" });
    this.ended(1000, "");
  }
}

// A WebSocket look-alike (readyState, send, close; open, message and close events) whose
// connection is the one socket static/js/socket-worker.js holds for all sendlens embeds of this
// origin: a page full of embed iframes opens one connection, not one per iframe. client.js uses
// it in an embed that is in a frame, where the browser has SharedWorker; elsewhere it uses the
// page's own WebSocket, as before.

let worker = null;

function workerPort() {
  if (!worker) {
    worker = new SharedWorker(new URL("./socket-worker.js", import.meta.url), { name: "sendlens-socket" });
    worker.port.start();
  }
  return worker.port;
}

// Share the socket here? An embed inside another page's frame, where the browser allows it.
export function shareable() {
  return typeof SharedWorker === "function" && document.body.classList.contains("embed") && window.top !== window;
}

export class SharedSocket extends EventTarget {
  constructor(url) {
    super();
    this.url = url;
    this.readyState = WebSocket.CONNECTING;
    const channel = new MessageChannel();
    this.port = channel.port1;
    this.port.onmessage = (e) => this.heard(e.data);
    workerPort().postMessage({ op: "connect", url }, [channel.port2]);
  }

  heard(ev) {
    if (this.readyState === WebSocket.CLOSED) return;
    if (ev.ev === "open") {
      this.readyState = WebSocket.OPEN;
      this.dispatchEvent(new Event("open"));
    } else if (ev.ev === "message") {
      this.dispatchEvent(new MessageEvent("message", { data: ev.data }));
    } else if (ev.ev === "close") {
      this.ended(ev.code, ev.reason);
    }
  }

  ended(code, reason) {
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

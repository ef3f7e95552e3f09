// The SharedWorker that holds one websocket for every sendlens embed of this origin in a
// browser's tabs and frames (static/js/shared-socket.js talks to it), so a page full of embeds
// opens one connection, not one per iframe.
//
// Each frame's client attaches through its own MessagePort. The worker prefixes each request's id
// with the client's tag (`c3~gemm-1`) and sends it on; a reply goes back to the client its id
// names, with the id as that client chose it; a message without an id (hello, a refusal, a room's
// news) goes to every client, and a client that attaches later gets the hello (or the server's
// refusal) at once. The
// connection's limits (hello: max_jobs_per_connection, max_requests_per_connection) are kept here,
// across all clients: a request over them waits in this worker until one ends, as client.js's
// gates do for one page. When the socket closes, every client hears it, and the next to connect
// opens a new one.

const hubs = new Map();   // url -> hub
let clients = 0;

onconnect = (event) => {
  const port = event.ports[0];
  port.onmessage = (m) => { if (m.data?.op === "connect") attach(m.data.url, m.ports[0]); };
};

function hubFor(url) {
  if (hubs.has(url)) return hubs.get(url);
  const hub = {
    url, ws: new WebSocket(url), open: false, hello: null, refusal: null, clients: new Map(),
    jobTypes: new Set(), requestTypes: new Set(["generate"]), limits: { job: 1, generate: 1 },
    inflight: new Map(),                          // full id -> { kind, type }
    queued: { job: [], generate: [] },            // { full, msg } waiting for a free place
  };
  hubs.set(url, hub);
  hub.ws.onopen = () => {
    hub.open = true;
    for (const c of hub.clients.values()) c.port.postMessage({ ev: "open" });
  };
  hub.ws.onmessage = (e) => fromServer(hub, e.data);
  hub.ws.onclose = (e) => {
    if (hubs.get(url) === hub) hubs.delete(url);
    for (const c of hub.clients.values()) c.port.postMessage({ ev: "close", code: e.code, reason: e.reason });
    hub.clients.clear();
  };
  return hub;
}

function attach(url, port) {
  const hub = hubFor(url);
  const tag = `c${++clients}`;
  hub.clients.set(tag, { port });
  port.postMessage({ ev: "attached" });   // the worker runs: the page stops waiting for it
  if (hub.open) {
    port.postMessage({ ev: "open" });
    // what the others heard when the connection began: its hello, or the server's refusal
    if (hub.hello || hub.refusal) port.postMessage({ ev: "message", data: hub.hello || hub.refusal });
  }
  port.onmessage = (m) => {
    if (m.data?.op === "send") fromClient(hub, tag, JSON.parse(m.data.text));
    else if (m.data?.op === "close") {
      hub.clients.delete(tag);
      if (!hub.clients.size) hub.ws.close(1000);
    }
  };
}

const kindOf = (hub, type) => (hub.requestTypes.has(type) ? "generate" : hub.jobTypes.has(type) ? "job" : null);

function fromClient(hub, tag, msg) {
  if (msg.id === undefined || msg.id === null) { hub.ws.send(JSON.stringify(msg)); return; }
  const full = `${tag}~${msg.id}`;
  if (msg.type === "abort") {
    for (const kind of ["job", "generate"]) {
      const i = hub.queued[kind].findIndex((q) => q.full === full);
      if (i >= 0) {   // never sent: the server holds nothing of it
        hub.queued[kind].splice(i, 1);
        toClient(hub, full, { type: "error", id: full, code: "aborted", message: "aborted before it was sent" });
        return;
      }
    }
  }
  const kind = msg.type === "abort" ? null : kindOf(hub, msg.type);
  const out = { ...msg, id: full };
  if (kind && hub.inflight.size && [...hub.inflight.values()].filter((f) => f.kind === kind).length >= hub.limits[kind]) {
    hub.queued[kind].push({ full, msg: out });
    return;
  }
  send(hub, full, out, kind);
}

function send(hub, full, msg, kind) {
  if (kind) hub.inflight.set(full, { kind, type: msg.type });
  hub.ws.send(JSON.stringify(msg));
}

function fromServer(hub, text) {
  const msg = JSON.parse(text);
  if (msg.type === "hello") {
    hub.hello = text;
    hub.jobTypes = new Set(msg.job_types || []);
    hub.requestTypes = new Set(msg.request_types || ["generate"]);
    hub.limits = { job: msg.limits?.max_jobs_per_connection ?? 1, generate: msg.limits?.max_requests_per_connection ?? 1 };
  }
  if (typeof msg.id !== "string" || !msg.id.includes("~")) {
    if (msg.type === "error" && !hub.hello) hub.refusal = text;   // a client attaching now hears it too
    for (const c of hub.clients.values()) c.port.postMessage({ ev: "message", data: text });
    return;
  }
  const flight = hub.inflight.get(msg.id);
  if (flight && (msg.type === "done" || msg.type === "error" || (msg.type === flight.type && msg.type !== "generate"))) {
    hub.inflight.delete(msg.id);
    const next = hub.queued[flight.kind].shift();
    if (next) send(hub, next.full, next.msg, flight.kind);
  }
  toClient(hub, msg.id, msg);
}

function toClient(hub, full, msg) {
  const cut = full.indexOf("~");
  const client = hub.clients.get(full.slice(0, cut));
  client?.port.postMessage({ ev: "message", data: JSON.stringify({ ...msg, id: msg.id === full ? full.slice(cut + 1) : msg.id }) });
}

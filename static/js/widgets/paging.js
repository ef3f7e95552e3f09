// Section 11, "Paged KV": the live engine's KV pool and the block table of every request running
// now (this reader's and everyone else's), polled twice a second while the widget is on screen.
// Shared blocks carry their reference counts; blocks that are free but still hold a cached prefix
// are marked; and the same requests are priced as one contiguous max-length buffer each. The pool
// is drawn on a canvas, a cell a block: a pool of a hundred thousand blocks is one image, not a
// hundred thousand elements.

import { describeChart, el, scrollBox, setDisabled } from "../lib/dom.js";
import { figure, view as viewOf } from "../lib/figures.js";
import { fmtNum, fmtPct } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { teardown } from "../lib/lifecycle.js";

const POLL_MS = 500;
const OPTIONS = {
  demo: { type: "int", default: 3, min: 2, max: 4 },
};
const SYSTEM = "You are a patient tutor for a class of twelve-year-olds. Explain one idea at a time, "
  + "use an everyday example, and keep every answer under five sentences. Never use jargon without saying what it means.";
const QUESTIONS = ["Why do we have seasons?", "How does a rainbow form?", "What is a volcano?", "Why is the sea salty?"];
const COLORS = ["#2f5fd0", "#1d7a4f", "#8a3f8f", "#9a5b00", "#4b55a8", "#b03060"];
const KIND_COLORS = { free: "#eceae4", cached: "#cfe8d9", shared: "#d0702f" };
const POOL_MAX_HEIGHT = 256;   // px: a larger pool gets smaller cells, then several blocks a pixel

const TILES = {  // name: a stat tile [label, figure key, note]
  free: ["Free", "free_blocks", "blocks no request holds"], total: ["Pool", "total_blocks", "blocks in all"],
  shared: ["Shared", "shared_blocks", "blocks held by 2+ requests"], cachedFree: ["Cached, free", "cached_free_blocks", "free, prefix kept for reuse"],
  naive: ["Contiguous waste", "naive_waste_fraction", "max-length buffers, same requests"],
  paged: ["Paged waste", "paged_waste_fraction", "empty slots in held blocks"],
};

function build(demo) {
  const view = {
    ...viewOf(TILES),
    button: el("button", { type: "button", class: "pg-demo", text: `Start ${demo} requests sharing a system prompt` }),
    demoNote: el("span", { class: "note pg-demo-note", "aria-live": "polite" }),
    canvas: el("canvas", { class: "pg-pool-canvas", style: { display: "block", maxWidth: "100%" } }),
    poolNote: el("p", { class: "note" }),
    tables: scrollBox(el("div", { class: "pg-tables" }), "Block tables of the requests running now"),
    waste: el("div", { class: "pg-waste" }),
    wasteNote: el("p", { class: "note" }),
    updated: el("p", { class: "note pg-updated", "aria-live": "off" }),
  };
  describeChart(view.canvas, "Every block of the KV pool", view.poolNote);
  view.pool = el("div", { class: "pg-pool-map" }, [view.canvas]);
  const legend = el("div", { class: "legend pg-legend" }, [
    el("span", { class: "pg-key pg-free", text: "free" }), el("span", { class: "pg-key pg-cached", text: "free, cached prefix" }),
    el("span", { class: "pg-key pg-used", text: "held by one request" }), el("span", { class: "pg-key pg-shared", text: "shared (ref count ≥ 2)" }),
  ]);
  const tiles = [view.free, view.total, view.shared, view.cachedFree, view.naive, view.paged].map((t) => t.node);
  view.nodes = [
    el("div", { class: "controls" }, [view.button, view.demoNote]),
    figure("The pool now", ["live", "computed"], [el("div", { class: "stats" }, tiles)]),
    el("div", { class: "pg-grid" }, [
      figure("Block tables of the requests running now", ["live"], [view.tables]),
      figure("The KV pool, block by block", ["live"], [view.pool, legend, view.poolNote]),
    ]),
    figure("Paged blocks against one contiguous buffer per request", ["live", "computed"], [view.waste, view.wasteNote]),
    view.updated,
  ];
  return view;
}

// Each block's kind and colour: shared, held by one request (its request's colour), free with a
// cached prefix, or free.
function blockKinds(s) {
  const owner = new Map();
  s.requests.forEach((r, i) => r.blocks.forEach((b) => { if (!owner.has(b)) owner.set(b, i); }));
  const cached = new Set(s.cached_block_ids);
  const kinds = s.ref_counts.map((ref, b) => (ref > 1 ? "shared" : ref === 1 ? "used" : cached.has(b) ? "cached" : "free"));
  const colour = (b) => (kinds[b] === "used" ? COLORS[owner.get(b) % COLORS.length] : KIND_COLORS[kinds[b]]);
  return { kinds, colour };
}

// The pool's layout on a canvas `width` pixels wide: cell pitch, columns, rows, blocks per cell.
export function poolLayout(total, width) {
  let pitch = 10;
  while (pitch > 1 && Math.ceil(total / Math.floor(width / pitch)) * pitch > POOL_MAX_HEIGHT) pitch -= 1;
  const cols = Math.max(1, Math.floor(width / pitch));
  const per = Math.max(1, Math.ceil(total / (cols * Math.floor(POOL_MAX_HEIGHT / pitch))));
  const rows = Math.max(1, Math.ceil(total / per / cols));
  return { pitch, cols, rows, per, gap: pitch >= 4 ? 1 : 0 };
}

const RANK = { free: 0, cached: 1, used: 2, shared: 3 };

// Draw every block (a cell shows the busiest of its blocks when one holds several). Returns the
// number of blocks drawn.
function renderPool(view, s) {
  const { canvas } = view;
  const layout = poolLayout(s.total_blocks, Math.max(120, view.pool.clientWidth || 560));
  const { pitch, cols, rows, per, gap } = layout;
  canvas.width = cols * pitch;
  canvas.height = rows * pitch;
  const g = canvas.getContext("2d");
  const { kinds, colour } = blockKinds(s);
  for (let c = 0; c * per < kinds.length; c += 1) {
    let best = c * per;
    for (let b = best + 1; b < Math.min(kinds.length, (c + 1) * per); b += 1) if (RANK[kinds[b]] > RANK[kinds[best]]) best = b;
    g.fillStyle = colour(best);
    g.fillRect((c % cols) * pitch, Math.floor(c / cols) * pitch, pitch - gap, pitch - gap);
  }
  view.layout = { ...layout, total: s.total_blocks, ref: s.ref_counts, kinds };
  const count = (k) => kinds.filter((x) => x === k).length;
  view.poolNote.textContent = `${fmtNum(s.total_blocks)} blocks of ${s.block_size} token slots: ${fmtNum(count("free"))} free, `
    + `${fmtNum(count("cached"))} free with a cached prefix, ${fmtNum(count("used"))} held by one request, ${fmtNum(count("shared"))} shared`
    + `${per > 1 ? ` (a cell is ${per} blocks here, coloured by the busiest)` : ""}. A request's blocks need not sit side by side: `
    + "each request's block table says where its tokens are.";
  return kinds.length;
}

// The canvas's tooltip: the block under the pointer.
function poolTitle(view, event) {
  const L = view.layout;
  if (!L) return;
  const box = view.canvas.getBoundingClientRect();
  const x = Math.floor(((event.clientX - box.left) * view.canvas.width) / box.width / L.pitch);
  const y = Math.floor(((event.clientY - box.top) * view.canvas.height) / box.height / L.pitch);
  const b = (y * L.cols + x) * L.per;
  if (x >= L.cols || b >= L.total) { view.canvas.title = ""; return; }
  const ref = L.ref[b], kind = L.kinds[b];
  view.canvas.title = `block ${b}${L.per > 1 ? `–${Math.min(L.total, b + L.per) - 1}` : ""}: ${ref ? `ref count ${ref}` : kind === "cached" ? "free, keeps a cached prefix" : "free"}`;
}

function renderTables(view, s) {
  if (!s.requests.length) {
    view.tables.replaceChildren(el("p", { class: "note", text: "No request is running right now. Press the button above, or send a chat message in section 1, and watch the blocks appear." }));
    return;
  }
  view.tables.replaceChildren(...s.requests.map((r, i) => el("div", { class: `pg-req${r.yours ? " is-yours" : ""}` }, [
    el("p", { class: "pg-req-head" }, [
      el("span", { class: "pg-swatch", style: { background: COLORS[i % COLORS.length] } }),
      `request ${r.request_id}${r.yours ? " (yours)" : ""}: ${fmtNum(r.num_computed_tokens)} tokens' keys and values in ${r.blocks.length} block${r.blocks.length === 1 ? "" : "s"}`
        + (r.num_cached_tokens ? `, ${fmtNum(r.num_cached_tokens)} from the prefix cache` : "")
        + `, ${r.empty_slots} empty slot${r.empty_slots === 1 ? "" : "s"}`,
    ]),
    el("div", { class: "pg-row" }, r.blocks.map((b, j) => el("span", {
      class: `pg-block${r.ref_counts[j] > 1 ? " is-shared" : ""}`,
      title: `logical block ${j} → physical block ${b}, ref count ${r.ref_counts[j]}`,
    }, [el("span", { text: String(b) }), r.ref_counts[j] > 1 ? el("sup", { text: `×${r.ref_counts[j]}` }) : null]))),
  ])));
}

function wasteBar(s, label, used, held, cls) {
  const width = (n) => ({ width: `${Math.max(0.3, (100 * n) / s.naive_reserved_slots)}%` });
  return el("div", { class: "pg-wbar" }, [
    el("span", { class: "pg-wlabel", text: label }),
    el("span", { class: "pg-wtrack" }, [el("span", { class: `pg-wfill ${cls}`, style: width(held) }), el("span", { class: "pg-wused", style: width(used) })]),
    el("span", { class: "pg-wval", text: `${fmtNum(held)} slots, ${fmtNum(used)} filled` }),
  ]);
}

function renderWaste(view, s) {
  const n = s.requests.length;
  const fits = `${s.naive_max_requests} such request${s.naive_max_requests === 1 ? "" : "s"}`;
  if (!n) {
    view.waste.replaceChildren();
    view.wasteNote.textContent = `One contiguous buffer per request would reserve ${fmtNum(s.context_window)} slots each (the context window): the whole pool would fit only ${fits}.`;
    return;
  }
  view.waste.replaceChildren(
    wasteBar(s, "contiguous", s.tokens, s.naive_reserved_slots, "is-naive"),
    wasteBar(s, "paged", s.paged_slots - s.paged_empty_slots, s.paged_slots, "is-paged"),
  );
  view.wasteNote.textContent = `${n} request${n === 1 ? "" : "s"} holding ${fmtNum(s.tokens)} tokens. Reserving ${fmtNum(s.context_window)} slots for each `
    + `would leave ${fmtPct(s.naive_waste_fraction)} of ${fmtNum(s.naive_reserved_slots)} slots empty, and the pool would fit ${fits}; `
    + `paging holds ${fmtNum(s.paged_slots)} slots${s.shared_blocks ? `, sharing ${s.shared_blocks} block${s.shared_blocks === 1 ? "" : "s"}` : ""}.`;
}

// One snapshot on screen. Throws rather than leave the pool figure empty.
export function renderSnapshot(view, s) {
  view.free.set(s.free_blocks, fmtNum(s.free_blocks));
  view.total.set(s.total_blocks, fmtNum(s.total_blocks));
  view.shared.set(s.shared_blocks, fmtNum(s.shared_blocks));
  view.cachedFree.set(s.cached_free_blocks, fmtNum(s.cached_free_blocks));
  view.naive.set(s.naive_waste_fraction, s.naive_waste_fraction === null ? "–" : fmtPct(s.naive_waste_fraction));
  view.paged.set(s.paged_waste_fraction, s.paged_waste_fraction === null ? "–" : fmtPct(s.paged_waste_fraction));
  if (!renderPool(view, s)) throw new Error("The engine reported an empty KV pool.");
  renderTables(view, s);
  renderWaste(view, s);
  view.updated.textContent = `Snapshot of the engine at ${new Date(s.time * 1000).toLocaleTimeString("en-GB")}, refreshed every ${POLL_MS / 1000} s while this is on screen.`;
}

// Poll a snapshot every POLL_MS, one at a time, only while the root is on screen and the tab
// visible. Returns { poll, stop }.
function poller(root, job, view) {
  let inFlight = false, visible = true;
  const poll = () => {
    if (inFlight || !visible || document.hidden) return;
    inFlight = true;
    job.run({ type: "paging" }, { render: (s) => renderSnapshot(view, s) }).finally(() => { inFlight = false; });
  };
  const timer = setInterval(poll, POLL_MS);
  const observer = "IntersectionObserver" in window
    ? new IntersectionObserver((entries) => {
      visible = entries.some((e) => e.isIntersecting);
      root.dataset.onScreen = String(visible);    // what the poller believes, for tests and devtools
      if (visible) poll();
    })
    : null;
  observer?.observe(root);
  const onVisibility = () => { if (!document.hidden) poll(); };
  document.addEventListener("visibilitychange", onVisibility);
  return {
    poll,
    stop() {
      clearInterval(timer);
      observer?.disconnect();
      document.removeEventListener("visibilitychange", onVisibility);
    },
  };
}

// The demo: requests that share a system prompt, through the normal generate path. The first one
// computes the prompt; the others start once its full blocks are in the prefix cache.
function demo(client, count, handles) {
  const generate = (question, onFirstToken) => new Promise((resolve, reject) => {
    let first = true;
    handles.push(client.request({
      type: "generate", max_tokens: 48, temperature: 0,
      messages: [{ role: "system", content: SYSTEM }, { role: "user", content: question }],
    }, (msg) => {
      if (msg.type === "token" && first) { first = false; onFirstToken?.(); }
      else if (msg.type === "done") resolve(msg);
      else if (msg.type === "error") reject(Object.assign(new Error(msg.message), msg));
    }));
  });
  const questions = QUESTIONS.slice(0, count);
  let started;
  const firstWritten = new Promise((resolve) => { started = resolve; });
  const runs = [generate(questions[0], started)];
  return firstWritten.then(() => Promise.all([...runs, ...questions.slice(1).map((q) => generate(q))]));
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  ctx.setOptions({ demo: opts.demo }, OPTIONS);
  const view = build(opts.demo);
  root.append(...view.nodes);
  const job = jobRunner(root, { client: ctx.client });
  const polling = poller(root, job, view);
  const handles = [];
  let alive = true;
  view.canvas.addEventListener("mousemove", (event) => poolTitle(view, event));

  view.button.addEventListener("click", async () => {
    setDisabled(view.button, true);
    view.demoNote.textContent = "The first request computes the shared prompt; the others start once its blocks are written…";
    try {
      const done = await demo(ctx.client, opts.demo, handles);
      const cached = done.slice(1).map((d) => d.num_cached_tokens);
      view.demoNote.textContent = `Done: the later requests took ${cached.join(", ")} prompt tokens from the first one's blocks. Their blocks went back to the pool.`;
    } catch (err) {
      if (alive) view.demoNote.textContent = `Stopped: ${err.message}`;
    } finally {
      handles.length = 0;
      setDisabled(view.button, false);
    }
  });

  const offStatus = ctx.connected(() => polling.poll());
  return teardown(root, [() => { alive = false; }, job.stop, polling.stop, offStatus, () => handles.forEach((h) => h.abort())]);
}

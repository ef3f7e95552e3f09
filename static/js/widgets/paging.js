// Section 11, "Paged KV": the live engine's KV pool and the block table of every request running
// now (this reader's and everyone else's), polled twice a second while the widget is on screen.
// Shared blocks carry their reference counts; blocks that are free but still hold a cached prefix
// are marked; and the same requests are priced as one contiguous max-length buffer each.

import { el, setState } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtNum, fmtPct } from "../lib/format.js";

const POLL_MS = 500;
const OPTIONS = {
  demo: { type: "int", default: 3, min: 2, max: 4 },
};
const SYSTEM = "You are a patient tutor for a class of twelve-year-olds. Explain one idea at a time, "
  + "use an everyday example, and keep every answer under five sentences. Never use jargon without saying what it means.";
const QUESTIONS = ["Why do we have seasons?", "How does a rainbow form?", "What is a volcano?", "Why is the sea salty?"];
const COLORS = ["#2f5fd0", "#1d7a4f", "#8a3f8f", "#9a5b00", "#4b55a8", "#b03060"];

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { timer: null, inFlight: false, visible: true, alive: true, demos: [], last: null };
  ctx.setOptions({ demo: opts.demo }, OPTIONS);

  const free = stat("Free", { key: "free_blocks", note: "blocks no request holds" });
  const total = stat("Pool", { key: "total_blocks", note: "blocks in all" });
  const shared = stat("Shared", { key: "shared_blocks", note: "blocks held by 2+ requests" });
  const cachedFree = stat("Cached, free", { key: "cached_free_blocks", note: "free, prefix kept for reuse" });
  const naive = stat("Contiguous waste", { key: "naive_waste_fraction", note: "max-length buffers, same requests" });
  const paged = stat("Paged waste", { key: "paged_waste_fraction", note: "empty slots in held blocks" });

  const button = el("button", { type: "button", class: "pg-demo", text: `Start ${opts.demo} requests sharing a system prompt` });
  const demoNote = el("span", { class: "note pg-demo-note", "aria-live": "polite" });
  const pool = el("div", { class: "pg-pool", role: "img", "aria-label": "Every block of the KV pool" });
  const legend = el("div", { class: "legend pg-legend" }, [
    el("span", { class: "pg-key pg-free", text: "free" }), el("span", { class: "pg-key pg-cached", text: "free, cached prefix" }),
    el("span", { class: "pg-key pg-used", text: "held by one request" }), el("span", { class: "pg-key pg-shared", text: "shared (ref count ≥ 2)" }),
  ]);
  const poolNote = el("p", { class: "note" });
  const tables = el("div", { class: "pg-tables" });
  const waste = el("div", { class: "pg-waste" });
  const wasteNote = el("p", { class: "note" });
  const updated = el("p", { class: "note pg-updated", "aria-live": "off" });

  root.append(
    el("div", { class: "controls" }, [button, demoNote]),
    figure("The pool now", ["live", "computed"], [el("div", { class: "stats" }, [free.node, total.node, shared.node, cachedFree.node, naive.node, paged.node])]),
    el("div", { class: "pg-grid" }, [
      figure("Block tables of the requests running now", ["live"], [tables]),
      figure("The KV pool, block by block", ["live"], [pool, legend, poolNote]),
    ]),
    figure("Paged blocks against one contiguous buffer per request", ["live", "computed"], [waste, wasteNote]),
    updated,
  );

  let cells = [];
  function drawPool(s) {
    if (cells.length !== s.total_blocks) {
      cells = s.ref_counts.map(() => el("span", { class: "pg-cell" }));
      pool.replaceChildren(...cells);
    }
    const owner = new Map();
    s.requests.forEach((r, i) => r.blocks.forEach((b) => { if (!owner.has(b)) owner.set(b, i); }));
    const cached = new Set(s.cached_block_ids);
    s.ref_counts.forEach((ref, b) => {
      const cell = cells[b];
      const kind = ref > 1 ? "shared" : ref === 1 ? "used" : cached.has(b) ? "cached" : "free";
      cell.className = `pg-cell pg-${kind}`;
      cell.style.background = kind === "used" ? COLORS[owner.get(b) % COLORS.length] : "";
      cell.title = `block ${b}: ${ref ? `ref count ${ref}` : kind === "cached" ? "free, keeps a cached prefix" : "free"}`;
    });
    poolNote.textContent = `${fmtNum(s.total_blocks)} blocks of ${s.block_size} token slots. A request's blocks need not sit side by side: `
      + "each request's block table says where its tokens are.";
  }

  function drawTables(s) {
    if (!s.requests.length) {
      tables.replaceChildren(el("p", { class: "note", text: "No request is running right now. Press the button above, or send a chat message in section 1, and watch the blocks appear." }));
      return;
    }
    tables.replaceChildren(...s.requests.map((r, i) => el("div", { class: `pg-req${r.yours ? " is-yours" : ""}` }, [
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

  function drawWaste(s) {
    const n = s.requests.length;
    if (!n) {
      waste.replaceChildren();
      wasteNote.textContent = `One contiguous buffer per request would reserve ${fmtNum(s.context_window)} slots each (the context window): `
        + `the whole pool would fit only ${s.naive_max_requests} such request${s.naive_max_requests === 1 ? "" : "s"}.`;
      return;
    }
    const bar = (label, used, held, cls) => el("div", { class: "pg-wbar" }, [
      el("span", { class: "pg-wlabel", text: label }),
      el("span", { class: "pg-wtrack" }, [el("span", { class: `pg-wfill ${cls}`, style: { width: `${Math.max(0.3, (100 * held) / s.naive_reserved_slots)}%` } }),
        el("span", { class: "pg-wused", style: { width: `${Math.max(0.3, (100 * used) / s.naive_reserved_slots)}%` } })]),
      el("span", { class: "pg-wval", text: `${fmtNum(held)} slots, ${fmtNum(used)} filled` }),
    ]);
    waste.replaceChildren(
      bar("contiguous", s.tokens, s.naive_reserved_slots, "is-naive"),
      bar("paged", s.paged_slots - s.paged_empty_slots, s.paged_slots, "is-paged"),
    );
    wasteNote.textContent = `${n} request${n === 1 ? "" : "s"} holding ${fmtNum(s.tokens)} tokens. Reserving ${fmtNum(s.context_window)} slots for each `
      + `would leave ${fmtPct(s.naive_waste_fraction)} of ${fmtNum(s.naive_reserved_slots)} slots empty, and the pool would fit ${s.naive_max_requests} such request${s.naive_max_requests === 1 ? "" : "s"}; `
      + `paging holds ${fmtNum(s.paged_slots)} slots${s.shared_blocks ? `, sharing ${s.shared_blocks} block${s.shared_blocks === 1 ? "" : "s"}` : ""}.`;
  }

  function render(s) {
    state.last = s;
    free.set(s.free_blocks, fmtNum(s.free_blocks));
    total.set(s.total_blocks, fmtNum(s.total_blocks));
    shared.set(s.shared_blocks, fmtNum(s.shared_blocks));
    cachedFree.set(s.cached_free_blocks, fmtNum(s.cached_free_blocks));
    naive.set(s.naive_waste_fraction, s.naive_waste_fraction === null ? "–" : fmtPct(s.naive_waste_fraction));
    paged.set(s.paged_waste_fraction, s.paged_waste_fraction === null ? "–" : fmtPct(s.paged_waste_fraction));
    drawPool(s);
    drawTables(s);
    drawWaste(s);
    updated.textContent = `Snapshot of the engine at ${new Date(s.time * 1000).toLocaleTimeString("en-GB")}, refreshed every ${POLL_MS / 1000} s while this is on screen.`;
  }

  // ---- polling: one snapshot at a time, only while the widget is visible ----
  function poll() {
    if (!state.alive || state.inFlight || !state.visible || document.hidden) return;
    state.inFlight = true;
    client.call({ type: "paging" }).then((s) => {
      if (!state.alive) return;
      render(s);
      setState(root, "ready");
    }).catch((err) => {
      if (state.alive) setState(root, "error", err.message);
    }).finally(() => { state.inFlight = false; });
  }
  state.timer = setInterval(poll, POLL_MS);
  const observer = "IntersectionObserver" in window
    ? new IntersectionObserver((entries) => { state.visible = entries.some((e) => e.isIntersecting); if (state.visible) poll(); })
    : null;
  observer?.observe(root);
  const onVisibility = () => { if (!document.hidden) poll(); };
  document.addEventListener("visibilitychange", onVisibility);
  poll();

  // ---- the demo: requests that share a system prompt, through the normal generate path ----
  function generate(question, onFirstToken) {
    let first = true;
    return new Promise((resolve, reject) => {
      const handle = client.request({
        type: "generate", max_tokens: 48, temperature: 0,
        messages: [{ role: "system", content: SYSTEM }, { role: "user", content: question }],
      }, (msg) => {
        if (msg.type === "token" && first) { first = false; onFirstToken?.(); }
        else if (msg.type === "done") resolve(msg);
        else if (msg.type === "error") reject(Object.assign(new Error(msg.message), msg));
      });
      state.demos.push(handle);
    });
  }

  button.addEventListener("click", async () => {
    button.disabled = true;
    demoNote.textContent = "The first request computes the shared prompt; the others start once its blocks are written…";
    try {
      const questions = QUESTIONS.slice(0, opts.demo);
      let started;
      const firstWritten = new Promise((resolve) => { started = resolve; });
      const runs = [generate(questions[0], started)];
      await firstWritten;                   // its prompt's full blocks are now in the prefix cache
      runs.push(...questions.slice(1).map((q) => generate(q)));
      const done = await Promise.all(runs);
      const cached = done.slice(1).map((d) => d.num_cached_tokens);
      demoNote.textContent = `Done: the later requests took ${cached.join(", ")} prompt tokens from the first one's blocks. Their blocks went back to the pool.`;
    } catch (err) {
      if (state.alive) demoNote.textContent = `Stopped: ${err.message}`;
    } finally {
      state.demos = [];
      button.disabled = false;
    }
  });

  return () => {
    state.alive = false;
    clearInterval(state.timer);
    observer?.disconnect();
    document.removeEventListener("visibilitychange", onVisibility);
    state.demos.forEach((h) => h.abort());
    root.replaceChildren();
  };
}

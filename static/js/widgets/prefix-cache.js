// Section 16, "Prefix caching": one question asked twice, then several users' questions after the
// same system prompt, each prefilled on an engine with the prefix cache and on one without, timed
// here. Every block of every prompt is shown with its chained hash and whether the cache held it.

import { el, field } from "../lib/dom.js";
import { figure } from "../lib/figures.js";
import { fmtMs, fmtNum, visibleWhitespace } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuring, progressLine, shareBar, threadsOn, view } from "../lib/measure.js";

const DEFAULT_SYSTEM = "You are a helpful assistant for a school science class. Answer in two or three short sentences, "
  + "use plain words, give one everyday example, and say so when you are not sure.";
const DEFAULT_QUESTION = "Why is the sky blue?";
const DEFAULT_USERS = "What makes a rainbow?\nHow do magnets work?\nWhy does ice float?";

const OPTIONS = {
  system: { type: "string", default: DEFAULT_SYSTEM, maxLength: 3000 },
  question: { type: "string", default: DEFAULT_QUESTION, maxLength: 500 },
  users: { type: "string", default: DEFAULT_USERS, maxLength: 2000 },
};
const STATUS = {
  hit: "matched: taken from the cache",
  miss: "looked up, not in the cache: computed (the chain stops here)",
  "after miss": "not looked up: a block before it missed",
  "last token": "holds the last prompt token: always computed",
  partial: "not full: never hashed, never shared",
};

function textInput(tag, name, label, value, rows = null) {
  const node = el(tag, { class: "text-input", name, rows, "aria-label": label });
  node.value = value;
  return node;
}

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  cached: ["Cached tokens", "cached_tokens", "on the second ask"],
  saved: ["TTFT saved", "ttft_saved_ms", "second ask, without − with"],
  without: ["TTFT without", "ttft_without_ms", "second ask, cache off"],
  withCache: ["TTFT with", "ttft_with_ms", "second ask, cache on"], machine: "p.note.pc-machine", blocks: "div.pc-blocks",
};

function build(opts) {
  const v = {
    system: textInput("textarea", "system", "Shared system prompt", opts.system, 3),
    question: textInput("input", "question", "Question asked twice", opts.question),
    users: textInput("textarea", "users", "Other users' questions, one per line", opts.users, 3),
    button: el("button", { type: "button", class: "pc-run", text: "Measure again" }),
    progress: progressLine(),
    table: el("div", { class: "pc-table", role: "table", "aria-label": "Each prompt, with and without the cache" }),
    detail: el("div", { class: "pc-detail", "aria-live": "polite" }),
    result: null,
    ...view(VIEW),
  };
  const legend = el("div", { class: "legend pc-legend" }, Object.entries(STATUS).map(([k, t]) => el("span", { class: `pc-key pc-${k.replace(" ", "-")}`, title: t, text: k })));
  v.nodes = [
    el("div", { class: "pc-inputs" }, [
      field("system prompt (shared)", v.system), field("question (asked twice)", v.question), field("other users' questions, one per line", v.users),
    ]),
    el("div", { class: "controls" }, [v.button]),
    v.progress,
    figure("The same question, asked a second time", ["live", "measured"], [
      el("div", { class: "stats pc-stats" }, [v.cached.node, v.saved.node, v.without.node, v.withCache.node]), v.machine]),
    figure("Time to first token, with and without the cache", ["measured", "live"], [v.table]),
    figure("Which blocks matched: a hash chain over full blocks", ["live"], [legend, v.blocks, v.detail]),
  ];
  return v;
}

function renderTable(v, r) {
  const max = Math.max(...r.prompts.map((p) => Math.max(p.ttft_without_ms, p.ttft_with_ms)), 1e-6);
  const head = el("div", { class: "pc-tr pc-th", role: "row" }, ["prompt", "tokens", "cached", "TTFT: without / with the cache"].map((t) => el("span", { role: "columnheader", text: t })));
  v.table.replaceChildren(head, ...r.prompts.map((p) => el("div", { class: "pc-tr", role: "row" }, [
    el("span", { role: "cell", class: "pc-label" }, [el("strong", { text: p.label }), el("span", { class: "pc-q", text: p.question })]),
    el("span", { role: "cell", class: "pc-num", text: fmtNum(p.prompt_tokens) }),
    el("span", { role: "cell", class: "pc-num", text: fmtNum(p.cached_tokens) }),
    el("span", { role: "cell", class: "pc-bars" }, [
      shareBar("pc", "is-without", p.ttft_without_ms, max, fmtMs(p.ttft_without_ms)),
      shareBar("pc", "is-with", p.ttft_with_ms, max, fmtMs(p.ttft_with_ms)),
    ]),
  ])));
}

// The chain of one prompt's blocks, each a button that shows its detail (the focus stays on it:
// selecting only toggles a class, it never rebuilds the buttons).
function renderBlocks(v, r) {
  v.blocks.replaceChildren(...r.prompts.map((p, i) => el("div", { class: "pc-brow" }, [
    el("span", { class: "pc-blabel", text: p.label }),
    el("span", { class: "pc-chain" }, p.blocks.map((b) => el("button", {
      type: "button", class: `pc-b pc-${b.status.replace(" ", "-")}`, "data-prompt": i, "data-block": b.index,
      title: `block ${b.index} (tokens ${b.start}–${b.start + b.num_tokens - 1}): ${STATUS[b.status]}${b.hash ? `; hash ${b.hash}…` : ""}`,
      onclick: () => renderDetail(v, i, b.index),
    }, [String(b.index)]))),
  ])));
  // start on the block where the first user's question breaks the chain, if there is one
  const user = r.prompts.findIndex((p, i) => i >= 2 && p.blocks.some((b) => b.status === "miss"));
  renderDetail(v, user >= 0 ? user : 1, user >= 0 ? r.prompts[user].blocks.findIndex((b) => b.status === "miss") : 0);
}

function renderDetail(v, promptIndex, blockIndex) {
  const p = v.result.prompts[promptIndex], b = p.blocks[blockIndex], bs = v.result.block_size;
  const text = p.tokens.slice(b.start, b.start + b.num_tokens).map(visibleWhitespace).join("");
  v.blocks.querySelectorAll(".pc-b").forEach((node) => {
    const on = Number(node.dataset.prompt) === promptIndex && Number(node.dataset.block) === blockIndex;
    node.classList.toggle("is-selected", on);
    node.setAttribute("aria-pressed", String(on));
  });
  v.detail.replaceChildren(
    el("p", { class: "pc-detail-head", text: `${p.label}, block ${b.index}: ${STATUS[b.status]}` }),
    el("p", { class: "pc-detail-hash", text: b.hash ? `hash(previous block's hash, these ${bs} token ids) = ${b.hash}…` : `only ${b.num_tokens} of ${bs} slots filled: no hash` }),
    el("p", { class: "pc-detail-text", text }),
    el("p", { class: "note", text: `Each block's hash covers its parent's, so a match means every token before it matches too. A change anywhere breaks the chain from that block on: `
      + `the users share the system prompt's full blocks, and the block where their questions begin misses. Only whole blocks of ${bs} are shared, `
      + "so a shared prefix is rounded down to a multiple of the block size." }),
  );
}

function render(v, r) {
  v.result = r;
  const second = r.prompts[1], m = r.machine;
  v.cached.set(r.cached_tokens, `${fmtNum(r.cached_tokens)} of ${fmtNum(second.prompt_tokens)}`);
  v.saved.set(r.ttft_saved_ms, fmtMs(r.ttft_saved_ms));
  v.without.set(second.ttft_without_ms, fmtMs(second.ttft_without_ms));
  v.withCache.set(second.ttft_with_ms, fmtMs(second.ttft_with_ms));
  v.machine.textContent = `Measured here on ${m.measured_at}: ${threadsOn(m)} (${m.processor}), `
    + `on engines beside the serving one (cache on and off, each starting empty), ${r.chunk_tokens} tokens (one block) per step. `
    + `TTFT is the sum of the engine steps up to the first token, the median of ${r.repeats} rounds; `
    + "the machine is shared with the readers being served, so timings vary from run to run.";
  renderTable(v, r);
  renderBlocks(v, r);
}

// Every prompt twice (cache on and off) on engines beside the serving one; `run` starts at 1.
function measure(ctx, job, v, run) {
  ctx.setOptions({ system: v.system.value, question: v.question.value, users: v.users.value }, OPTIONS);
  const users = v.users.value.split("\n").map((u) => u.trim()).filter(Boolean);
  return job.run({ type: "prefix_cache", system: v.system.value, question: v.question.value, users, run: run + 1 }, {
    running: "Starting two engines beside the serving one…",
    onProgress: (p) => `Measuring ${p.note}…`,
    render: (r) => render(v, r),
  });
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.button });
  return measuring(root, ctx, { job, button: v.button, measure: (run) => measure(ctx, job, v, run) }).unmount;
}

// Section 16, "Prefix caching": one question asked twice, then several users' questions after the
// same system prompt, each prefilled on an engine with the prefix cache and on one without, timed
// here. Every block of every prompt is shown with its chained hash and whether the cache held it.

import { el, field, setState } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, fmtNum, visibleWhitespace } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { run: 0, result: null };

  const system = el("textarea", { class: "text-input", rows: 3, name: "system", "aria-label": "Shared system prompt" });
  system.value = opts.system;
  const question = el("input", { class: "text-input", name: "question", "aria-label": "Question asked twice" });
  question.value = opts.question;
  const users = el("textarea", { class: "text-input", rows: 3, name: "users", "aria-label": "Other users' questions, one per line" });
  users.value = opts.users;
  const button = el("button", { type: "button", class: "pc-run", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress, button: button });

  const cached = stat("Cached tokens", { key: "cached_tokens", note: "on the second ask" });
  const saved = stat("TTFT saved", { key: "ttft_saved_ms", note: "second ask, without − with" });
  const without = stat("TTFT without", { key: "ttft_without_ms", note: "second ask, cache off" });
  const withCache = stat("TTFT with", { key: "ttft_with_ms", note: "second ask, cache on" });
  const machine = el("p", { class: "note pc-machine" });
  const table = el("div", { class: "pc-table", role: "table", "aria-label": "Each prompt, with and without the cache" });
  const blocks = el("div", { class: "pc-blocks" });
  const legend = el("div", { class: "legend pc-legend" }, Object.entries(STATUS).map(([k, v]) => el("span", { class: `pc-key pc-${k.replace(" ", "-")}`, title: v, text: k })));
  const detail = el("div", { class: "pc-detail" });

  root.append(
    el("div", { class: "pc-inputs" }, [
      field("system prompt (shared)", system),
      field("question (asked twice)", question),
      field("other users' questions, one per line", users),
    ]),
    el("div", { class: "controls" }, [button]),
    progress,
    figure("The same question, asked a second time", ["live", "measured"], [
      el("div", { class: "stats pc-stats" }, [cached.node, saved.node, without.node, withCache.node]), machine]),
    figure("Time to first token, with and without the cache", ["measured", "live"], [table]),
    figure("Which blocks matched: a hash chain over full blocks", ["live"], [legend, blocks, detail]),
  );

  function render(r) {
    state.result = r;
    const second = r.prompts[1];
    cached.set(r.cached_tokens, `${fmtNum(r.cached_tokens)} of ${fmtNum(second.prompt_tokens)}`);
    saved.set(r.ttft_saved_ms, fmtMs(r.ttft_saved_ms));
    without.set(second.ttft_without_ms, fmtMs(second.ttft_without_ms));
    withCache.set(second.ttft_with_ms, fmtMs(second.ttft_with_ms));
    const m = r.machine;
    machine.textContent = `Measured here on ${m.measured_at}: ${m.threads} torch thread${m.threads === 1 ? "" : "s"} on ${m.cpu_count} CPU${m.cpu_count === 1 ? "" : "s"} (${m.processor}), `
      + `on engines beside the serving one (cache on and off, each starting empty), ${r.chunk_tokens} tokens (one block) per step. `
      + `TTFT is the sum of the engine steps up to the first token, the median of ${r.repeats} rounds; `
      + "the machine is shared with the readers being served, so timings vary from run to run.";
    drawTable(r);
    drawBlocks(r);
  }

  function drawTable(r) {
    const max = Math.max(...r.prompts.map((p) => Math.max(p.ttft_without_ms, p.ttft_with_ms)), 1e-6);
    const head = el("div", { class: "pc-tr pc-th", role: "row" }, ["prompt", "tokens", "cached", "TTFT: without / with the cache"].map((t) => el("span", { role: "columnheader", text: t })));
    table.replaceChildren(head, ...r.prompts.map((p) => el("div", { class: "pc-tr", role: "row" }, [
      el("span", { role: "cell", class: "pc-label" }, [el("strong", { text: p.label }), el("span", { class: "pc-q", text: p.question })]),
      el("span", { role: "cell", class: "pc-num", text: fmtNum(p.prompt_tokens) }),
      el("span", { role: "cell", class: "pc-num", text: fmtNum(p.cached_tokens) }),
      el("span", { role: "cell", class: "pc-bars" }, [
        el("span", { class: "pc-bar" }, [el("span", { class: "pc-fill is-without", style: { width: `${(100 * p.ttft_without_ms) / max}%` } }), el("span", { class: "pc-bar-text", text: fmtMs(p.ttft_without_ms) })]),
        el("span", { class: "pc-bar" }, [el("span", { class: "pc-fill is-with", style: { width: `${(100 * p.ttft_with_ms) / max}%` } }), el("span", { class: "pc-bar-text", text: fmtMs(p.ttft_with_ms) })]),
      ]),
    ])));
  }

  function drawBlocks(r) {
    blocks.replaceChildren(...r.prompts.map((p, i) => el("div", { class: "pc-brow" }, [
      el("span", { class: "pc-blabel", text: p.label }),
      el("span", { class: "pc-chain" }, p.blocks.map((b) => el("button", {
        type: "button", class: `pc-b pc-${b.status.replace(" ", "-")}`, "data-prompt": i, "data-block": b.index,
        title: `block ${b.index} (tokens ${b.start}–${b.start + b.num_tokens - 1}): ${STATUS[b.status]}${b.hash ? `; hash ${b.hash}…` : ""}`,
        onclick: () => showDetail(i, b.index),
      }, [String(b.index)]))),
    ])));
    // start on the block where the first user's question breaks the chain, if there is one
    const user = r.prompts.findIndex((p, i) => i >= 2 && p.blocks.some((b) => b.status === "miss"));
    showDetail(user >= 0 ? user : 1, user >= 0 ? r.prompts[user].blocks.findIndex((b) => b.status === "miss") : 0);
  }

  function showDetail(promptIndex, blockIndex) {
    const p = state.result.prompts[promptIndex], b = p.blocks[blockIndex], bs = state.result.block_size;
    const text = p.tokens.slice(b.start, b.start + b.num_tokens).map(visibleWhitespace).join("");
    blocks.querySelectorAll(".pc-b").forEach((node) => node.classList.toggle("is-selected",
      Number(node.dataset.prompt) === promptIndex && Number(node.dataset.block) === blockIndex));
    detail.replaceChildren(
      el("p", { class: "pc-detail-head", text: `${p.label}, block ${b.index}: ${STATUS[b.status]}` }),
      el("p", { class: "pc-detail-hash", text: b.hash ? `hash(previous block's hash, these ${bs} token ids) = ${b.hash}…` : `only ${b.num_tokens} of ${bs} slots filled: no hash` }),
      el("p", { class: "pc-detail-text", text }),
      el("p", { class: "note", text: `Each block's hash covers its parent's, so a match means every token before it matches too. A change anywhere breaks the chain from that block on: `
        + `the users share the system prompt's full blocks, and the block where their questions begin misses. Only whole blocks of ${bs} are shared, `
        + "so a shared prefix is rounded down to a multiple of the block size." }),
    );
  }

  function syncOptions() {
    ctx.setOptions({ system: system.value, question: question.value, users: users.value }, OPTIONS);
  }

  function run() {
    syncOptions();
    state.run += 1;
    const list = users.value.split("\n").map((u) => u.trim()).filter(Boolean);
    return job.run({ type: "prefix_cache", system: system.value, question: question.value, users: list, run: state.run }, {
      running: "Starting two engines beside the serving one…",
      onProgress: (p) => `Measuring ${p.note}…`,
      render,
    });
  }

  button.addEventListener("click", run);
  client.ready().then(run).catch((err) => setState(root, "error", err.message));
  return () => {
    job.stop();
    root.replaceChildren();
  };
}

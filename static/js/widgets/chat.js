// Section 1, "What happens when you press Send": a real chat with the model, and beside it
// what the model actually receives (the chat template's tokens), the live timings of the answer,
// why it stopped, and the request's path through the engine, step by step.

import { el, setState, svg } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtMs, weightFormat } from "../lib/format.js";
import { tokenChips } from "../lib/tokens.js";
import { announce } from "../lib/events.js";

const SUGGESTION = "What is the capital of France?";
const KINDS = [
  ["content", "message text"],
  ["wrapper", "role wrapper"],
  ["inserted", "added by the template"],
  ["special", "special token"],
  ["generation_prompt", "assistant prompt"],
];

// Options from the URL (docs/widgets.md): the message waiting in the box, and sampling settings.
const OPTIONS = {
  message: { type: "string", default: SUGGESTION, maxLength: 2000 },
  temperature: { type: "string", default: "0", choices: ["0", "0.3", "0.7", "1"] },
  max_tokens: { type: "int", default: null, min: 1 },
  seed: { type: "int", default: null, min: 0 },
};

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { messages: [], current: null, template: null, previewSeq: 0, previewTimer: null, ready: false };
  const cleanups = [];

  // ---- left column: the conversation and this answer's numbers ----
  const log = el("div", { class: "chat-log", "aria-live": "polite" }, [
    el("p", { class: "chat-empty", text: "Ask something and press Send. The answer is generated on this server, token by token." }),
  ]);
  const input = el("textarea", { rows: 2, "aria-label": "Your message", name: "message" });
  input.value = opts.message;
  const sendButton = el("button", { type: "submit", class: "primary", text: "Send" });
  const stopButton = el("button", { type: "button", text: "Stop", disabled: true });
  const form = el("form", { class: "chat-form" }, [input, sendButton, stopButton]);
  const temperature = el("select", { "aria-label": "Temperature" },
    [["0", "0 (greedy)"], ["0.3", "0.3"], ["0.7", "0.7"], ["1", "1.0"]].map(([v, t]) => el("option", { value: v, text: t })));
  temperature.value = opts.temperature;
  const maxTokens = el("input", { type: "number", min: "1", "aria-label": "Max tokens" });
  const seed = el("input", { type: "number", min: "0", placeholder: "none", "aria-label": "Seed" });
  if (opts.seed !== null) seed.value = String(opts.seed);
  const syncOptions = () => ctx.setOptions({
    message: input.value, temperature: temperature.value,
    max_tokens: maxTokens.value === "" ? null : Number(maxTokens.value),
    seed: seed.value === "" ? null : Number(seed.value),
  }, OPTIONS);
  for (const node of [temperature, maxTokens, seed]) node.addEventListener("change", syncOptions);
  const newChat = el("button", { type: "button", text: "New chat" });
  const settings = el("div", { class: "chat-settings" }, [
    el("label", {}, ["temperature", temperature]),
    el("label", {}, ["max tokens", maxTokens]),
    el("label", {}, ["seed", seed]),
    newChat,
  ]);

  const ttft = stat("TTFT", { key: "ttft_ms", note: "arrival at the engine to first token" });
  const tpot = stat("TPOT", { key: "tpot_ms", note: "mean time per later token" });
  const generated = stat("Tokens out", { key: "completion_tokens", note: "generated so far" });
  const queued = stat("Queued", { key: "queue_ms", note: "waiting for a step" });
  const finish = el("p", { class: "finish muted", text: "No answer yet." });
  const served = el("p", { class: "served muted" });

  // ---- right column: the serialized prompt, and the request's timeline ----
  const legend = el("div", { class: "legend" }, [
    ...KINDS.map(([kind, label]) => el("span", {}, [el("span", { class: `tok tok-${kind}`, text: label })])),
    el("span", {}, [el("span", { class: "tok tok-content cached", text: "from the prefix cache" })]),
  ]);
  const ctxFill = el("div", { class: "ctx-fill", style: "width:0%" });
  const ctxCached = el("div", { class: "ctx-cached", style: "width:0%" });
  const ctxLine = el("p", { class: "ctx-line", text: "" });
  const tokens = el("div", { class: "tokens", "aria-label": "Prompt tokens" });
  const timeline = el("div", { class: "timeline" }, [el("p", { class: "tl-note", text: "Send a message to see its steps through the engine." })]);

  root.append(
    el("div", { class: "col" }, [
      figure("Conversation", ["live"], [log, form, settings]),
      figure("This answer", ["measured"], [el("div", { class: "stats" }, [ttft.node, tpot.node, generated.node, queued.node]), finish, served]),
    ]),
    el("div", { class: "col" }, [
      figure("What the model receives", ["live"], [
        el("p", { class: "muted", text: "The model never sees a chat. It sees one sequence of tokens: every message so far, wrapped by its chat template, ending with an invitation for the assistant to speak." }),
        legend,
        el("div", { class: "ctx-bar" }, [ctxCached, ctxFill]),
        ctxLine,
        tokens,
      ]),
      figure("Your request inside the engine", ["measured"], [timeline]),
    ]),
  );

  // ---- drawing ----
  function renderTemplate(t, cached = 0, note = "") {
    state.template = t;
    tokens.replaceChildren(...tokenChips(t.tokens, {
      className: (tok, i) => (i < cached ? "cached" : ""),
      title: (tok, i) => `#${i} · id ${tok.id} · ${tok.kind}${tok.role ? ` · ${tok.role}` : ""}${i < cached ? " · from the prefix cache" : ""}`,
    }));
    const window = t.context_window;
    ctxFill.style.width = `${Math.max(0, Math.min(100, (100 * (t.num_tokens - cached)) / window))}%`;
    ctxCached.style.width = `${Math.min(100, (100 * cached) / window)}%`;
    ctxLine.textContent = `${t.num_tokens.toLocaleString()} of ${window.toLocaleString()} tokens of context${note ? ` · ${note}` : ""}`;
  }

  function drawTimeline(done) {
    const tl = done.timeline;
    const total = Math.max(tl.finished_ms || 0, 1);
    const W = 640, H = 128, left = 64, right = 12;
    const x = (t) => left + (Math.max(0, t) / total) * (W - left - right);
    const lanes = { queued: 18, prefill: 46, decode: 74 };
    const parts = [];
    for (const [name, y] of Object.entries(lanes)) {
      parts.push(svg("text", { x: 4, y: y + 11, "font-size": 11, fill: "#6a6f78", text: name }));
    }
    const q = tl.first_scheduled_ms ?? 0;
    parts.push(svg("rect", { x: x(0), y: lanes.queued, width: Math.max(1.5, x(q) - x(0)), height: 14, fill: "#b9b5ab" },
      [svg("title", { text: `queued ${fmtMs(q)}` })]));
    for (const s of tl.steps) {
      const y = s.kind === "prefill" ? lanes.prefill : lanes.decode;
      const others = s.batch_seqs - 1;
      parts.push(svg("rect", {
        x: x(s.start_ms), y, width: Math.max(1.2, x(s.start_ms + s.duration_ms) - x(s.start_ms)), height: 14,
        fill: s.kind === "prefill" ? "#4b7bd8" : "#e09a2c", opacity: others > 0 ? 1 : 0.75,
      }, [svg("title", { text: `step ${s.step}: ${s.kind}, ${s.num_tokens} of your tokens; the step computed ${s.batch_tokens} tokens for ${s.batch_seqs} request${s.batch_seqs > 1 ? "s" : ""}; ${fmtMs(s.duration_ms)}` })]));
    }
    if (tl.first_token_ms !== null) {
      const fx = x(tl.first_token_ms);
      parts.push(svg("line", { x1: fx, x2: fx, y1: 10, y2: 96, stroke: "#1d7a4f", "stroke-dasharray": "3 2" }));
      parts.push(svg("text", { x: Math.min(fx + 3, W - 90), y: 10, "font-size": 10, fill: "#1d7a4f", text: `first token ${fmtMs(tl.first_token_ms)}` }));
    }
    parts.push(svg("line", { x1: x(0), x2: x(total), y1: 100, y2: 100, stroke: "#999" }));
    for (const t of [0, total / 2, total]) {
      parts.push(svg("text", { x: Math.min(x(t), W - 40), y: 116, "font-size": 10, fill: "#6a6f78", "text-anchor": t === 0 ? "start" : "middle", text: fmtMs(t) }));
    }
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "Request timeline" }, parts);
    const prefills = tl.steps.filter((s) => s.kind === "prefill");
    const decodes = tl.steps.filter((s) => s.kind === "decode");
    const shared = tl.steps.filter((s) => s.batch_seqs > 1);
    const maxOthers = Math.max(0, ...tl.steps.map((s) => s.batch_seqs - 1));
    const prefilled = prefills.reduce((sum, s) => sum + s.num_tokens, 0);
    const note = `Arrived at 0, waited ${fmtMs(q)} in the queue, prefilled ${prefilled} tokens in ${prefills.length} step${prefills.length === 1 ? "" : "s"}, then ${decodes.length} decode steps of one token each. `
      + (shared.length ? `${shared.length} of ${tl.steps.length} steps were shared with other requests (up to ${maxOthers} at once): their tokens went through the model in the same matrix multiplies.`
        : "No other request shared these steps.");
    timeline.replaceChildren(chart, el("p", { class: "tl-note", text: note }));
  }

  function finishText(done) {
    switch (done.finish_reason) {
      case "stop":
        return typeof done.stop_reason === "number"
          ? `Stopped: the model produced its end-of-turn token ${done.stop_reason_text} (id ${done.stop_reason}).`
          : `Stopped: the text reached the stop string "${done.stop_reason}".`;
      case "length":
        return `Stopped: it reached the limit of ${done.completion_tokens} tokens (max tokens or the context window).`;
      case "abort":
        return "Stopped: you pressed Stop. The request was aborted and its KV blocks went back to the pool.";
      default:
        return `Stopped: ${done.finish_reason}.`;
    }
  }

  function bubble(role, text) {
    log.querySelector(".chat-empty")?.remove();
    const body = el("span", { class: "msg-text", text });
    const node = el("div", { class: `msg msg-${role}` }, [el("span", { class: "msg-role", text: role }), body]);
    log.append(node);
    log.scrollTop = log.scrollHeight;
    return { node, body };
  }

  // ---- the prompt preview, as you type ----
  function draftMessages() {
    const text = input.value.trim();
    return text ? [...state.messages, { role: "user", content: text }] : state.messages.slice();
  }

  function preview() {
    const messages = draftMessages();
    if (!messages.length) {
      tokens.replaceChildren();
      ctxLine.textContent = "";
      return Promise.resolve();
    }
    const seq = ++state.previewSeq;
    return client.call({ type: "template", messages }).then((t) => {
      if (seq === state.previewSeq && !state.current) renderTemplate(t, 0, "if you press Send now");
    });
  }

  input.addEventListener("input", () => {
    syncOptions();
    clearTimeout(state.previewTimer);
    state.previewTimer = setTimeout(() => preview().catch(() => {}), 250);
  });

  // ---- sending ----
  function busy(on) {
    sendButton.disabled = on;
    stopButton.disabled = !on;
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || state.current) return;
    clearTimeout(state.previewTimer);
    state.messages.push({ role: "user", content: text });
    const messages = state.messages.slice();
    input.value = "";
    bubble("user", text);
    const answer = bubble("assistant", "");
    answer.node.classList.add("streaming");
    for (const s of [ttft, tpot, generated, queued]) s.set(null);
    finish.textContent = "Generating…";
    ++state.previewSeq;
    client.call({ type: "template", messages }).then((t) => {
      if (state.current) renderTemplate(t, 0, "sent in full, computing…");
    }).catch(() => {});

    const body = { type: "generate", messages, temperature: Number(temperature.value) };
    if (maxTokens.value !== "") body.max_tokens = Number(maxTokens.value);
    if (seed.value !== "") body.seed = Number(seed.value);
    let count = 0, first = null, last = null;
    busy(true);
    state.current = client.request(body, (msg) => {
      if (msg.type === "accepted") {
        finish.textContent = `Sent ${msg.prompt_tokens} tokens; generating up to ${msg.max_tokens}…`;
      } else if (msg.type === "token") {
        answer.body.textContent += msg.text;
        count += 1;
        if (first === null) first = msg.t_ms;
        last = msg.t_ms;
        ttft.set(first, fmtMs(first));
        tpot.set(count > 1 ? (last - first) / (count - 1) : null, count > 1 ? fmtMs((last - first) / (count - 1)) : "–");
        generated.set(count);
        log.scrollTop = log.scrollHeight;
      } else if (msg.type === "done") {
        state.current = null;
        busy(false);
        answer.node.classList.remove("streaming");
        answer.body.textContent = msg.text;
        if (msg.text) state.messages.push({ role: "assistant", content: msg.text });
        ttft.set(msg.metrics.ttft_ms, fmtMs(msg.metrics.ttft_ms));
        tpot.set(msg.metrics.tpot_ms, fmtMs(msg.metrics.tpot_ms));
        generated.set(msg.completion_tokens);
        queued.set(msg.metrics.queue_ms, fmtMs(msg.metrics.queue_ms));
        finish.textContent = `${finishText(msg)} End to end ${fmtMs(msg.metrics.e2e_ms)}.`;
        if (state.template) {
          const cached = msg.num_cached_tokens;
          renderTemplate(state.template, cached, cached
            ? `all ${msg.prompt_tokens} sent again; ${cached} came from the prefix cache, ${msg.prompt_tokens - cached} were computed now`
            : `all ${msg.prompt_tokens} computed now (nothing cached yet)`);
        }
        drawTimeline(msg);
        announce("chat-done", msg);  // for the timings of section 8 (phases)
        setState(root, "ready");
      } else if (msg.type === "error") {
        state.current = null;
        busy(false);
        answer.node.classList.remove("streaming");
        answer.body.textContent = `(no answer: ${msg.message})`;
        state.messages.pop();
        finish.textContent = `The server refused this request: ${msg.message}`;
        setState(root, "error", msg.message);
      }
    });
  });

  stopButton.addEventListener("click", () => state.current?.abort());
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  newChat.addEventListener("click", () => {
    if (state.current) return;
    state.messages = [];
    log.replaceChildren(el("p", { class: "chat-empty", text: "New conversation." }));
    preview().catch(() => {});
  });

  // ---- connection ----
  cleanups.push(client.onStatus((status) => {
    if (status === "closed") setState(root, "error", "The connection to the server was lost; reconnecting…");
  }));
  const timeout = setTimeout(() => {
    if (root.dataset.state !== "ready") setState(root, "error", "Cannot reach the sendlens server.");
  }, 20000);
  const start = () => client.ready().then((hello) => {
    const limits = hello.limits;
    served.textContent = `Served with ${weightFormat(hello.weight_format)}.`;
    maxTokens.max = String(limits.max_tokens_limit);
    if (maxTokens.value === "") {
      maxTokens.value = String(opts.max_tokens !== null && opts.max_tokens <= limits.max_tokens_limit
        ? opts.max_tokens : limits.default_max_tokens);
    }
    return preview();
  }).then(() => {
    clearTimeout(timeout);
    setState(root, "ready");
  }).catch((err) => setState(root, "error", err.message));
  start();
  cleanups.push(client.onStatus((status) => { if (status === "open" && root.dataset.state === "error") start(); }));
  return () => {
    clearTimeout(timeout);
    clearTimeout(state.previewTimer);
    state.current?.abort();
    cleanups.forEach((fn) => fn());
    root.replaceChildren();
  };
}

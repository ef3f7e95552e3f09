// Section 1, "What happens when you press Send": a real chat with the model, and beside it
// what the model actually receives (the chat template's tokens), the live timings of the answer,
// why it stopped, and the request's path through the engine, step by step.

import { describeChart, el, scrollBox, setDisabled, setState, svg } from "../lib/dom.js";
import { figure, view as viewOf } from "../lib/figures.js";
import { fmtMs, weightFormat } from "../lib/format.js";
import { tokenChips } from "../lib/tokens.js";
import { announce } from "../lib/events.js";
import { jobRunner } from "../lib/job.js";
import { mountView, teardown } from "../lib/lifecycle.js";

const SUGGESTION = "What is the capital of France?";
// The template view's legend: a chip of each kind of token (its classes after "tok-"), named.
const KINDS = [["content", "message text"], ["wrapper", "role wrapper"], ["inserted", "added by the template"],
  ["special", "special token"], ["generation_prompt", "assistant prompt"], ["content cached", "from the prefix cache"]];

// Options from the URL (docs/widgets.md): the message waiting in the box, and sampling settings.
const OPTIONS = {
  message: { type: "string", default: SUGGESTION, maxLength: 2000 },
  temperature: { type: "string", default: "0", choices: ["0", "0.3", "0.7", "1"] },
  max_tokens: { type: "int", default: null, min: 1 },
  seed: { type: "int", default: null, min: 0 },
};

const TILES = {  // name: a stat tile [label, figure key, note]
  ttft: ["TTFT", "ttft_ms", "arrival at the engine to first token"], tpot: ["TPOT", "tpot_ms", "mean time per later token"],
  generated: ["Tokens out", "completion_tokens", "generated so far"], queued: ["Queued", "queue_ms", "waiting for a step"],
};

function build(opts) {
  const view = {
    log: scrollBox(el("div", { class: "chat-log", "aria-live": "polite" }, [
      el("p", { class: "chat-empty", text: "Ask something and press Send. The answer is generated on this server, token by token." }),
    ]), "Conversation"),
    input: el("textarea", { rows: 2, "aria-label": "Your message", name: "message" }),
    sendButton: el("button", { type: "submit", class: "primary", text: "Send" }),
    stopButton: el("button", { type: "button", text: "Stop", disabled: true }),
    temperature: el("select", { "aria-label": "Temperature" },
      [["0", "0 (greedy)"], ["0.3", "0.3"], ["0.7", "0.7"], ["1", "1.0"]].map(([v, t]) => el("option", { value: v, text: t }))),
    maxTokens: el("input", { type: "number", min: "1", "aria-label": "Max tokens" }),
    seed: el("input", { type: "number", min: "0", placeholder: "none", "aria-label": "Seed" }),
    newChat: el("button", { type: "button", text: "New chat" }),
    ...viewOf(TILES),
    finish: el("p", { class: "finish muted", text: "No answer yet." }),
    served: el("p", { class: "served muted" }),
    ctxFill: el("div", { class: "ctx-fill", style: "width:0%" }),
    ctxCached: el("div", { class: "ctx-cached", style: "width:0%" }),
    ctxLine: el("p", { class: "ctx-line", text: "" }),
    tokens: scrollBox(el("div", { class: "tokens" }), "Prompt tokens"),
    timeline: el("div", { class: "timeline" }, [el("p", { class: "tl-note", text: "Send a message to see its steps through the engine." })]),
  };
  const v = view;
  v.input.value = opts.message;
  v.temperature.value = opts.temperature;
  if (opts.seed !== null) v.seed.value = String(opts.seed);
  v.form = el("form", { class: "chat-form" }, [v.input, v.sendButton, v.stopButton]);
  const legend = el("div", { class: "legend" }, KINDS.map(([kind, label]) => el("span", {}, [el("span", { class: `tok tok-${kind}`, text: label })])));
  const settings = el("div", { class: "chat-settings" }, [
    el("label", {}, ["temperature", v.temperature]), el("label", {}, ["max tokens", v.maxTokens]), el("label", {}, ["seed", v.seed]), v.newChat,
  ]);
  view.nodes = [
    el("div", { class: "col" }, [
      figure("Conversation", ["live"], [v.log, v.form, settings]),
      figure("This answer", ["measured"], [el("div", { class: "stats" }, [v.ttft.node, v.tpot.node, v.generated.node, v.queued.node]), v.finish, v.served]),
    ]),
    el("div", { class: "col" }, [
      figure("What the model receives", ["live"], [
        el("p", { class: "muted", text: "The model never sees a chat. It sees one sequence of tokens: every message so far, wrapped by its chat template, ending with an invitation for the assistant to speak." }),
        legend, el("div", { class: "ctx-bar" }, [v.ctxCached, v.ctxFill]), v.ctxLine, v.tokens,
      ]),
      figure("Your request inside the engine", ["measured"], [v.timeline]),
    ]),
  ];
  return view;
}

// The serialized prompt as chips; the first `cached` came from the prefix cache.
export function renderTemplate(view, t, cached = 0, note = "") {
  view.tokens.replaceChildren(...tokenChips(t.tokens, {
    className: (tok, i) => (i < cached ? "cached" : ""),
    title: (tok, i) => `#${i} · id ${tok.id} · ${tok.kind}${tok.role ? ` · ${tok.role}` : ""}${i < cached ? " · from the prefix cache" : ""}`,
  }));
  const window = t.context_window;
  view.ctxFill.style.width = `${Math.max(0, Math.min(100, (100 * (t.num_tokens - cached)) / window))}%`;
  view.ctxCached.style.width = `${Math.min(100, (100 * cached) / window)}%`;
  view.ctxLine.textContent = `${t.num_tokens.toLocaleString()} of ${window.toLocaleString()} tokens of context${note ? ` · ${note}` : ""}`;
}

// The request's steps through the engine as lanes (queued, prefill, decode) on one time axis.
function timelineChart(tl) {
  const total = Math.max(tl.finished_ms || 0, 1);
  const W = 640, H = 128, left = 64, right = 12;
  const x = (t) => left + (Math.max(0, t) / total) * (W - left - right);
  const lanes = { queued: 18, prefill: 46, decode: 74 };
  const parts = Object.entries(lanes).map(([name, y]) => svg("text", { x: 4, y: y + 11, "font-size": 11, fill: "#6a6f78", text: name }));
  const q = tl.first_scheduled_ms ?? 0;
  parts.push(svg("rect", { x: x(0), y: lanes.queued, width: Math.max(1.5, x(q) - x(0)), height: 14, fill: "#b9b5ab" },
    [svg("title", { text: `queued ${fmtMs(q)}` })]));
  for (const s of tl.steps) {
    const others = s.batch_seqs - 1;
    parts.push(svg("rect", {
      x: x(s.start_ms), y: s.kind === "prefill" ? lanes.prefill : lanes.decode, width: Math.max(1.2, x(s.start_ms + s.duration_ms) - x(s.start_ms)), height: 14,
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
  return svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "Request timeline" }, parts);
}

// The timeline and its summary in words.
export function renderTimeline(view, done) {
  const tl = done.timeline;
  const q = tl.first_scheduled_ms ?? 0;
  const prefills = tl.steps.filter((s) => s.kind === "prefill");
  const decodes = tl.steps.filter((s) => s.kind === "decode");
  const shared = tl.steps.filter((s) => s.batch_seqs > 1);
  const maxOthers = Math.max(0, ...tl.steps.map((s) => s.batch_seqs - 1));
  const prefilled = prefills.reduce((sum, s) => sum + s.num_tokens, 0);
  const note = `Arrived at 0, waited ${fmtMs(q)} in the queue, prefilled ${prefilled} tokens in ${prefills.length} step${prefills.length === 1 ? "" : "s"}, then ${decodes.length} decode steps of one token each. `
    + (shared.length ? `${shared.length} of ${tl.steps.length} steps were shared with other requests (up to ${maxOthers} at once): their tokens went through the model in the same matrix multiplies.`
      : "No other request shared these steps.");
  const summary = el("p", { class: "tl-note", text: note });
  view.timeline.replaceChildren(describeChart(timelineChart(tl), "Request timeline", summary), summary);
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

function bubble(log, role, text) {
  log.querySelector(".chat-empty")?.remove();
  const body = el("span", { class: "msg-text", text });
  const node = el("div", { class: `msg msg-${role}` }, [el("span", { class: "msg-role", text: role }), body]);
  log.append(node);
  log.scrollTop = log.scrollHeight;
  return { node, body };
}

// Send and Stop trade places; the focus goes with them (turn on the one taking over first).
function busy(view, on) {
  if (on) {
    setDisabled(view.stopButton, false);
    setDisabled(view.sendButton, true, view.stopButton);
  } else {
    setDisabled(view.sendButton, false);
    setDisabled(view.stopButton, true, view.sendButton);
  }
}

// One answer streamed into its bubble: its tokens, then its numbers, template and timeline.
// Returns the function that handles each reply of the generate request.
function answerStream(view, state, answer, onEnd) {
  let count = 0, first = null;
  return (msg) => {
    if (msg.type === "waiting") {
      view.finish.textContent = `Waiting to send again by itself: ${msg.message}`;
    } else if (msg.type === "accepted") {
      view.finish.textContent = `Sent ${msg.prompt_tokens} tokens; generating up to ${msg.max_tokens}…`;
    } else if (msg.type === "token") {
      answer.body.textContent += msg.text;
      count += 1;
      if (first === null) first = msg.t_ms;
      const tpot = count > 1 ? (msg.t_ms - first) / (count - 1) : null;
      view.ttft.set(first, fmtMs(first));
      view.tpot.set(tpot, tpot === null ? "–" : fmtMs(tpot));
      view.generated.set(count);
      view.log.scrollTop = view.log.scrollHeight;
    } else if (msg.type === "done" || msg.type === "error") {
      answer.node.classList.remove("streaming");
      if (msg.type === "done") renderDone(view, state, answer, msg);
      else {
        answer.body.textContent = `(no answer: ${msg.message})`;
        state.messages.pop();
        view.finish.textContent = `The server refused this request: ${msg.message}`;
      }
      onEnd(msg);
    }
  };
}

function renderDone(view, state, answer, msg) {
  answer.body.textContent = msg.text;
  if (msg.text) state.messages.push({ role: "assistant", content: msg.text });
  view.ttft.set(msg.metrics.ttft_ms, fmtMs(msg.metrics.ttft_ms));
  view.tpot.set(msg.metrics.tpot_ms, fmtMs(msg.metrics.tpot_ms));
  view.generated.set(msg.completion_tokens);
  view.queued.set(msg.metrics.queue_ms, fmtMs(msg.metrics.queue_ms));
  view.finish.textContent = `${finishText(msg)} End to end ${fmtMs(msg.metrics.e2e_ms)}.`;
  if (state.template) {
    const cached = msg.num_cached_tokens;
    renderTemplate(view, state.template, cached, cached
      ? `all ${msg.prompt_tokens} sent again; ${cached} came from the prefix cache, ${msg.prompt_tokens - cached} were computed now`
      : `all ${msg.prompt_tokens} computed now (nothing cached yet)`);
  }
  renderTimeline(view, msg);
}

// ---- the widget's behaviour, on w = { root, ctx, view, state, job } ----
function syncOptions(w) {
  const v = w.view;
  w.ctx.setOptions({
    message: v.input.value, temperature: v.temperature.value,
    max_tokens: v.maxTokens.value === "" ? null : Number(v.maxTokens.value),
    seed: v.seed.value === "" ? null : Number(v.seed.value),
  }, OPTIONS);
}

// The prompt as it would go if Send were pressed now (quiet: typing never raises an error).
function preview(w, quiet = true) {
  const { view, state } = w;
  const text = view.input.value.trim();
  const messages = text ? [...state.messages, { role: "user", content: text }] : state.messages.slice();
  if (!messages.length) {
    view.tokens.replaceChildren();
    view.ctxLine.textContent = "";
    return w.job.run(async () => null, { quiet });
  }
  return w.job.run({ type: "template", messages }, {
    quiet,
    render: (t) => { if (!state.current) { state.template = t; renderTemplate(view, t, 0, "if you press Send now"); } },
  });
}

// Send the conversation so far: the answer streams into a new bubble.
function send(w, text) {
  const { view, state, root } = w;
  clearTimeout(state.previewTimer);
  state.messages.push({ role: "user", content: text });
  const messages = state.messages.slice();
  view.input.value = "";
  bubble(view.log, "user", text);
  const answer = bubble(view.log, "assistant", "");
  answer.node.classList.add("streaming");
  for (const s of [view.ttft, view.tpot, view.generated, view.queued]) s.set(null);
  view.finish.textContent = "Generating…";
  w.job.run({ type: "template", messages }, {
    quiet: true,
    render: (t) => { if (state.current) { state.template = t; renderTemplate(view, t, 0, "sent in full, computing…"); } },
  });
  const body = { type: "generate", messages, temperature: Number(view.temperature.value) };
  if (view.maxTokens.value !== "") body.max_tokens = Number(view.maxTokens.value);
  if (view.seed.value !== "") body.seed = Number(view.seed.value);
  busy(view, true);
  state.current = w.ctx.client.request(body, answerStream(view, state, answer, (msg) => {
    state.current = null;
    busy(view, false);
    if (msg.type === "error") { setState(root, "error", msg.message); return; }
    announce("chat-done", msg);  // for the timings of section 8 (phases)
    setState(root, "ready");
  }));
}

function listen(w) {
  const { view, state } = w;
  for (const node of [view.temperature, view.maxTokens, view.seed]) node.addEventListener("change", () => syncOptions(w));
  view.input.addEventListener("input", () => {
    syncOptions(w);
    clearTimeout(state.previewTimer);
    state.previewTimer = setTimeout(() => preview(w), 250);
  });
  view.form.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = view.input.value.trim();
    if (text && !state.current) send(w, text);
  });
  view.stopButton.addEventListener("click", () => state.current?.abort());
  view.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      view.form.requestSubmit();
    }
  });
  view.newChat.addEventListener("click", () => {
    if (state.current) return;
    state.messages = [];
    view.log.replaceChildren(el("p", { class: "chat-empty", text: "New conversation." }));
    preview(w);
  });
}

// The server's limits and format, then the first preview.
function start(w, hello, opts) {
  const { view } = w;
  const limits = hello.limits;
  view.served.textContent = `Served with ${weightFormat(hello.weight_format, hello.activation_rounding, hello.attention_operands)}.`;
  view.maxTokens.max = String(limits.max_tokens_limit);
  if (view.maxTokens.value === "") {
    view.maxTokens.value = String(opts.max_tokens !== null && opts.max_tokens <= limits.max_tokens_limit ? opts.max_tokens : limits.default_max_tokens);
  }
  return preview(w, false);
}

export function mount(root, ctx) {
  const { opts, view } = mountView(root, ctx, OPTIONS, build);
  const w = { root, ctx, view, state: { messages: [], current: null, template: null, previewTimer: null }, job: jobRunner(root, { client: ctx.client }) };
  listen(w);
  const timeout = setTimeout(() => {
    if (root.dataset.state !== "ready") setState(root, "error", "Cannot reach the sendlens server.");
  }, 20000);
  const offStatus = ctx.connected((hello) => start(w, hello, opts).then(() => { if (root.dataset.state === "ready") clearTimeout(timeout); }));
  return teardown(root, [() => clearTimeout(timeout), () => clearTimeout(w.state.previewTimer), w.job.stop,
    () => w.state.current?.abort(), offStatus]);
}

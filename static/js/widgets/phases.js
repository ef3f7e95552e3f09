// Section 8, "Two phases": prefill and decode timed on this server's own engine (a sibling of the
// serving engine, so visitors are not slowed beyond one step). Left: prefill time against prompt
// length; right: each decode step as the context grows. The reader's own request goes on the same
// axes: the chat's last answer (its `done`, announced through lib/events.js), or
// one sent from this widget (a plain `generate`), with its TTFT, TPOT and end to end. Below:
// the machine's measured memory bandwidth and FLOP/s, and why they bound decode and prefill.

import { describeChart, el, field, select, setDisabled } from "../lib/dom.js";
import { plot } from "../lib/chart.js";
import { figure } from "../lib/figures.js";
import { listen } from "../lib/events.js";
import { fmtMs, fmtNum, fmtBytes, weightFormat } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { measuredAt, measuring, progressLine, threadsOn, view } from "../lib/measure.js";

const LENGTHS = [16, 32, 64, 128, 256, 512, 1024, 2048];

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  max_prompt: { type: "int", default: 256, choices: LENGTHS },
  decode_tokens: { type: "int", default: 16, min: 1, max: 128 },
  question: { type: "string", default: "Why is the sky blue?", maxLength: 500 },
};

// A tick step for an axis of whole numbers from lo to hi: about 8 ticks, never a fraction.
function integerStep(lo, hi) {
  return Math.max(1, Math.ceil((hi - lo) / 8));
}

const COLORS = { prefill: "#2f5fd0", decode: "#1d7a4f", mine: "#d0702f", floor: "#9aa0a8" };

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  prefillChart: "div.chart.phases-chart", prefillNote: "p.note", decodeChart: "div.chart.phases-chart", decodeNote: "p.note",
  threads: ["Threads", "threads", "torch threads used"], machineLine: "p.note.machine",
  prefillRate: ["Prefill", "prefill_tokens_per_s", "prompt tokens per second"],
  decodeStep: ["Decode step", "decode_step_ms", "median, one token"], ttft: ["TTFT", "request_ttft_ms", "arrival → first token"],
  tpot: ["TPOT", "request_tpot_ms", "mean gap after the first"], e2e: ["End to end", "request_e2e_ms", "arrival → last token"],
  definitions: "dl.phases-defs", bandwidth: ["Memory bandwidth", "memory_bandwidth_gb_s", "GB/s read, best of 3"],
  flops: ["Matmul", "matmul_gflop_s", "GFLOP/s float32, best of 3"],
  floor: ["Decode floor", "decode_floor_ms", "weights ÷ bandwidth"],
  ceiling: ["Prefill ceiling", "prefill_ceiling_tokens_per_s", "tokens/s: FLOP/s ÷ FLOPs per token"], why: "div.phases-why",
};

function build(opts) {
  const v = {
    maxPrompt: select(LENGTHS.map((n) => [n, `${n.toLocaleString("en-US")} tokens`]), opts.max_prompt, { "aria-label": "Longest prompt", name: "max_prompt" }),
    decodeTokens: el("input", { type: "number", min: 1, max: 128, step: 1, name: "decode_tokens", value: String(opts.decode_tokens), "aria-label": "Decode steps" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    question: el("input", { type: "text", class: "text-input", name: "question", value: opts.question, "aria-label": "Your request" }),
    send: el("button", { type: "button", text: "Send and time it" }),
    requestNote: el("p", { class: "note", text: "Ask the chat above, or send a question from here: its TTFT and TPOT join both charts." }),
    result: null, request: null, current: null,
    ...view(VIEW),
  };
  describeChart(v.prefillChart, "Prefill time against prompt length", v.prefillNote);
  describeChart(v.decodeChart, "Decode step time against context length", v.decodeNote);
  v.nodes = layout(v);
  return v;
}

function layout(v) {
  return [
    el("div", { class: "controls" }, [field("longest prompt", v.maxPrompt), field("decode steps", v.decodeTokens), v.again]),
    v.progress,
    el("div", { class: "phases-machine machine-line" }, [v.threads.node, v.machineLine]),
    el("div", { class: "phases-grid two-up" }, [
      figure("Prefill: time against prompt length", ["measured"], [v.prefillChart, el("div", { class: "stats" }, [v.prefillRate.node]), v.prefillNote]),
      figure("Decode: each step as the context grows", ["measured"], [v.decodeChart, el("div", { class: "stats" }, [v.decodeStep.node]), v.decodeNote]),
    ]),
    figure("Your own request on the same axes", ["measured"], [
      el("div", { class: "controls" }, [v.question, v.send]),
      el("div", { class: "stats" }, [v.ttft.node, v.tpot.node, v.e2e.node]),
      v.requestNote, v.definitions,
    ]),
    figure("Why prefill is compute-bound and decode memory-bound", ["measured", "computed"], [
      el("div", { class: "stats" }, [v.bandwidth.node, v.flops.node, v.floor.node, v.ceiling.node]),
      v.why,
    ]),
  ];
}

// The reader's request, once it has a first token.
function mine(v) {
  const r = v.request;
  return r && r.metrics && r.metrics.ttft_ms !== null ? r : null;
}

function drawPrefill(v, r) {
  const req = mine(v);
  const x = r.prefill.map((p) => p.prompt_tokens);
  const data = [{
    type: "scatter", mode: "lines+markers", name: "prefill (sweep)", x, y: r.prefill.map((p) => p.ms),
    line: { color: COLORS.prefill, width: 2 }, marker: { size: 7, color: COLORS.prefill },
    customdata: r.prefill.map((p) => p.steps.length),
    hovertemplate: "%{x} tokens: %{y:.1f} ms in %{customdata} step(s)<extra></extra>",
  }];
  if (req) {
    data.push({
      type: "scatter", mode: "markers", name: "your request (TTFT)", x: [req.prompt_tokens], y: [req.metrics.ttft_ms],
      marker: { size: 12, symbol: "star", color: COLORS.mine },
      hovertemplate: "your request: %{x} prompt tokens, TTFT %{y:.1f} ms<extra></extra>",
    });
  }
  return plot(v.prefillChart, data, {
    height: 240, showlegend: Boolean(req), legend: { orientation: "h", y: 1.15, x: 0, font: { size: 10 } },
    margin: { t: req ? 24 : 8, b: 40, l: 52 },
    xaxis: { type: "log", tickvals: LENGTHS, title: { text: "prompt tokens", font: { size: 10 } } },
    yaxis: { title: { text: "prefill time (ms)", font: { size: 10 } }, rangemode: "tozero" },
  });
}

function drawDecode(v, r) {
  const req = mine(v);
  const x = r.decode.map((d) => d.context);
  const data = [
    {
      type: "scatter", mode: "lines+markers", name: "decode step", x, y: r.decode.map((d) => d.ms),
      line: { color: COLORS.decode, width: 1.5 }, marker: { size: 5, color: COLORS.decode },
      hovertemplate: "context %{x}: %{y:.1f} ms<extra></extra>",
    },
    {
      type: "scatter", mode: "lines", name: "floor: weights ÷ bandwidth", x: [x[0], x[x.length - 1]],
      y: [r.decode_floor_ms, r.decode_floor_ms], line: { color: COLORS.floor, dash: "dash", width: 1.5 },
      hovertemplate: "floor %{y:.1f} ms<extra></extra>",
    },
  ];
  const mid = req && req.metrics.tpot_ms !== null ? req.prompt_tokens + Math.round(req.completion_tokens / 2) : null;
  if (mid !== null) {
    data.push({
      type: "scatter", mode: "markers", name: "your request (TPOT)", x: [mid], y: [req.metrics.tpot_ms],
      marker: { size: 12, symbol: "star", color: COLORS.mine },
      hovertemplate: "your request: TPOT %{y:.1f} ms around context %{x}<extra></extra>",
    });
  }
  return plot(v.decodeChart, data, {
    height: 240, showlegend: true, legend: { orientation: "h", y: 1.15, x: 0, font: { size: 10 } },
    margin: { t: 24, b: 40, l: 52 },
    xaxis: { title: { text: "context (tokens the step attends over)", font: { size: 10 } }, dtick: integerStep(Math.min(x[0], mid ?? x[0]), Math.max(x[x.length - 1], mid ?? 0)) },
    yaxis: { title: { text: "step time (ms)", font: { size: 10 } }, rangemode: "tozero" },
  });
}

function renderWhy(v, r) {
  v.bandwidth.set(r.memory_bandwidth_gb_s, fmtNum(r.memory_bandwidth_gb_s, 3));
  v.flops.set(r.matmul_gflop_s, fmtNum(r.matmul_gflop_s, 3));
  v.floor.set(r.decode_floor_ms, fmtMs(r.decode_floor_ms));
  v.ceiling.set(r.prefill_ceiling_tokens_per_s, fmtNum(r.prefill_ceiling_tokens_per_s, 3));
  const p = (text) => el("p", { text });
  v.why.replaceChildren(
    p(`Every step reads all ${fmtBytes(r.weight_bytes)} of weights (${fmtNum(r.num_params / 1e6, 3)} M parameters, `
      + `${weightFormat(r.weight_format, r.activation_rounding, r.attention_operands)}). `
      + `At ${fmtNum(r.memory_bandwidth_gb_s, 3)} GB/s that alone takes ${fmtMs(r.decode_floor_ms)}.`),
    p(`Decode puts one token through them: about ${fmtNum(r.flops_per_token / 1e6, 3)} MFLOPs, `
      + `${fmtNum(r.decode_intensity, 2)} FLOPs per byte read. This machine can do ${fmtNum(r.machine_balance, 3)} FLOPs `
      + "in the time it reads one byte, so in decode the arithmetic units wait on memory: memory-bound. "
      + `Measured: ${fmtMs(r.decode_step_ms)} a step, against the ${fmtMs(r.decode_floor_ms)} floor.`),
    p(`Prefill puts ${r.chunk_tokens} tokens through the same weights in one step: ${fmtNum(r.prefill_intensity, 3)} FLOPs per byte, `
      + `more than the machine's ${fmtNum(r.machine_balance, 3)}, so the arithmetic is the limit: compute-bound. `
      + `At ${fmtNum(r.matmul_gflop_s, 3)} GFLOP/s the ceiling is ${fmtNum(r.prefill_ceiling_tokens_per_s, 3)} tokens/s; `
      + `measured: ${fmtNum(r.prefill_tokens_per_s, 3)}.`),
  );
}

function renderDefinitions(v) {
  const r = v.result, req = mine(v);
  const predicted = (n) => r ? n / r.prefill_tokens_per_s * 1000 : null;
  const items = [
    ["TTFT, time to first token", "From the request's arrival to its first token: waiting, then prefill of the whole prompt. "
      + (req && r ? `Yours: ${fmtMs(req.metrics.ttft_ms)} for ${req.prompt_tokens} prompt tokens (the sweep predicts about ${fmtMs(predicted(req.prompt_tokens))} of prefill; `
        + `it waited ${fmtMs(req.metrics.queue_ms)} in the queue).` : "It grows with the prompt.")],
    ["TPOT, time per output token", "The mean gap between tokens after the first: one decode step each, shared with whoever else is being served. "
      + (req && req.metrics.tpot_ms !== null && r ? `Yours: ${fmtMs(req.metrics.tpot_ms)}; the sweep's decode step: ${fmtMs(r.decode_step_ms)}.` : "")],
    ["End to end", "Arrival to the last token: about TTFT + (tokens − 1) × TPOT. "
      + (req ? `Yours: ${fmtMs(req.metrics.e2e_ms)} for ${req.completion_tokens} tokens.` : "")],
  ];
  v.definitions.replaceChildren(...items.flatMap(([t, d]) => [el("dt", { text: t }), el("dd", { text: d })]));
}

async function render(v, r) {
  const m = r.machine, longest = r.prefill[r.prefill.length - 1];
  v.result = r;
  v.threads.set(m.threads, `${m.threads} of ${m.cpu_count}`);
  v.machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${threadsOn(m)}, `
    + `torch ${m.torch}, ${measuredAt(m)}. The machine is shared, so the times move from run to run; the shapes do not.`;
  v.prefillRate.set(r.prefill_tokens_per_s, fmtNum(r.prefill_tokens_per_s, 3));
  v.decodeStep.set(r.decode_step_ms, fmtMs(r.decode_step_ms));
  v.prefillNote.textContent = `Each point is one prompt's prefill, run in chunks of ${r.chunk_tokens} tokens (one engine step each) `
    + `and timed as a whole: ${longest.prompt_tokens.toLocaleString("en-US")} tokens took ${fmtMs(longest.ms)} in ${longest.steps.length} step(s). `
    + "Doubling the prompt about doubles the work; the shared machine adds noise to the time.";
  v.decodeNote.textContent = `${r.decode.length} decode steps after the ${r.max_prompt.toLocaleString("en-US")}-token prompt, one token each. `
    + "Each reads every weight once, whatever the context, so steps stay nearly flat; reading the longer cache adds a little.";
  renderWhy(v, r);
  renderDefinitions(v);
  await Promise.all([drawPrefill(v, r), drawDecode(v, r)]);
}

// A finished request, from this widget's own Send or from the chat (section 1): its `done`.
function showRequest(v, msg, source) {
  v.request = msg;
  const m = msg.metrics;
  v.ttft.set(m.ttft_ms, fmtMs(m.ttft_ms));
  v.tpot.set(m.tpot_ms, fmtMs(m.tpot_ms));
  v.e2e.set(m.e2e_ms, fmtMs(m.e2e_ms));
  v.requestNote.textContent = `${source}: ${msg.prompt_tokens} prompt tokens (with the chat template), ${msg.completion_tokens} generated `
    + "on the serving engine, beside everyone else's requests. The star on each chart is yours.";
  renderDefinitions(v);
  return v.result ? Promise.all([drawPrefill(v, v.result), drawDecode(v, v.result)]) : Promise.resolve();
}

// A plain `generate` from this widget; the Send button keeps the keyboard's focus through it.
function sendRequest(v, client, sync, fail) {
  const text = v.question.value.trim();
  if (!text || v.current) return;
  sync();
  setDisabled(v.send, true);
  v.requestNote.textContent = "Sent; waiting for the answer…";
  for (const s of [v.ttft, v.tpot, v.e2e]) s.set(null);
  v.current = client.request({ type: "generate", messages: [{ role: "user", content: text }], max_tokens: 24, temperature: 0 }, (msg) => {
    if (msg.type === "waiting") v.requestNote.textContent = `Waiting to send again by itself: ${msg.message}`;
    if (msg.type !== "done" && msg.type !== "error") return;
    v.current = null;
    setDisabled(v.send, false);
    if (msg.type === "done") showRequest(v, msg, "Sent from here").catch(fail);
    else v.requestNote.textContent = `Not answered: ${msg.message}`;
  });
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const sync = () => ctx.setOptions({ max_prompt: Number(v.maxPrompt.value), decode_tokens: Number(v.decodeTokens.value), question: v.question.value }, OPTIONS);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const cleanups = [() => v.current?.abort()];
  const life = measuring(root, ctx, {
    job, button: v.again, changed: [v.maxPrompt, v.decodeTokens], charts: [v.prefillChart, v.decodeChart],
    cleanups,
    measure(run) {
      const n = Number(v.decodeTokens.value);
      if (!Number.isInteger(n) || n < 1 || n > 128) {
        v.progress.textContent = "Decode steps must be a whole number from 1 to 128.";
        return Promise.resolve();
      }
      sync();
      return job.run({ type: "phases", max_prompt: Number(v.maxPrompt.value), decode_tokens: n, run }, {
        running: "Timing the engine…",
        onProgress: (p) => `Timing: ${p.note} (${percent(p)})…`,
        render: (r) => render(v, r),
        done: (r) => `Swept ${r.prefill.length} prompt lengths and ${r.decode.length} decode steps.`,
      });
    },
  });
  // The chat widget announces each finished answer on the page (lib/events.js).
  cleanups.push(listen("chat-done", (msg) => showRequest(v, msg, "Your last chat answer").catch(life.fail)));
  v.send.addEventListener("click", () => sendRequest(v, ctx.client, sync, life.fail));
  v.question.addEventListener("keydown", (e) => { if (e.key === "Enter") sendRequest(v, ctx.client, sync, life.fail); });
  v.question.addEventListener("change", sync);
  renderDefinitions(v);
  return life.unmount;
}

// Section 8, "Two phases": prefill and decode timed on this server's own engine (a sibling of the
// serving engine, so visitors are not slowed beyond one step). Left: prefill time against prompt
// length; right: each decode step as the context grows. The reader's own request goes on the same
// axes: the chat's last answer (its `done`, announced through lib/events.js), or
// one sent from this widget (a plain `generate`), with its TTFT, TPOT and end to end. Below:
// the machine's measured memory bandwidth and FLOP/s, and why they bound decode and prefill.

import { el, field, select, setState } from "../lib/dom.js";
import { plot, purge } from "../lib/chart.js";
import { figure, stat } from "../lib/figures.js";
import { listen } from "../lib/events.js";
import { fmtMs, fmtNum, fmtBytes, weightFormat } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { result: null, request: null, run: 0, current: null };
  const cleanups = [];

  // ---- controls ----
  const maxPrompt = select(LENGTHS.map((n) => [n, `${n.toLocaleString("en-US")} tokens`]), opts.max_prompt,
    { "aria-label": "Longest prompt", name: "max_prompt" });
  const decodeTokens = el("input", { type: "number", min: 1, max: 128, step: 1, name: "decode_tokens", "aria-label": "Decode steps" });
  decodeTokens.value = String(opts.decode_tokens);
  const again = el("button", { type: "button", class: "primary", text: "Measure again" });
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const job = jobRunner(root, { client, progress, button: again });
  const machineLine = el("p", { class: "note machine" });
  const threads = stat("Threads", { key: "threads", note: "torch threads used" });

  // ---- figures ----
  const prefillChart = el("div", { class: "chart phases-chart", "aria-label": "Prefill time against prompt length" });
  const decodeChart = el("div", { class: "chart phases-chart", "aria-label": "Decode step time against context length" });
  const prefillRate = stat("Prefill", { key: "prefill_tokens_per_s", note: "prompt tokens per second" });
  const decodeStep = stat("Decode step", { key: "decode_step_ms", note: "median, one token" });
  const prefillNote = el("p", { class: "note" });
  const decodeNote = el("p", { class: "note" });

  const question = el("input", { type: "text", class: "text-input", name: "question", "aria-label": "Your request" });
  question.value = opts.question;
  const send = el("button", { type: "button", text: "Send and time it" });
  const ttft = stat("TTFT", { key: "request_ttft_ms", note: "arrival → first token" });
  const tpot = stat("TPOT", { key: "request_tpot_ms", note: "mean gap after the first" });
  const e2e = stat("End to end", { key: "request_e2e_ms", note: "arrival → last token" });
  const requestNote = el("p", { class: "note", text: "Ask the chat above, or send a question from here: its TTFT and TPOT join both charts." });
  const definitions = el("dl", { class: "phases-defs" });

  const bandwidth = stat("Memory bandwidth", { key: "memory_bandwidth_gb_s", note: "GB/s read, best of 3" });
  const flops = stat("Matmul", { key: "matmul_gflop_s", note: "GFLOP/s float32, best of 3" });
  const floor = stat("Decode floor", { key: "decode_floor_ms", note: "weights ÷ bandwidth" });
  const ceiling = stat("Prefill ceiling", { key: "prefill_ceiling_tokens_per_s", note: "tokens/s: FLOP/s ÷ FLOPs per token" });
  const why = el("div", { class: "phases-why" });

  root.append(
    el("div", { class: "controls" }, [field("longest prompt", maxPrompt), field("decode steps", decodeTokens), again]),
    progress,
    el("div", { class: "phases-machine" }, [threads.node, machineLine]),
    el("div", { class: "phases-grid" }, [
      figure("Prefill: time against prompt length", ["measured"], [prefillChart, el("div", { class: "stats" }, [prefillRate.node]), prefillNote]),
      figure("Decode: each step as the context grows", ["measured"], [decodeChart, el("div", { class: "stats" }, [decodeStep.node]), decodeNote]),
    ]),
    figure("Your own request on the same axes", ["measured"], [
      el("div", { class: "controls" }, [question, send]),
      el("div", { class: "stats" }, [ttft.node, tpot.node, e2e.node]),
      requestNote, definitions,
    ]),
    figure("Why prefill is compute-bound and decode memory-bound", ["measured", "computed"], [
      el("div", { class: "stats" }, [bandwidth.node, flops.node, floor.node, ceiling.node]),
      why,
    ]),
  );

  // ---- drawing ----
  function mine() {
    const r = state.request;
    return r && r.metrics && r.metrics.ttft_ms !== null ? r : null;
  }

  function drawPrefill(r) {
    const req = mine();
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
    return plot(prefillChart, data, {
      height: 240, showlegend: Boolean(req), legend: { orientation: "h", y: 1.15, x: 0, font: { size: 10 } },
      margin: { t: req ? 24 : 8, b: 40, l: 52 },
      xaxis: { type: "log", tickvals: LENGTHS, title: { text: "prompt tokens", font: { size: 10 } } },
      yaxis: { title: { text: "prefill time (ms)", font: { size: 10 } }, rangemode: "tozero" },
    });
  }

  function drawDecode(r) {
    const req = mine();
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
    return plot(decodeChart, data, {
      height: 240, showlegend: true, legend: { orientation: "h", y: 1.15, x: 0, font: { size: 10 } },
      margin: { t: 24, b: 40, l: 52 },
      xaxis: { title: { text: "context (tokens the step attends over)", font: { size: 10 } }, dtick: integerStep(Math.min(x[0], mid ?? x[0]), Math.max(x[x.length - 1], mid ?? 0)) },
      yaxis: { title: { text: "step time (ms)", font: { size: 10 } }, rangemode: "tozero" },
    });
  }

  function describeMachine(r) {
    const m = r.machine;
    threads.set(m.threads, `${m.threads} of ${m.cpu_count}`);
    machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${m.threads} torch threads on ${m.cpu_count} CPU cores, `
      + `torch ${m.torch}, at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}. `
      + "The machine is shared, so the times move from run to run; the shapes do not.";
  }

  function renderWhy(r) {
    bandwidth.set(r.memory_bandwidth_gb_s, fmtNum(r.memory_bandwidth_gb_s, 3));
    flops.set(r.matmul_gflop_s, fmtNum(r.matmul_gflop_s, 3));
    floor.set(r.decode_floor_ms, fmtMs(r.decode_floor_ms));
    ceiling.set(r.prefill_ceiling_tokens_per_s, fmtNum(r.prefill_ceiling_tokens_per_s, 3));
    const p = (text) => el("p", { text });
    why.replaceChildren(
      p(`Every step reads all ${fmtBytes(r.weight_bytes)} of weights (${fmtNum(r.num_params / 1e6, 3)} M parameters, `
        + `${weightFormat(r.weight_format)}). `
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

  function renderDefinitions() {
    const r = state.result, req = mine();
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
    definitions.replaceChildren(...items.flatMap(([t, d]) => [el("dt", { text: t }), el("dd", { text: d })]));
  }

  async function render(r) {
    state.result = r;
    describeMachine(r);
    prefillRate.set(r.prefill_tokens_per_s, fmtNum(r.prefill_tokens_per_s, 3));
    decodeStep.set(r.decode_step_ms, fmtMs(r.decode_step_ms));
    const longest = r.prefill[r.prefill.length - 1];
    prefillNote.textContent = `Each point is one prompt's prefill, run in chunks of ${r.chunk_tokens} tokens (one engine step each) `
      + `and timed as a whole: ${longest.prompt_tokens.toLocaleString("en-US")} tokens took ${fmtMs(longest.ms)} in ${longest.steps.length} step(s). `
      + "Doubling the prompt about doubles the work; the shared machine adds noise to the time.";
    decodeNote.textContent = `${r.decode.length} decode steps after the ${r.max_prompt.toLocaleString("en-US")}-token prompt, one token each. `
      + "Each reads every weight once, whatever the context, so steps stay nearly flat; reading the longer cache adds a little.";
    renderWhy(r);
    renderDefinitions();
    await Promise.all([drawPrefill(r), drawDecode(r)]);
  }

  // ---- asking the server ----
  function syncOptions() {
    ctx.setOptions({ max_prompt: Number(maxPrompt.value), decode_tokens: Number(decodeTokens.value), question: question.value }, OPTIONS);
  }

  function measure() {
    const n = Number(decodeTokens.value);
    if (!Number.isInteger(n) || n < 1 || n > 128) {
      progress.textContent = "Decode steps must be a whole number from 1 to 128.";
      return Promise.resolve();
    }
    syncOptions();
    return job.run({ type: "phases", max_prompt: Number(maxPrompt.value), decode_tokens: n, run: state.run }, {
      running: "Timing the engine…",
      onProgress: (p) => `Timing: ${p.note} (${percent(p)})…`,
      render,
      done: (r) => `Swept ${r.prefill.length} prompt lengths and ${r.decode.length} decode steps.`,
    });
  }

  // A finished request, from this widget's own Send or from the chat (section 1): its `done`.
  function showRequest(msg, source) {
    state.request = msg;
    const m = msg.metrics;
    ttft.set(m.ttft_ms, fmtMs(m.ttft_ms));
    tpot.set(m.tpot_ms, fmtMs(m.tpot_ms));
    e2e.set(m.e2e_ms, fmtMs(m.e2e_ms));
    requestNote.textContent = `${source}: ${msg.prompt_tokens} prompt tokens (with the chat template), ${msg.completion_tokens} generated `
      + "on the serving engine, beside everyone else's requests. The star on each chart is yours.";
    renderDefinitions();
    if (state.result) Promise.all([drawPrefill(state.result), drawDecode(state.result)]).catch((err) => setState(root, "error", err.message));
  }

  function sendRequest() {
    const text = question.value.trim();
    if (!text || state.current) return;
    syncOptions();
    send.disabled = true;
    requestNote.textContent = "Sent; waiting for the answer…";
    for (const s of [ttft, tpot, e2e]) s.set(null);
    state.current = client.request({ type: "generate", messages: [{ role: "user", content: text }], max_tokens: 24, temperature: 0 }, (msg) => {
      if (msg.type === "done") {
        state.current = null;
        send.disabled = false;
        showRequest(msg, "Sent from here");
      } else if (msg.type === "error") {
        state.current = null;
        send.disabled = false;
        requestNote.textContent = `Not answered: ${msg.message}`;
      }
    });
  }

  // The chat widget announces each finished answer on the page (lib/events.js).
  cleanups.push(listen("chat-done", (msg) => showRequest(msg, "Your last chat answer")));

  again.addEventListener("click", () => { state.run += 1; measure(); });
  maxPrompt.addEventListener("change", measure);
  decodeTokens.addEventListener("change", measure);
  send.addEventListener("click", sendRequest);
  question.addEventListener("keydown", (e) => { if (e.key === "Enter") sendRequest(); });
  question.addEventListener("change", syncOptions);

  renderDefinitions();
  cleanups.push(ctx.connected(() => measure()));
  return () => {
    job.stop();
    state.current?.abort();
    cleanups.forEach((fn) => fn());
    purge(prefillChart);
    purge(decodeChart);
    root.replaceChildren();
  };
}

// Section 7, "Prefill once, decode one token at a time": a stepper over the real serving engine.
// The first click runs the prompt through the model (prefill); each later click runs one more
// step with the tokens chosen so far. Each step shows the model's top candidates for the next
// token (probabilities from the real logits at temperature 1), the token the engine's own sampler
// chose, and the KV cache: how many tokens it holds, how many came from the prefix cache and how
// many were computed in this step. Temperature, top-k and top-p reshape the shown distribution at
// once, in the browser, from the candidates' logits; they apply to the engine from the next step.
// A candidate can be taken instead of the sampler's choice: click its bar, or its button below the
// chart (the keyboard's way in).

import { plot, escapeLabel } from "../lib/chart.js";
import { debounce, describeChart, el, field, scrollBox, setDisabled, setState } from "../lib/dom.js";
import { figure, stats, view as viewOf } from "../lib/figures.js";
import { fmtMs, fmtNum, fmtPct, visibleWhitespace, weightFormat } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";
import { mountView, teardown } from "../lib/lifecycle.js";

const KV_CELL_LIMIT = 640;   // longer sequences: the KV strip shows blocks, not token cells

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  prompt: { type: "string", default: "The capital of France is", maxLength: 4000 },
  chat: { type: "bool", default: false },
  temperature: { type: "number", default: 0, min: 0, max: 2 },
  top_k: { type: "int", default: 0, min: 0, max: 1000 },
  top_p: { type: "number", default: 1, min: 0.01, max: 1 },
  seed: { type: "int", default: null, min: 0 },
  top: { type: "int", default: 10, min: 1, max: 20 },
};

// The distribution the sampler would draw from, over the shown candidates only (sorted by
// probability): logits / temperature, keep the top k, keep the smallest set reaching top_p,
// renormalise. Temperature 0 is greedy. The engine does the same over the whole vocabulary.
export function reshape(candidates, temperature, topK, topP) {
  if (temperature < 1e-5) return candidates.map((_, i) => (i === 0 ? 1 : 0));
  const z = candidates.map((c) => c.logit / temperature);
  const peak = Math.max(...z);
  let p = z.map((v, i) => (topK > 0 && i >= topK ? 0 : Math.exp(v - peak)));
  const norm = (xs) => { const s = xs.reduce((a, b) => a + b, 0); return xs.map((x) => x / s); };
  p = norm(p);
  if (topP < 1) {
    let before = 0;
    p = norm(p.map((v, i) => { const drop = i > 0 && before >= topP; before += v; return drop ? 0 : v; }));
  }
  return p;
}

const chipText = (text) => visibleWhitespace(text) || "∅";
const withOutput = (label, output) => { label.append(output); return label; };  // a slider and its value wrap together

const TILES = {  // name: a stat tile [label, figure key, note, badge]
  kv: ["KV cache", "kv_cache_tokens", "tokens with keys and values"], cached: ["From cache", "num_cached_tokens", "prefix cache, this step"],
  computed: ["Computed", "num_computed_tokens", "by the model, this step"], topProb: ["Top prob", "top_prob", "most likely token"],
  chosenProb: ["Chosen prob", "chosen_prob", "of the picked token"], tail: ["Tail", "tail_prob", "beyond the shown tokens"],
  ms: ["Step", "step_ms", "in the engine", "measured"],
};

function build(opts) {
  const input = (attrs, value) => { const node = el("input", attrs); node.value = String(value); return node; };
  const view = {
    promptBox: el("textarea", { class: "text-input", rows: 2, name: "prompt", "aria-label": "Prompt" }),
    chatBox: el("input", { type: "checkbox", name: "chat", "aria-label": "Chat template" }),
    stepButton: el("button", { type: "button", class: "primary gen-step", text: "Prefill" }),
    resetButton: el("button", { type: "button", text: "Reset" }),
    temperature: input({ type: "range", min: "0", max: "2", step: "0.05", name: "temperature", "aria-label": "Temperature" }, opts.temperature),
    tempOut: el("output", { class: "gen-out" }),
    topK: input({ type: "number", min: "0", max: "1000", name: "top_k", "aria-label": "Top-k" }, opts.top_k),
    topP: input({ type: "range", min: "0.05", max: "1", step: "0.05", name: "top_p", "aria-label": "Top-p" }, Math.max(0.05, opts.top_p)),
    topPOut: el("output", { class: "gen-out" }),
    seed: el("input", { type: "number", min: "0", placeholder: "none", name: "seed", "aria-label": "Seed" }),
    top: el("select", { name: "top", "aria-label": "Candidates shown" }, [5, 10, 15, 20].map((n) => el("option", { value: String(n), text: String(n) }))),
    status: el("p", { class: "gen-status", "aria-live": "polite" }),
    tiles: viewOf(TILES),
    phase: el("span", { class: "gen-phase", "data-phase": "" }),
    sequence: scrollBox(el("div", { class: "tokens gen-sequence" }), "Prompt and generated tokens"),
    kvStrip: el("div", { class: "gen-kv" }),
    kvNote: el("p", { class: "note gen-kv-note" }),
    chartNode: el("div", { class: "chart gen-chart" }),
    candidates: el("div", { class: "gen-candidates", role: "group", "aria-label": "Take a candidate instead of the sampler's choice" }),
    chosenLine: el("p", { class: "gen-chosen" }),
    chartNote: el("p", { class: "note gen-chart-note" }),
  };
  const v = view;
  v.promptBox.value = opts.prompt;
  v.chatBox.checked = opts.chat;
  if (opts.seed !== null) v.seed.value = String(opts.seed);
  if (![5, 10, 15, 20].includes(opts.top)) v.top.append(el("option", { value: String(opts.top), text: String(opts.top) }));
  v.top.value = String(opts.top);
  describeChart(v.kvStrip, "KV cache blocks", v.kvNote);
  describeChart(v.chartNode, "Next-token candidates", v.chartNote);
  view.nodes = [
    el("div", { class: "gen-input" }, [
      v.promptBox,
      el("div", { class: "controls" }, [field("chat template", v.chatBox), v.stepButton, v.resetButton, v.phase]),
      el("div", { class: "controls gen-sampling" }, [
        withOutput(field("temperature", v.temperature), v.tempOut),
        field("top-k", v.topK), withOutput(field("top-p", v.topP), v.topPOut),
        field("seed", v.seed), field("show top", v.top),
      ]),
      v.status,
    ]),
    stats(Object.values(v.tiles)),
    el("div", { class: "gen-cols" }, [
      figure("The sequence and its KV cache", ["live"], [v.sequence, v.kvStrip, v.kvNote]),
      figure("Next token", ["live"], [v.chosenLine, v.chartNode, v.candidates, v.chartNote]),
    ]),
  ];
  return view;
}

// The reader's sampling settings, as the engine takes them.
function settings(view) {
  return {
    temperature: Number(view.temperature.value),
    top_k: view.topK.value === "" ? 0 : Math.max(0, Math.floor(Number(view.topK.value))),
    top_p: Number(view.topP.value),
    seed: view.seed.value === "" ? null : Math.floor(Number(view.seed.value)),
    top: Number(view.top.value),
  };
}

function renderSettings(view) {
  const s = settings(view);
  view.tempOut.textContent = s.temperature < 1e-5 ? "0 (greedy)" : s.temperature.toFixed(2);
  view.topPOut.textContent = s.top_p >= 1 ? "1 (off)" : s.top_p.toFixed(2);
}

// The prompt's tokens and the generated ones (the newest marked).
function renderSequence(view, r, tokens, texts) {
  const prompt = r.prompt.map((t) => ({ ...t, kind: "content" }));
  const generated = tokens.map((id, i) => ({ id, text: texts[i], kind: "content" }));
  const n = prompt.length, last = n + generated.length - 1;
  view.sequence.replaceChildren(...tokenChips([...prompt, ...generated], {
    className: (tok, i) => (i < n ? "gen-prompt" : i === last ? "gen-new" : "gen-out-tok"),
    title: (tok, i) => (i < n ? `prompt #${i} · id ${tok.id}` : `generated #${i - n} · id ${tok.id}${i === last ? " · just chosen: its keys and values are computed at the next step" : ""}`),
  }));
  view.sequence.scrollTop = view.sequence.scrollHeight;
}

// The KV cache as blocks of token cells: from the prefix cache, computed now, or pending.
function renderKv(view, r) {
  const bs = r.block_size, kv = r.kv_cache_tokens, cached = r.num_cached_tokens;
  const total = kv + 1;  // the chosen token waits for the next step
  const blocks = [];
  for (let b = 0; b * bs < total; b += 1) {
    const end = Math.min(total, (b + 1) * bs);
    const cells = [];
    for (let i = b * bs; i < end && total <= KV_CELL_LIMIT; i += 1) {
      cells.push(el("span", { class: `kv-cell kv-${i < cached ? "cached" : i < kv ? "computed" : "pending"}` }));
    }
    const blockKind = (b + 1) * bs <= cached ? "cached" : end - b * bs === bs ? "computed" : "partial";
    blocks.push(el("span", { class: `kv-block kv-block-${blockKind}`, title: `block ${b}: tokens ${b * bs}–${end - 1}` }, cells));
  }
  view.kvStrip.replaceChildren(...blocks);
  const computed = r.num_computed_tokens;
  const why = r.phase === "prefill"
    ? `Prefill: all ${kv} prompt tokens went through the model in ${r.engine_steps} engine step${r.engine_steps === 1 ? "" : "s"}${cached ? `, except ${cached} whose keys and values were already in the prefix cache` : ""}.`
    : `Decode step ${r.step}: the engine received all ${kv} tokens again as one request; its prefix cache served ${cached} (the full blocks of ${bs} kept from the last step) and the model computed the other ${computed}: the newest token${computed > 1 ? ` and the ${computed - 1} before it in the unfinished last block (only whole blocks are cached)` : ""}. A request that stays in the engine, like a chat, computes exactly 1 token per decode step.`;
  view.kvNote.textContent = `${why} Green: from the prefix cache; blue: computed this step; dashed: the chosen token, whose keys and values the next step computes.`;
}

// The candidates' bars (the model's and the reader's settings) and their note; onPick(i) takes one.
export function renderChart(view, r, hello) {
  const s = settings(view);
  const shaped = reshape(r.candidates, s.temperature, s.top_k, s.top_p);
  const labels = r.candidates.map((c, i) => `${i + 1}. ${escapeLabel(chipText(c.text))}${c.id === r.chosen.id ? " ◀" : ""}`);
  const hover = r.candidates.map((c) => `id ${c.id} · logit ${c.logit.toFixed(3)}`);
  view.tiles.topProb.set(r.candidates[0].prob, fmtPct(r.candidates[0].prob));
  const lost = shaped.filter((p) => p === 0).length;
  view.chartNote.textContent = `Blue: the serving engine's probabilities at temperature 1 over all ${hello.vocab_size.toLocaleString()} tokens (${weightFormat(hello.weight_format, hello.activation_rounding, hello.attention_operands)}). Orange: your temperature ${s.temperature < 1e-5 ? "0 (greedy: all on the top token)" : s.temperature.toFixed(2)}, top-k ${s.top_k || "off"} and top-p ${s.top_p >= 1 ? "off" : s.top_p.toFixed(2)} applied to these ${r.candidates.length} logits and renormalised over them${lost ? ` (${lost} cut)` : ""}; the tail of ${fmtPct(r.tail_prob, 2)} beyond them is left out. New settings reshape the bars at once and reach the engine at the next step. Click a bar, or a candidate's button, to take that token instead.`;
  return plot(view.chartNode, [
    { type: "bar", orientation: "h", name: "model, T = 1", y: labels, x: r.candidates.map((c) => c.prob), text: hover,
      marker: { color: "#3c67cc" }, textposition: "none", hovertemplate: "%{y}<br>%{text}<br>p = %{x:.4f}<extra>model</extra>" },
    { type: "bar", orientation: "h", name: "your settings", y: labels, x: shaped,
      marker: { color: "#e09a2c" }, hovertemplate: "%{y}<br>p = %{x:.4f}<extra>your settings</extra>" },
  ], {
    barmode: "group", height: 60 + 34 * r.candidates.length, bargap: 0.25, bargroupgap: 0.05, showlegend: true,
    legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", font: { size: 11 } },
    margin: { l: 120, r: 10, t: 28, b: 34 },
    xaxis: { range: [0, 1], title: { text: "probability", font: { size: 11 } }, fixedrange: true },
    yaxis: { autorange: "reversed", fixedrange: true, tickfont: { family: "ui-monospace, DejaVu Sans Mono, monospace", size: 11 } },
  });
}

// One button per candidate: the keyboard's way to take a token instead of the sampler's choice.
function renderCandidates(view, r, onPick) {
  view.candidates.replaceChildren(el("span", { class: "muted", text: "Take instead: " }), ...tokenChips(r.candidates, {
    className: (c) => (c.id === r.chosen.id ? "gen-new" : ""),
    title: (c, i) => `candidate ${i + 1} · id ${c.id} · p = ${fmtNum(c.prob, 3)}`,
    onClick: (c, i) => onPick(i),
    breakLines: false,
  }));
}

function renderChoice(view, r) {
  const c = r.chosen;
  const how = r.temperature === 0 ? "greedy: the most likely token"
    : `a draw at temperature ${r.temperature}${r.top_k ? `, top-k ${r.top_k}` : ""}${r.top_p < 1 ? `, top-p ${r.top_p}` : ""}${r.seed !== null ? ` with seed ${r.seed}` : ""}`;
  const rank = c.rank === null ? "outside the shown candidates" : `rank ${c.rank + 1}`;
  view.chosenLine.replaceChildren(
    `${r.phase === "prefill" ? "Prefill" : `Decode step ${r.step}`}: the engine's sampler chose `,
    el("span", { class: "tok gen-new", text: chipText(c.text) }),
    ` (${rank}, p = ${fmtNum(c.prob, 3)}; ${how}).`,
  );
  if (r.ends_turn) view.chosenLine.append(" That token ends the text: the model has finished.");
}

// A next_token reply: the phase, the tiles, the sequence, the KV strip, the choice and the chart.
export function renderStep(view, r, st, onPick) {
  view.phase.textContent = r.phase;
  view.phase.dataset.phase = r.phase;
  const t = view.tiles;
  t.kv.set(r.kv_cache_tokens);
  t.cached.set(r.num_cached_tokens);
  t.computed.set(r.num_computed_tokens);
  t.chosenProb.set(r.chosen.prob, fmtPct(r.chosen.prob));
  t.tail.set(r.tail_prob, fmtPct(r.tail_prob, 2));
  t.ms.set(r.step_ms, fmtMs(r.step_ms));
  renderSequence(view, r, st.tokens, st.texts);
  renderKv(view, r);
  renderChoice(view, r);
  renderCandidates(view, r, onPick);
  return renderChart(view, r, st.hello);
}

// ---- the widget's behaviour, on w = { root, ctx, view, state, job } ----
function syncOptions(w) {
  w.ctx.setOptions({ prompt: w.view.promptBox.value, chat: w.view.chatBox.checked, ...settings(w.view) }, OPTIONS);
}

function updateButtons(w) {
  const { state, view } = w;
  const limit = state.hello ? state.hello.limits.max_tokens_limit : Infinity;
  view.stepButton.textContent = state.tokens.length ? "Decode next token" : "Prefill";
  setDisabled(view.resetButton, state.busy);
  // a step that ends the text leaves the focus on Reset, the one way on
  setDisabled(view.stepButton, state.busy || state.ended || state.tokens.length >= limit, state.busy ? null : view.resetButton);
}

// Take candidate i instead of the token the sampler chose (the next step continues from it).
function override(w, i) {
  const { state, view } = w;
  const r = state.last;
  if (!r || state.busy) return;
  const c = r.candidates[i];
  state.tokens[state.tokens.length - 1] = c.id;
  state.texts[state.texts.length - 1] = c.text;
  state.ended = false;
  renderSequence(view, r, state.tokens, state.texts);
  view.status.textContent = `You took "${chipText(c.text)}" (rank ${i + 1}) instead of the sampler's choice; the next step continues from it.`;
  updateButtons(w);
}

function bindClick(w) {
  if (w.state.clickBound || !w.view.chartNode.on) return;   // plotly's emitter exists once there is a plot
  w.view.chartNode.on("plotly_click", (event) => {
    const i = event.points?.[0]?.pointIndex;
    if (i !== undefined) override(w, i);
  });
  w.state.clickBound = true;
}

const drawChart = (w) => (w.state.last ? renderChart(w.view, w.state.last, w.state.hello).then(() => bindClick(w)) : Promise.resolve());

// One step on the engine: prefill first, then one decode step per call.
function step(w) {
  const { state, view } = w;
  if (state.busy) return Promise.resolve();
  const s = settings(view);
  const body = { type: "next_token", tokens: state.tokens.slice(), top: s.top, temperature: s.temperature, top_k: s.top_k, top_p: s.top_p };
  if (s.seed !== null) body.seed = s.seed;
  if (view.chatBox.checked) body.messages = [{ role: "user", content: view.promptBox.value }];
  else body.prompt = view.promptBox.value;
  state.busy = true;
  updateButtons(w);
  const seq = ++state.seq;   // a reset meanwhile starts a newer step: this one's end is then not the widget's
  return w.job.run(body, {
    running: state.tokens.length ? "Decoding one token…" : "Prefilling the prompt…",
    render: (reply) => {
      state.last = reply;
      state.tokens.push(reply.chosen.id);
      state.texts.push(reply.chosen.text);
      state.ended = reply.ends_turn;
      return renderStep(view, reply, state, (i) => override(w, i)).then(() => bindClick(w));
    },
  }).finally(() => {
    if (seq !== state.seq) return;
    state.busy = false;
    updateButtons(w);
  });
}

function reset(w) {
  const { state } = w;
  w.job.cancel();
  state.seq += 1;
  state.busy = false;
  state.tokens = [];
  state.texts = [];
  state.ended = false;
  updateButtons(w);
  return step(w);
}

// The controls' events; returns the function that cancels what is pending.
function listen(w) {
  const { view, root } = w;
  const failed = (err) => setState(root, "error", `Drawing failed: ${err.message}`);
  view.stepButton.addEventListener("click", () => step(w));
  view.resetButton.addEventListener("click", () => reset(w));
  const onPrompt = debounce(() => { syncOptions(w); reset(w); }, 600);
  view.promptBox.addEventListener("input", onPrompt);
  view.chatBox.addEventListener("change", () => { syncOptions(w); reset(w); });
  const live = () => { renderSettings(view); syncOptions(w); drawChart(w).catch(failed); };
  for (const node of [view.temperature, view.topP, view.topK, view.seed]) node.addEventListener("input", live);
  view.top.addEventListener("change", () => syncOptions(w));
  let lastWidth = 0;
  const observer = new ResizeObserver(debounce(() => {
    if (!w.state.last || root.clientWidth === lastWidth) return;
    lastWidth = root.clientWidth;
    drawChart(w).catch(failed);
  }, 200));
  observer.observe(root);
  return () => { onPrompt.cancel(); observer.disconnect(); };
}

export function mount(root, ctx) {
  const { opts, view } = mountView(root, ctx, OPTIONS, build);
  const w = {
    root, ctx, view,
    state: { hello: null, tokens: [], texts: [], last: null, busy: false, ended: false, clickBound: false, seq: 0 },
    job: jobRunner(root, { client: ctx.client, progress: view.status }),
  };
  const unlisten = listen(w);
  renderSettings(view);
  const offStatus = ctx.connected((hello) => {
    w.state.hello = hello;
    return reset(w);
  });
  return teardown(root, [unlisten, w.job.stop, offStatus], [view.chartNode]);
}

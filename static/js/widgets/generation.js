// Section 7, "Prefill once, decode one token at a time": a stepper over the real serving engine.
// The first click runs the prompt through the model (prefill); each later click runs one more
// step with the tokens chosen so far. Each step shows the model's top candidates for the next
// token (probabilities from the real logits at temperature 1), the token the engine's own sampler
// chose, and the KV cache: how many tokens it holds, how many came from the prefix cache and how
// many were computed in this step. Temperature, top-k and top-p reshape the shown distribution at
// once, in the browser, from the candidates' logits; they apply to the engine from the next step.

import { plot, purge, escapeLabel } from "../lib/chart.js";
import { el, field, setState, debounce } from "../lib/dom.js";
import { figure, stat, stats } from "../lib/figures.js";
import { fmtMs, fmtNum, fmtPct, visibleWhitespace, weightFormat } from "../lib/format.js";
import { tokenChips } from "../lib/tokens.js";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const { values: opts } = ctx.readOptions(OPTIONS);
  const state = { hello: null, tokens: [], texts: [], last: null, busy: false, ended: false, load: null };
  const cleanups = [];
  const failed = (err) => setState(root, "error", `Drawing failed: ${err.message}`);

  // ---- controls ----
  const promptBox = el("textarea", { class: "text-input", rows: 2, name: "prompt", "aria-label": "Prompt" });
  promptBox.value = opts.prompt;
  const chatBox = el("input", { type: "checkbox", name: "chat", "aria-label": "Chat template" });
  chatBox.checked = opts.chat;
  const stepButton = el("button", { type: "button", class: "primary gen-step", text: "Prefill" });
  const resetButton = el("button", { type: "button", text: "Reset" });
  const temperature = el("input", { type: "range", min: "0", max: "2", step: "0.05", name: "temperature", "aria-label": "Temperature" });
  temperature.value = String(opts.temperature);
  const tempOut = el("output", { class: "gen-out" });
  const topK = el("input", { type: "number", min: "0", max: "1000", name: "top_k", "aria-label": "Top-k" });
  topK.value = String(opts.top_k);
  const topP = el("input", { type: "range", min: "0.05", max: "1", step: "0.05", name: "top_p", "aria-label": "Top-p" });
  topP.value = String(Math.max(0.05, opts.top_p));
  const topPOut = el("output", { class: "gen-out" });
  const seed = el("input", { type: "number", min: "0", placeholder: "none", name: "seed", "aria-label": "Seed" });
  if (opts.seed !== null) seed.value = String(opts.seed);
  const top = el("select", { name: "top", "aria-label": "Candidates shown" },
    [5, 10, 15, 20].map((n) => el("option", { value: String(n), text: String(n) })));
  if (![5, 10, 15, 20].includes(opts.top)) top.append(el("option", { value: String(opts.top), text: String(opts.top) }));
  top.value = String(opts.top);
  const status = el("p", { class: "gen-status", "aria-live": "polite" });

  // ---- figures ----
  const tiles = {
    kv: stat("KV cache", { key: "kv_cache_tokens", note: "tokens with keys and values" }),
    cached: stat("From cache", { key: "num_cached_tokens", note: "prefix cache, this step" }),
    computed: stat("Computed", { key: "num_computed_tokens", note: "by the model, this step" }),
    topProb: stat("Top prob", { key: "top_prob", note: "most likely token" }),
    chosenProb: stat("Chosen prob", { key: "chosen_prob", note: "of the picked token" }),
    tail: stat("Tail", { key: "tail_prob", note: "beyond the shown tokens" }),
    ms: stat("Step", { key: "step_ms", note: "in the engine", badge: "measured" }),
  };
  const phase = el("span", { class: "gen-phase", "data-phase": "" });
  const sequence = el("div", { class: "tokens gen-sequence", "aria-label": "Prompt and generated tokens" });
  const kvStrip = el("div", { class: "gen-kv", role: "img", "aria-label": "KV cache blocks" });
  const kvNote = el("p", { class: "note gen-kv-note" });
  const chartNode = el("div", { class: "chart gen-chart", role: "img", "aria-label": "Next-token candidates" });
  const chosenLine = el("p", { class: "gen-chosen" });
  const chartNote = el("p", { class: "note gen-chart-note" });

  root.append(
    el("div", { class: "gen-input" }, [
      promptBox,
      el("div", { class: "controls" }, [
        field("chat template", chatBox), stepButton, resetButton, phase,
      ]),
      el("div", { class: "controls gen-sampling" }, [
        withOutput(field("temperature", temperature), tempOut),
        field("top-k", topK), withOutput(field("top-p", topP), topPOut),
        field("seed", seed), field("show top", top),
      ]),
      status,
    ]),
    stats(Object.values(tiles)),
    el("div", { class: "gen-cols" }, [
      figure("The sequence and its KV cache", ["live"], [sequence, kvStrip, kvNote]),
      figure("Next token", ["live"], [chosenLine, chartNode, chartNote]),
    ]),
  );

  // ---- settings ----
  const settings = () => ({
    temperature: Number(temperature.value),
    top_k: topK.value === "" ? 0 : Math.max(0, Math.floor(Number(topK.value))),
    top_p: Number(topP.value),
    seed: seed.value === "" ? null : Math.floor(Number(seed.value)),
    top: Number(top.value),
  });
  const syncOptions = () => ctx.setOptions({ prompt: promptBox.value, chat: chatBox.checked, ...settings() }, OPTIONS);
  function showSettings() {
    const s = settings();
    tempOut.textContent = s.temperature < 1e-5 ? "0 (greedy)" : s.temperature.toFixed(2);
    topPOut.textContent = s.top_p >= 1 ? "1 (off)" : s.top_p.toFixed(2);
  }

  // ---- drawing ----
  function drawSequence() {
    const r = state.last;
    const prompt = r.prompt.map((t) => ({ ...t, kind: "content" }));
    const generated = state.tokens.map((id, i) => ({ id, text: state.texts[i], kind: "content" }));
    const n = prompt.length;
    sequence.replaceChildren(...tokenChips([...prompt, ...generated], {
      className: (tok, i) => (i < n ? "gen-prompt" : i === n + generated.length - 1 ? "gen-new" : "gen-out-tok"),
      title: (tok, i) => (i < n ? `prompt #${i} · id ${tok.id}` : `generated #${i - n} · id ${tok.id}${i === n + generated.length - 1 ? " · just chosen: its keys and values are computed at the next step" : ""}`),
    }));
    sequence.scrollTop = sequence.scrollHeight;
  }

  function drawKv() {
    const r = state.last;
    const bs = r.block_size, kv = r.kv_cache_tokens, cached = r.num_cached_tokens;
    const total = kv + 1;  // the chosen token waits for the next step
    const blocks = [];
    for (let b = 0; b * bs < total; b += 1) {
      const cells = [];
      for (let i = b * bs; i < Math.min(total, (b + 1) * bs); i += 1) {
        const kind = i < cached ? "cached" : i < kv ? "computed" : "pending";
        cells.push(total <= KV_CELL_LIMIT ? el("span", { class: `kv-cell kv-${kind}` }) : null);
      }
      const full = Math.min(total, (b + 1) * bs) - b * bs === bs;
      const blockKind = (b + 1) * bs <= cached ? "cached" : full ? "computed" : "partial";
      blocks.push(el("span", { class: `kv-block kv-block-${blockKind}`, title: `block ${b}: tokens ${b * bs}–${Math.min(total, (b + 1) * bs) - 1}` }, cells));
    }
    kvStrip.replaceChildren(...blocks);
    const computed = r.num_computed_tokens;
    const why = r.phase === "prefill"
      ? `Prefill: all ${kv} prompt tokens went through the model in ${r.engine_steps} engine step${r.engine_steps === 1 ? "" : "s"}${cached ? `, except ${cached} whose keys and values were already in the prefix cache` : ""}.`
      : `Decode step ${r.step}: the engine received all ${kv} tokens again as one request; its prefix cache served ${cached} (the full blocks of ${bs} kept from the last step) and the model computed the other ${computed}: the newest token${computed > 1 ? ` and the ${computed - 1} before it in the unfinished last block (only whole blocks are cached)` : ""}. A request that stays in the engine, like a chat, computes exactly 1 token per decode step.`;
    kvNote.textContent = `${why} Green: from the prefix cache; blue: computed this step; dashed: the chosen token, whose keys and values the next step computes.`;
  }

  function drawChart() {
    const r = state.last;
    if (!r) return Promise.resolve();
    const s = settings();
    const shaped = reshape(r.candidates, s.temperature, s.top_k, s.top_p);
    const labels = r.candidates.map((c, i) => `${i + 1}. ${escapeLabel(chipText(c.text))}${c.id === r.chosen.id ? " ◀" : ""}`);
    const hover = r.candidates.map((c) => `id ${c.id} · logit ${c.logit.toFixed(3)}`);
    const height = 60 + 34 * r.candidates.length;
    const top1 = r.candidates[0];
    tiles.topProb.set(top1.prob, fmtPct(top1.prob));
    const lost = shaped.filter((p) => p === 0).length;
    chartNote.textContent = `Blue: the serving engine's probabilities at temperature 1 over all ${state.hello.vocab_size.toLocaleString()} tokens (${weightFormat(state.hello.weight_format)}). Orange: your temperature ${s.temperature < 1e-5 ? "0 (greedy: all on the top token)" : s.temperature.toFixed(2)}, top-k ${s.top_k || "off"} and top-p ${s.top_p >= 1 ? "off" : s.top_p.toFixed(2)} applied to these ${r.candidates.length} logits and renormalised over them${lost ? ` (${lost} cut)` : ""}; the tail of ${fmtPct(r.tail_prob, 2)} beyond them is left out. New settings reshape the bars at once and reach the engine at the next step. Click a bar to take that token instead.`;
    return plot(chartNode, [
      { type: "bar", orientation: "h", name: "model, T = 1", y: labels, x: r.candidates.map((c) => c.prob), text: hover,
        marker: { color: "#3c67cc" }, textposition: "none", hovertemplate: "%{y}<br>%{text}<br>p = %{x:.4f}<extra>model</extra>" },
      { type: "bar", orientation: "h", name: "your settings", y: labels, x: shaped,
        marker: { color: "#e09a2c" }, hovertemplate: "%{y}<br>p = %{x:.4f}<extra>your settings</extra>" },
    ], {
      barmode: "group", height, bargap: 0.25, bargroupgap: 0.05, showlegend: true,
      legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom", font: { size: 11 } },
      margin: { l: 120, r: 10, t: 28, b: 34 },
      xaxis: { range: [0, 1], title: { text: "probability", font: { size: 11 } }, fixedrange: true },
      yaxis: { autorange: "reversed", fixedrange: true, tickfont: { family: "ui-monospace, DejaVu Sans Mono, monospace", size: 11 } },
    }).then(() => {
      if (!state.clickBound && chartNode.on) {
        chartNode.on("plotly_click", (event) => {
          const i = event.points?.[0]?.pointIndex;
          if (i !== undefined) override(i);
        });
        state.clickBound = true;
      }
    });
  }

  function describeChoice() {
    const r = state.last;
    const c = r.chosen;
    const how = r.temperature === 0 ? "greedy: the most likely token"
      : `a draw at temperature ${r.temperature}${r.top_k ? `, top-k ${r.top_k}` : ""}${r.top_p < 1 ? `, top-p ${r.top_p}` : ""}${r.seed !== null ? ` with seed ${r.seed}` : ""}`;
    const rank = c.rank === null ? "outside the shown candidates" : `rank ${c.rank + 1}`;
    chosenLine.replaceChildren(
      `${r.phase === "prefill" ? "Prefill" : `Decode step ${r.step}`}: the engine's sampler chose `,
      el("span", { class: "tok gen-new", text: chipText(c.text) }),
      ` (${rank}, p = ${fmtNum(c.prob, 3)}; ${how}).`,
    );
    if (r.ends_turn) chosenLine.append(" That token ends the text: the model has finished.");
  }

  function render() {
    const r = state.last;
    phase.textContent = r.phase;
    phase.dataset.phase = r.phase;
    tiles.kv.set(r.kv_cache_tokens);
    tiles.cached.set(r.num_cached_tokens);
    tiles.computed.set(r.num_computed_tokens);
    tiles.chosenProb.set(r.chosen.prob, fmtPct(r.chosen.prob));
    tiles.tail.set(r.tail_prob, fmtPct(r.tail_prob, 2));
    tiles.ms.set(r.step_ms, fmtMs(r.step_ms));
    drawSequence();
    drawKv();
    describeChoice();
    return drawChart();
  }

  function updateButtons() {
    const limit = state.hello ? state.hello.limits.max_tokens_limit : Infinity;
    stepButton.textContent = state.tokens.length ? "Decode next token" : "Prefill";
    stepButton.disabled = state.busy || state.ended || state.tokens.length >= limit;
    resetButton.disabled = state.busy;
  }

  // Take candidate i instead of the token the sampler chose (the next step continues from it).
  function override(i) {
    const r = state.last;
    if (!r || state.busy) return;
    const c = r.candidates[i];
    state.tokens[state.tokens.length - 1] = c.id;
    state.texts[state.texts.length - 1] = c.text;
    state.ended = false;
    drawSequence();
    status.textContent = `You took "${chipText(c.text)}" (rank ${i + 1}) instead of the sampler's choice; the next step continues from it.`;
    updateButtons();
  }

  // ---- one step on the engine ----
  function step() {
    if (state.busy) return Promise.resolve();
    const s = settings();
    const body = { type: "next_token", tokens: state.tokens.slice(), top: s.top, temperature: s.temperature,
      top_k: s.top_k, top_p: s.top_p };
    if (s.seed !== null) body.seed = s.seed;
    if (chatBox.checked) body.messages = [{ role: "user", content: promptBox.value }];
    else body.prompt = promptBox.value;
    state.busy = true;
    updateButtons();
    status.textContent = state.tokens.length ? "Decoding one token…" : "Prefilling the prompt…";
    const load = new AbortController();
    state.load = load;
    return client.call(body, { signal: load.signal }).then((reply) => {
      if (load.signal.aborted) return null;
      state.last = reply;
      state.tokens.push(reply.chosen.id);
      state.texts.push(reply.chosen.text);
      state.ended = reply.ends_turn;
      status.textContent = "";
      return render().then(() => setState(root, "ready"));
    }).catch((err) => {
      if (err.code === "aborted" || load.signal.aborted) return;
      status.textContent = "";
      setState(root, "error", err.message);
    }).finally(() => {
      if (state.load === load) { state.busy = false; state.load = null; }
      updateButtons();
    });
  }

  function reset() {
    state.load?.abort();
    state.busy = false;
    state.tokens = [];
    state.texts = [];
    state.ended = false;
    updateButtons();
    return step();
  }

  // ---- events ----
  stepButton.addEventListener("click", step);
  resetButton.addEventListener("click", reset);
  const onPrompt = debounce(() => { syncOptions(); reset(); }, 600);
  promptBox.addEventListener("input", onPrompt);
  chatBox.addEventListener("change", () => { syncOptions(); reset(); });
  const live = () => { showSettings(); syncOptions(); drawChart().catch(failed); };
  for (const node of [temperature, topP]) node.addEventListener("input", live);
  for (const node of [topK, seed]) node.addEventListener("input", live);
  top.addEventListener("change", () => { syncOptions(); });

  let lastWidth = 0;
  const observer = new ResizeObserver(debounce(() => {
    if (!state.last || root.clientWidth === lastWidth) return;
    lastWidth = root.clientWidth;
    drawChart().catch(failed);
  }, 200));
  observer.observe(root);

  // ---- start ----
  showSettings();
  client.ready().then((hello) => {
    state.hello = hello;
    updateButtons();
    return step();
  });
  cleanups.push(client.onStatus((status_) => {
    if (status_ === "closed") setState(root, "error", "The connection to the server was lost; reconnecting…");
  }));
  return () => {
    onPrompt.cancel();
    observer.disconnect();
    state.load?.abort();
    cleanups.forEach((fn) => fn());
    purge(chartNode);
    root.replaceChildren();
  };
}

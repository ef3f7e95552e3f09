// Section 10, "KV memory": a calculator of the KV cache's size, computed here in the browser from
// a model's shape, with presets from the models' public configs, a comparison of full attention,
// grouped-query, multi-query and latent attention at the same context, and one line checked
// against the live engine: the bytes its KV tensors hold per token slot.

import { el, field, select, setState } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtBytes, fmtNum } from "../lib/format.js";
import MODELS from "../../data/models.json" with { type: "json" };

// The presets, from each model's public config.json (static/data/models.json, with each source):
// one file that this calculator, the economics widget and its server side (app/widgets/kv_memory.py)
// all read. MLA (DeepSeek-V2/V3) caches kv_lora_rank + qk_rope_head_dim values per layer and token
// instead of K and V per head.
export const PRESETS = MODELS.presets;

export const DTYPES = MODELS.dtypes;

const OPTIONS = {
  preset: { type: "string", default: "smollm2-135m", choices: Object.keys(PRESETS) },
  dtype: { type: "string", default: "bf16", choices: Object.keys(DTYPES) },
  context: { type: "int", default: 8192, min: 1, max: 1048576 },
  batch: { type: "int", default: 1, min: 1, max: 4096 },
};

// Values the cache holds per token: K and V for every layer and KV head, or MLA's latent + RoPE key.
export function valuesPerToken(shape) {
  if (shape.mla) return shape.layers * (shape.mla.latent + shape.mla.rope);
  return 2 * shape.layers * shape.kvHeads * shape.head;
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { shape: { ...PRESETS[opts.preset] }, preset: opts.preset, pool: null, alive: true };

  // ---- controls ----
  const presetSel = select([...Object.entries(PRESETS).map(([k, p]) => [k, p.label]), ["custom", "custom"]], opts.preset, { name: "preset", "aria-label": "Model" });
  const num = (name, value, min, max) => el("input", { type: "number", name, value, min, max, step: 1, "aria-label": name });
  const layers = num("layers", state.shape.layers, 1, 1000);
  const kvHeads = num("kv_heads", state.shape.kvHeads, 1, 1024);
  const head = num("head_dim", state.shape.head, 1, 4096);
  const dtypeSel = select(Object.keys(DTYPES).map((k) => [k, `${k} (${DTYPES[k]} B)`]), opts.dtype, { name: "dtype", "aria-label": "Number format" });
  const context = num("context", opts.context, 1, 1048576);
  const batch = num("batch", opts.batch, 1, 4096);

  // ---- figures ----
  const perToken = stat("Per token", { key: "kv_bytes_per_token", note: "bytes in the cache" });
  const total = stat("Whole batch", { key: "kv_bytes_total", note: "context × batch" });
  const perSeq = stat("One sequence", { note: "at this context" });
  const formula = el("p", { class: "kvm-formula", "aria-live": "polite" });
  const compare = el("div", { class: "kvm-compare", role: "table", "aria-label": "Attention variants at the same context" });
  const compareNote = el("p", { class: "note" });
  const livePool = stat("Live pool", { key: "live_pool_bytes_per_token", note: "bytes per token slot" });
  const calcLive = stat("Calculator", { note: "the served model, its dtype" });
  const liveNote = el("p", { class: "note" });
  const liveCheck = el("p", { class: "kvm-check" });

  root.append(
    el("div", { class: "controls" }, [field("model", presetSel), field("layers", layers), field("KV heads", kvHeads), field("head size", head)]),
    el("div", { class: "controls" }, [field("number format", dtypeSel), field("context", context, "tokens"), field("batch", batch, "sequences")]),
    el("div", { class: "kvm-grid" }, [
      figure("KV cache size", ["computed"], [el("div", { class: "stats" }, [perToken.node, perSeq.node, total.node]), formula]),
      figure("Checked against this server's pool", ["live", "computed"], [el("div", { class: "stats" }, [livePool.node, calcLive.node]), liveCheck, liveNote]),
    ]),
    figure("Full attention, GQA, MQA and MLA at the same context", ["computed"], [compare, compareNote]),
  );

  function readShape() {
    const s = state.shape;
    s.layers = clampInt(layers.value, 1, 1000, s.layers);
    s.kvHeads = clampInt(kvHeads.value, 1, 1024, s.kvHeads);
    s.head = clampInt(head.value, 1, 4096, s.head);
  }

  function render() {
    const s = state.shape, bytes = DTYPES[dtypeSel.value];
    const ctxLen = clampInt(context.value, 1, 1048576, opts.context), n = clampInt(batch.value, 1, 4096, opts.batch);
    const values = valuesPerToken(s), per = values * bytes;
    perToken.set(per, `${fmtNum(per)} B`);
    perSeq.set(per * ctxLen, fmtBytes(per * ctxLen));
    total.set(per * ctxLen * n, fmtBytes(per * ctxLen * n));
    formula.textContent = s.mla
      ? `MLA: ${s.layers} layers × (${s.mla.latent} latent + ${s.mla.rope} RoPE key) = ${fmtNum(values)} values × ${bytes} B = ${fmtNum(per)} B per token; `
        + `× ${fmtNum(ctxLen)} tokens × ${n} = ${fmtBytes(per * ctxLen * n)}`
      : `2 (K and V) × ${s.layers} layers × ${s.kvHeads} KV heads × ${s.head} = ${fmtNum(values)} values × ${bytes} B = ${fmtNum(per)} B per token; `
        + `× ${fmtNum(ctxLen)} tokens × ${n} = ${fmtBytes(per * ctxLen * n)}`;
    kvHeads.disabled = Boolean(s.mla);
    head.disabled = Boolean(s.mla);
    drawCompare(s, bytes, ctxLen, n);
    drawLive();
    ctx.setOptions({ preset: state.preset === "custom" ? OPTIONS.preset.default : state.preset, dtype: dtypeSel.value, context: ctxLen, batch: n }, OPTIONS);
  }

  // The same layers, query heads and head size with four ways of keeping keys and values.
  function drawCompare(s, bytes, ctxLen, n) {
    const heads = s.heads ?? s.kvHeads;
    const gqaHeads = s.mla ? Math.max(1, heads / 16) : s.kvHeads;
    const rows = [
      ["Full attention (MHA)", `${heads} KV heads, one per query head`, 2 * s.layers * heads * s.head],
      ["Grouped-query (GQA)", `${gqaHeads} KV heads${s.mla ? " (an example: 1 per 16 query heads)" : ", this model's"}`, 2 * s.layers * gqaHeads * s.head],
      ["Multi-query (MQA)", "1 KV head for all", 2 * s.layers * 1 * s.head],
      ["Latent (MLA)", "512 latent + 64 RoPE key per layer, DeepSeek-V3's sizes", s.layers * (512 + 64)],
    ];
    const max = Math.max(...rows.map((r) => r[2]));
    compare.replaceChildren(...rows.map(([name, how, values]) => {
      const b = values * bytes * ctxLen * n;
      return el("div", { class: "kvm-row", role: "row" }, [
        el("span", { class: "kvm-name", role: "cell" }, [el("strong", { text: name }), el("span", { class: "kvm-how", text: how })]),
        el("span", { class: "kvm-bar", role: "cell" }, [el("span", { class: "kvm-fill", style: { width: `${(100 * values) / max}%` } })]),
        el("span", { class: "kvm-val", role: "cell", text: `${fmtNum(values * bytes)} B/token · ${fmtBytes(b)}` }),
      ]);
    }));
    compareNote.textContent = `${s.layers} layers, ${heads} query heads of size ${s.head}, ${dtypeSel.value}, ${fmtNum(ctxLen)} tokens × ${n}. `
      + "Every variant keeps the same query heads; they differ in how many keys and values each token leaves behind. "
      + "MLA stores one compressed latent per layer and rebuilds every head's keys and values from it.";
  }

  function drawLive() {
    const p = state.pool;
    if (!p) return;
    const mine = valuesPerToken({ layers: p.num_layers, kvHeads: p.num_kv_heads, head: p.head_dim }) * p.bytes_per_value;
    livePool.set(p.live_pool_bytes_per_token, `${fmtNum(p.live_pool_bytes_per_token)} B`);
    calcLive.set(mine, `${fmtNum(mine)} B`);
    const shape = (t) => `[${t.shape.join(", ")}] (${t.dims.join(", ")})`;
    const names = Object.entries(p.tensors).map(([k, t]) => `${k.toUpperCase()} ${shape(t)} ${t.dtype}`).join(" and ");
    liveCheck.textContent = mine === p.live_pool_bytes_per_token
      ? `✓ The calculator at ${p.dtype} (${p.num_layers} layers × ${p.num_kv_heads} KV heads × ${p.head_dim}) gives what the pool holds.`
      : `✗ The calculator gives ${fmtNum(mine)} B, the pool ${fmtNum(p.live_pool_bytes_per_token)} B per token.`;
    liveCheck.classList.toggle("is-ok", mine === p.live_pool_bytes_per_token);
    liveNote.textContent = `This server's engine keeps ${names}: `
      + `${fmtNum(p.kv_bytes)} bytes for ${fmtNum(p.total_blocks)} blocks × ${p.block_size} = ${fmtNum(p.token_slots)} token slots. `
      + `It stores ${p.dtype} whatever the weights' format, so each token costs ${p.bytes_per_value / 2}× the bf16 figure.`;
  }

  function choosePreset(key) {
    state.preset = key;
    if (key !== "custom") {
      state.shape = { ...PRESETS[key] };
      layers.value = state.shape.layers;
      kvHeads.value = state.shape.kvHeads;
      head.value = state.shape.head;
    }
    render();
  }

  presetSel.addEventListener("change", () => choosePreset(presetSel.value));
  for (const input of [layers, kvHeads, head]) {
    input.addEventListener("input", () => {
      readShape();
      state.preset = "custom";
      state.shape.mla = null;
      presetSel.value = "custom";
      render();
    });
  }
  for (const input of [dtypeSel, context, batch]) input.addEventListener("input", render);
  dtypeSel.addEventListener("change", render);

  render();
  ctx.client.call({ type: "kv_pool" }).then((pool) => {
    if (!state.alive) return;
    state.pool = pool;
    drawLive();
    setState(root, "ready");
  }).catch((err) => { if (state.alive) setState(root, "error", err.message); });

  return () => {
    state.alive = false;
    root.replaceChildren();
  };
}

function clampInt(text, lo, hi, fallback) {
  const n = Number(text);
  return Number.isInteger(n) && n >= lo && n <= hi ? n : fallback;
}

// Section 10, "KV memory": a calculator of the KV cache's size, computed here in the browser from
// a model's shape, with presets from the models' public configs, a comparison of full attention,
// grouped-query, multi-query and latent attention at the same context, and one line checked
// against the live engine: the bytes its KV tensors hold per token slot.

import { el, field, select } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtBytes, fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { DTYPES, PRESETS, valuesPerToken } from "../lib/kv-shapes.js";
import { teardown } from "../lib/lifecycle.js";

// The presets and the formula live in lib/kv-shapes.js; these names stay for embeds and widgets
// that imported them from here before.
export { DTYPES, PRESETS, valuesPerToken };

const OPTIONS = {
  preset: { type: "string", default: "smollm2-135m", choices: Object.keys(PRESETS) },
  dtype: { type: "string", default: "bf16", choices: Object.keys(DTYPES) },
  context: { type: "int", default: 8192, min: 1, max: 1048576 },
  batch: { type: "int", default: 1, min: 1, max: 4096 },
};

function build(opts, shape) {
  const num = (name, value, min, max) => el("input", { type: "number", name, value, min, max, step: 1, "aria-label": name });
  const view = {
    presetSel: select([...Object.entries(PRESETS).map(([k, p]) => [k, p.label]), ["custom", "custom"]], opts.preset, { name: "preset", "aria-label": "Model" }),
    layers: num("layers", shape.layers, 1, 1000),
    kvHeads: num("kv_heads", shape.kvHeads, 1, 1024),
    head: num("head_dim", shape.head, 1, 4096),
    dtypeSel: select(Object.keys(DTYPES).map((k) => [k, `${k} (${DTYPES[k]} B)`]), opts.dtype, { name: "dtype", "aria-label": "Number format" }),
    context: num("context", opts.context, 1, 1048576),
    batch: num("batch", opts.batch, 1, 4096),
    perToken: stat("Per token", { key: "kv_bytes_per_token", note: "bytes in the cache" }),
    total: stat("Whole batch", { key: "kv_bytes_total", note: "context × batch" }),
    perSeq: stat("One sequence", { note: "at this context" }),
    formula: el("p", { class: "kvm-formula", "aria-live": "polite" }),
    compare: el("div", { class: "kvm-compare", role: "table", "aria-label": "Attention variants at the same context" }),
    compareNote: el("p", { class: "note" }),
    livePool: stat("Live pool", { key: "live_pool_bytes_per_token", note: "bytes per token slot" }),
    calcLive: stat("Calculator", { note: "the served model, its dtype" }),
    liveNote: el("p", { class: "note" }),
    liveCheck: el("p", { class: "kvm-check" }),
  };
  const v = view;
  view.nodes = [
    el("div", { class: "controls" }, [field("model", v.presetSel), field("layers", v.layers), field("KV heads", v.kvHeads), field("head size", v.head)]),
    el("div", { class: "controls" }, [field("number format", v.dtypeSel), field("context", v.context, "tokens"), field("batch", v.batch, "sequences")]),
    el("div", { class: "kvm-grid" }, [
      figure("KV cache size", ["computed"], [el("div", { class: "stats" }, [v.perToken.node, v.perSeq.node, v.total.node]), v.formula]),
      figure("Checked against this server's pool", ["live", "computed"], [el("div", { class: "stats" }, [v.livePool.node, v.calcLive.node]), v.liveCheck, v.liveNote]),
    ]),
    figure("Full attention, GQA, MQA and MLA at the same context", ["computed"], [v.compare, v.compareNote]),
  ];
  return view;
}

// The calculator for shape s at `bytes` a value, ctxLen tokens and n sequences.
function renderSize(view, s, bytes, ctxLen, n) {
  const values = valuesPerToken(s), per = values * bytes;
  view.perToken.set(per, `${fmtNum(per)} B`);
  view.perSeq.set(per * ctxLen, fmtBytes(per * ctxLen));
  view.total.set(per * ctxLen * n, fmtBytes(per * ctxLen * n));
  const tail = `× ${fmtNum(ctxLen)} tokens × ${n} = ${fmtBytes(per * ctxLen * n)}`;
  view.formula.textContent = s.mla
    ? `MLA: ${s.layers} layers × (${s.mla.latent} latent + ${s.mla.rope} RoPE key) = ${fmtNum(values)} values × ${bytes} B = ${fmtNum(per)} B per token; ${tail}`
    : `2 (K and V) × ${s.layers} layers × ${s.kvHeads} KV heads × ${s.head} = ${fmtNum(values)} values × ${bytes} B = ${fmtNum(per)} B per token; ${tail}`;
  view.kvHeads.disabled = Boolean(s.mla);
  view.head.disabled = Boolean(s.mla);
}

// The same layers, query heads and head size with four ways of keeping keys and values.
function renderCompare(view, s, bytes, ctxLen, n) {
  const heads = s.heads ?? s.kvHeads;
  const gqaHeads = s.mla ? Math.max(1, heads / 16) : s.kvHeads;
  const rows = [
    ["Full attention (MHA)", `${heads} KV heads, one per query head`, 2 * s.layers * heads * s.head],
    ["Grouped-query (GQA)", `${gqaHeads} KV heads${s.mla ? " (an example: 1 per 16 query heads)" : ", this model's"}`, 2 * s.layers * gqaHeads * s.head],
    ["Multi-query (MQA)", "1 KV head for all", 2 * s.layers * 1 * s.head],
    ["Latent (MLA)", "512 latent + 64 RoPE key per layer, DeepSeek-V3's sizes", s.layers * (512 + 64)],
  ];
  const max = Math.max(...rows.map((r) => r[2]));
  view.compare.replaceChildren(...rows.map(([name, how, values]) => el("div", { class: "kvm-row", role: "row" }, [
    el("span", { class: "kvm-name", role: "cell" }, [el("strong", { text: name }), el("span", { class: "kvm-how", text: how })]),
    el("span", { class: "kvm-bar", role: "cell" }, [el("span", { class: "kvm-fill", style: { width: `${(100 * values) / max}%` } })]),
    el("span", { class: "kvm-val", role: "cell", text: `${fmtNum(values * bytes)} B/token · ${fmtBytes(values * bytes * ctxLen * n)}` }),
  ])));
  view.compareNote.textContent = `${s.layers} layers, ${heads} query heads of size ${s.head}, ${view.dtypeSel.value}, ${fmtNum(ctxLen)} tokens × ${n}. `
    + "Every variant keeps the same query heads; they differ in how many keys and values each token leaves behind. "
    + "MLA stores one compressed latent per layer and rebuilds every head's keys and values from it.";
}

// The live engine's pool (a kv_pool reply) against the calculator.
export function renderLive(view, p) {
  if (!p) return;
  const mine = valuesPerToken({ layers: p.num_layers, kvHeads: p.num_kv_heads, head: p.head_dim }) * p.bytes_per_value;
  view.livePool.set(p.live_pool_bytes_per_token, `${fmtNum(p.live_pool_bytes_per_token)} B`);
  view.calcLive.set(mine, `${fmtNum(mine)} B`);
  const shape = (t) => `[${t.shape.join(", ")}] (${t.dims.join(", ")})`;
  const names = Object.entries(p.tensors).map(([k, t]) => `${k.toUpperCase()} ${shape(t)} ${t.dtype}`).join(" and ");
  view.liveCheck.textContent = mine === p.live_pool_bytes_per_token
    ? `✓ The calculator at ${p.dtype} (${p.num_layers} layers × ${p.num_kv_heads} KV heads × ${p.head_dim}) gives what the pool holds.`
    : `✗ The calculator gives ${fmtNum(mine)} B, the pool ${fmtNum(p.live_pool_bytes_per_token)} B per token.`;
  view.liveCheck.classList.toggle("is-ok", mine === p.live_pool_bytes_per_token);
  view.liveNote.textContent = `This server's engine keeps ${names}: `
    + `${fmtNum(p.kv_bytes)} bytes for ${fmtNum(p.total_blocks)} blocks × ${p.block_size} = ${fmtNum(p.token_slots)} token slots. `
    + `It stores ${p.dtype}, ${p.bytes_per_value} bytes a value: bfloat16 where attention rounds its keys and values to bf16 `
    + "(q4_1 on the engine's kernels), float32 in the other formats.";
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { shape: { ...PRESETS[opts.preset] }, preset: opts.preset, pool: null };
  const view = build(opts, state.shape);
  root.append(...view.nodes);
  const job = jobRunner(root, { client: ctx.client });

  function render() {
    const s = state.shape, bytes = DTYPES[view.dtypeSel.value];
    const ctxLen = clampInt(view.context.value, 1, 1048576, opts.context), n = clampInt(view.batch.value, 1, 4096, opts.batch);
    renderSize(view, s, bytes, ctxLen, n);
    renderCompare(view, s, bytes, ctxLen, n);
    renderLive(view, state.pool);
    ctx.setOptions({ preset: state.preset === "custom" ? OPTIONS.preset.default : state.preset, dtype: view.dtypeSel.value, context: ctxLen, batch: n }, OPTIONS);
  }

  view.presetSel.addEventListener("change", () => {
    state.preset = view.presetSel.value;
    if (state.preset !== "custom") {
      state.shape = { ...PRESETS[state.preset] };
      for (const key of ["layers", "kvHeads", "head"]) view[key].value = state.shape[key];
    }
    render();
  });
  const LIMITS = [["layers", 1000], ["kvHeads", 1024], ["head", 4096]];
  const onShape = () => {
    for (const [key, hi] of LIMITS) state.shape[key] = clampInt(view[key].value, 1, hi, state.shape[key]);
    state.preset = "custom";
    state.shape.mla = null;
    view.presetSel.value = "custom";
    render();
  };
  for (const [key] of LIMITS) view[key].addEventListener("input", onShape);
  for (const input of [view.dtypeSel, view.context, view.batch]) input.addEventListener("input", render);
  view.dtypeSel.addEventListener("change", render);

  render();
  const offStatus = ctx.connected(() => job.run({ type: "kv_pool" }, { render: (pool) => { state.pool = pool; renderLive(view, pool); } }));
  return teardown(root, [job.stop, offStatus]);
}

function clampInt(text, lo, hi, fallback) {
  const n = Number(text);
  return Number.isInteger(n) && n >= lo && n <= hi ? n : fallback;
}

// Section 20, "Efficiency tricks": the engine's four weight formats on the reader's text, measured
// here. Above: a table of each format's weight bytes, decode speed, top-5 agreement and KL against
// fp32, and perplexity on held-out text, with a line on the format this server serves in. Below:
// the reader's text as chips; the chosen position's top candidates under each format side by side.

import { el, pressable, scrollBox } from "../lib/dom.js";
import { figure } from "../lib/figures.js";
import { activationRounding, fmtBytes, fmtNum, fmtPct, visibleWhitespace } from "../lib/format.js";
import { jobRunner, percent } from "../lib/job.js";
import { measuredAt, measuring, progressLine, threadsOn, view } from "../lib/measure.js";
import { tokenChips } from "../lib/tokens.js";

const DEFAULT_TEXT = "The old lighthouse keeper climbed the stairs every night to light the lamp, and the ships that passed";
const FORMATS = ["fp32", "bf16", "q8_0", "q4_1"];
const FORMAT_WORDS = {
  fp32: "fp32: 4 bytes a weight, the reference",
  bf16: "bf16: 2 bytes a weight, fp32's exponent with 8 bits of mantissa",
  q8_0: "q8_0: 8-bit integers, one fp16 scale per 32 weights",
  q4_1: "q4_1: 4-bit integers, a scale and a minimum per 32 (the model file's own)",
};

// A row's heading tooltip: the format in words, and how its products rounded the activations here.
function formatWords(row) {
  const how = activationRounding(row.format, row.activation_rounding, row.attention_operands);
  return how ? `${FORMAT_WORDS[row.format]}; ${how}` : FORMAT_WORDS[row.format];
}

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 2000 },
  position: { type: "int", default: -1, min: -1, max: 100000 },
};

// The table's columns: [heading, the figure keys of its cells in FORMATS' order (docs/widgets.md), format(value)].
const COLUMNS = [
  ["weight bytes", ["weight_bytes_fp32", "weight_bytes_bf16", "weight_bytes_q8_0", "weight_bytes_q4_1"], (x) => fmtBytes(x)],
  ["decode tokens/s", ["decode_tokens_per_s_fp32", "decode_tokens_per_s_bf16", "decode_tokens_per_s_q8_0",
    "decode_tokens_per_s_q4_1"], (x) => fmtNum(x, 3)],
  ["top-5 agreement", ["top5_agreement_fp32", "top5_agreement_bf16", "top5_agreement_q8_0", "top5_agreement_q4_1"],
    (x) => fmtPct(x)],
  ["KL from fp32 (nats)", ["kl_fp32", "kl_bf16", "kl_q8_0", "kl_q4_1"], (x) => (x === 0 ? "0" : x.toExponential(2))],
  ["perplexity", ["perplexity_fp32", "perplexity_bf16", "perplexity_q8_0", "perplexity_q4_1"], (x) => fmtNum(x, 4)],
];

const VIEW = { machineLine: "p.note.machine", serving: "p.quant-serving", tableNote: "p.note", chooser: "div.quant-tokens",
  positionNote: "p.note", sideBySide: "div.quant-columns" };

function build(opts) {
  const v = {
    input: el("input", { type: "text", class: "text-input", name: "text", value: opts.text, "aria-label": "Text" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }), progress: progressLine(),
    table: el("table", { class: "quant-table figure-table" }), ...view(VIEW),
  };
  scrollBox(v.chooser, "The text's tokens: pick a position");
  v.nodes = [
    el("div", { class: "controls" }, [v.input, v.again]),
    v.progress, v.machineLine,
    figure("Four weight formats, measured here", ["live", "measured"], [
      scrollBox(el("div", { class: "quant-scroll" }, [v.table]), "The formats' figures"), v.serving, v.tableNote,
    ]),
    figure("One position, four formats", ["live"], [v.chooser, v.positionNote, v.sideBySide]),
  ];
  return v;
}

function headRow() {
  return el("tr", {}, [el("th", { scope: "col", text: "format" }), ...COLUMNS.map(([h]) => el("th", { scope: "col", text: h }))]);
}

function formatRow(r, row) {
  const i = FORMATS.indexOf(row.format);
  const cells = COLUMNS.map(([, keys, show]) => {
    const value = r[keys[i]];
    return el("td", {}, [el("span", { "data-figure": keys[i], "data-value": String(value), text: show(value) })]);
  });
  const served = row.format === r.serving_format;
  return el("tr", { class: served ? "quant-served" : null }, [
    el("th", { scope: "row", title: formatWords(row), text: served ? `${row.format} (served)` : row.format }), ...cells]);
}

function servingText(r) {
  const by = Object.fromEntries(r.formats.map((f) => [f.format, f]));
  const s = by[r.serving_format], fp = by.fp32;
  if (!s) return `This server serves in ${r.serving_format}.`;
  const fastest = r.formats.reduce((a, b) => (b.decode_tokens_per_s > a.decode_tokens_per_s ? b : a));
  const speed = s.decode_tokens_per_s / fp.decode_tokens_per_s, ppl = s.perplexity / fp.perplexity - 1;
  const pplText = Math.abs(ppl) < 5e-5 ? "the same held-out perplexity as fp32's"
    : `a held-out perplexity ${fmtPct(Math.abs(ppl), 2)} ${ppl > 0 ? "higher" : "lower"} than fp32's`;
  return `This server serves chats in ${r.serving_format} (its engine's weight_format setting), chosen because a decode step `
    + `reads every weight once: here that format reads ${fmtPct(s.weight_bytes / fp.weight_bytes, 0)} of fp32's bytes a step, `
    + `decodes ${fmtNum(speed, 3)}× as fast as fp32 and gives ${pplText}. `
    + (fastest.format === r.serving_format
      ? "It is also the fastest format measured in this run."
      : `In this run ${fastest.format} decoded fastest (${fmtNum(fastest.decode_tokens_per_s, 3)} against `
        + `${fmtNum(s.decode_tokens_per_s, 3)} tokens/s): bytes are not all, each format's kernel and the machine's load `
        + "count too, and the README's benchmark compares the formats over repeated runs.");
}

function renderTable(v, r) {
  v.table.replaceChildren(el("thead", {}, [headRow()]), el("tbody", {}, r.formats.map((row) => formatRow(r, row))));
  v.serving.textContent = servingText(r);
  const h = r.held_out;
  v.tableNote.textContent = `Agreement and KL over the ${r.tokens.length} positions of your text, each format against fp32 `
    + `(bf16, q8_0 and q4_1 recompute their top ${r.lm_head_candidates} logits in fp32, as the engine does). Perplexity on the `
    + `held-out text of the mixture-of-experts table: ${h.pieces} pieces of ${h.piece_tokens} tokens from ${h.source}, `
    + `${fmtNum(h.predicted_tokens)} predicted tokens. Decode: ${r.decode_tokens} steps after your text, the median step.`;
}

function candidateColumn(row, fp32Ids, position) {
  const items = row.top[position].map((c) => el("li", { class: fp32Ids.has(c.id) ? "quant-same" : "quant-moved" }, [
    el("span", { class: "quant-cand", text: visibleWhitespace(c.text) || "∅" }),
    el("span", { class: "quant-prob", text: fmtPct(c.prob) }),
  ]));
  return el("div", { class: "quant-column" }, [el("h4", { text: row.format }), el("ol", {}, items)]);
}

function renderPosition(v, r, position) {
  const fp32 = r.formats.find((f) => f.format === "fp32");
  const fp32Ids = new Set(fp32.top[position].map((c) => c.id));
  v.sideBySide.replaceChildren(...r.formats.map((row) => candidateColumn(row, fp32Ids, position)));
  const moved = r.formats.filter((f) => !f.top5_same[position]).map((f) => f.format);
  const tok = r.tokens[position];
  v.positionNote.textContent = `After token ${position} ("${visibleWhitespace(tok.text)}"): the ${r.top} most likely next tokens. `
    + (moved.length ? `Marked: candidates outside fp32's top ${r.top}, in ${moved.join(", ")}.`
      : `Every format has fp32's top ${r.top} here; the probabilities move a little.`);
  for (const chip of v.chooser.querySelectorAll(".tok")) chip.classList.toggle("quant-chosen", Number(chip.dataset.index) === position);
}

function renderChooser(v, r, choose) {
  const differs = (i) => r.formats.some((f) => !f.top5_same[i]);
  v.chooser.replaceChildren(...tokenChips(r.tokens, {
    className: (tok, i) => (differs(i) ? "quant-differs" : ""),
    title: (tok, i) => `position ${i}${differs(i) ? ": a format's top 5 differs from fp32's" : ""}`,
    breakLines: false,
  }));
  for (const chip of v.chooser.querySelectorAll(".tok")) pressable(chip, () => choose(Number(chip.dataset.index)));
}

function render(v, r, ctx, state) {
  const m = r.machine;
  v.machineLine.textContent = `Measured here: ${m.system} ${m.processor}, ${threadsOn(m)}, ${measuredAt(m)}, `
    + "one engine per format beside the serving one, on the same weights.";
  renderTable(v, r);
  const last = r.tokens.length - 1;
  const choose = (i) => {
    state.position = i;
    ctx.setOptions({ text: v.input.value, position: i === last ? -1 : i }, OPTIONS);
    renderPosition(v, r, i);
  };
  renderChooser(v, r, choose);
  const wanted = state.position;
  renderPosition(v, r, wanted >= 0 && wanted <= last ? wanted : last);
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  const v = build(opts);
  const state = { position: opts.position };
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const life = measuring(root, ctx, {
    job, button: v.again, typed: [v.input],
    measure(run) {
      if (!v.input.value.trim()) return Promise.resolve();
      ctx.setOptions({ text: v.input.value, position: state.position }, OPTIONS);
      return job.run({ type: "quantization", text: v.input.value, run }, {
        running: "Packing the weights in each format…",
        onProgress: (p) => `${p.note} (${percent(p)})…`,
        render: (r) => render(v, r, ctx, state),
        done: (r) => `${r.formats.length} formats on your ${r.tokens.length} tokens and the held-out text.`,
      });
    },
  });
  return life.unmount;
}

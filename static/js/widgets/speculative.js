// Section 20, "Efficiency tricks": speculative decoding on the reader's prompt, on a sibling of the
// serving engine. Top: each verify pass, the draft's tokens kept (green) or rejected (red, struck)
// and the model's own token after them (blue). Then the acceptance rate at each draft position,
// and the measured speed-up over plain decoding of the same request for both drafts, k = 1…8.

import { el, field, scrollBox, select } from "../lib/dom.js";
import { figure } from "../lib/figures.js";
import { fmtMs, fmtNum, fmtPct, visibleWhitespace } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { measuredAt, measuring, progressLine, shareBar, threadsOn, view } from "../lib/measure.js";

// Two prompts that show why prompt lookup wins on one and loses on the other.
const PRESETS = {
  code: ["Repetitive: code", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    + "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n\ndef"],
  list: ["Repetitive: a list", "Monday: 9:00 standup, 10:00 review, 12:00 lunch\nTuesday: 9:00 standup, 10:00 review, 12:00 lunch\n"
    + "Wednesday: 9:00 standup, 10:00 review, 12:00 lunch\nThursday:"],
  free: ["Free text", "Write a short story about a lighthouse keeper who finds a message in a bottle."],
};
const DRAFTS = { ngram: "prompt lookup", self: "self-speculation" };
const DRAFT_TITLES = { ngram: "n-gram matches in the context propose what followed them",
  self: "the model's own first layers and its head propose" };
const KS = [1, 2, 3, 4, 5, 6, 7, 8];

const OPTIONS = {
  draft: { type: "string", default: "ngram", choices: Object.keys(DRAFTS) },
  k: { type: "int", default: 4, choices: KS },
  text: { type: "string", default: PRESETS.code[1], maxLength: 4000 },
};

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  acceptance: ["Acceptance rate", "acceptance_rate", "draft tokens kept"],
  perPass: ["Tokens per pass", "tokens_per_pass", "1 is plain decoding"],
  speedup: ["Speed-up", "speedup", "against plain decoding", "measured"],
  same: ["Same as plain", "same_as_plain", "greedy output, token for token"],
  passes: "div.sp-passes", passNote: "p.note", positions: "div.sp-positions", positionNote: "p.note",
  sweep: "div.sp-sweep", sweepNote: "p.note", machine: "p.note.sp-machine",
};

function build(opts) {
  const v = {
    preset: select([["", "Presets…"], ...Object.entries(PRESETS).map(([k, [label]]) => [k, label])], "", { "aria-label": "Preset prompt", name: "preset" }),
    text: el("textarea", { class: "text-input", name: "text", rows: 4, "aria-label": "Prompt" }),
    draft: select(Object.entries(DRAFTS), opts.draft, { "aria-label": "Draft", name: "draft" }),
    k: select(KS.map((n) => [n, `k = ${n}`]), opts.k, { "aria-label": "Draft tokens per pass", name: "k" }),
    again: el("button", { type: "button", class: "primary", text: "Measure again" }),
    progress: progressLine(),
    ...view(VIEW),
  };
  v.text.value = opts.text;
  scrollBox(v.passes, "Verify passes");
  v.sweep.setAttribute("role", "table");
  v.sweep.setAttribute("aria-label", "Speed-up at each k, both drafts");
  v.draft.title = DRAFT_TITLES[opts.draft];
  v.nodes = [
    field("prompt", v.text),
    el("div", { class: "controls" }, [v.preset, field("draft", v.draft), field("k", v.k), v.again]),
    v.progress,
    figure("Each verify pass: the draft's guesses and the model's verdict", ["live"], [
      el("div", { class: "stats" }, [v.acceptance.node, v.perPass.node, v.same.node]),
      legend(), v.passes, v.passNote]),
    figure("Acceptance at each draft position", ["live"], [v.positions, v.positionNote]),
    figure("Speed-up over plain decoding, both drafts, k = 1…8", ["measured"], [
      el("div", { class: "stats" }, [v.speedup.node]), v.sweep, v.sweepNote, v.machine]),
  ];
  return v;
}

function legend() {
  const key = (cls, text) => el("span", { class: `sp-key ${cls}`, text });
  return el("div", { class: "legend sp-legend" }, [key("sp-kept", "kept draft token"), key("sp-rejected", "rejected draft token"),
    key("sp-own", "the model's own token")]);
}

function chip(token, cls, title) {
  return el("span", { class: `sp-tok ${cls}`, title, text: visibleWhitespace(token.text) || " " });
}

function renderPasses(v, r) {
  v.passes.replaceChildren(...r.passes.map((p, i) => el("div", { class: "sp-pass" }, [
    el("span", { class: "sp-pass-n", text: String(i + 1) }),
    el("span", { class: "sp-pass-toks" }, [
      ...p.proposed.map((t, j) => chip(t, j < p.accepted ? "sp-kept" : "sp-rejected",
        `draft token ${j + 1} (id ${t.id}): ${j < p.accepted ? "kept" : "rejected"}`)),
      chip(p.token, "sp-own", p.accepted < p.proposed.length ? `the model's correction (id ${p.token.id})` : `the model's next token (id ${p.token.id})`),
    ]),
  ])));
  const passes = r.passes.length;
  v.passNote.textContent = `${r.generated_tokens} tokens in ${passes} passes of the model after the first token `
    + `(plain decoding needs ${r.generated_tokens - 1}). A pass with no guesses is a plain decode step: `
    + (r.draft === "ngram" ? "prompt lookup proposes only when the last tokens occurred before in the context."
      : `the draft runs ${r.draft_layers} of the model's ${r.num_layers} layers, then its head, once per guess.`);
}

function renderPositions(v, r) {
  v.positions.replaceChildren(...r.acceptance_per_position.map((a, i) => el("div", { class: "sp-row" }, [
    el("span", { class: "sp-row-label", text: `position ${i + 1}` }),
    shareBar("sp", "is-kept", a ?? 0, 1, a === null ? "never proposed" : `${fmtPct(a)} of ${r.proposed_per_position[i]}`),
  ])));
  v.positionNote.textContent = "Position i is kept only if every guess before it was: later positions are kept less often. "
    + "Each kept token saves a decode step.";
}

function renderSweep(v, r) {
  const rows = r.sweep.ngram.map((_, i) => [r.sweep.ngram[i], r.sweep.self[i]]);
  const max = Math.max(1, ...rows.flat().map((x) => x.speedup));
  const cell = (x, kind) => el("span", { class: "sp-cell", role: "cell",
    title: `${fmtNum(x.speedup, 3)}× the speed of plain decoding; ${fmtNum(x.tokens_per_pass, 3)} tokens a pass; `
      + `${x.acceptance_rate === null ? "nothing proposed" : `${fmtPct(x.acceptance_rate)} of guesses kept`}` }, [
    shareBar("sp", kind, x.speedup, max, `${fmtNum(x.speedup, 3)}× · ${fmtNum(x.tokens_per_pass, 2)}/pass`)]);
  const head = el("div", { class: "sp-tr sp-th", role: "row" }, ["k", "prompt lookup", "self-speculation"].map((t) => el("span", { role: "columnheader", text: t })));
  v.sweep.replaceChildren(head, ...rows.map(([n, s]) => el("div", { class: `sp-tr${n.k === r.k ? " is-chosen" : ""}`, role: "row" }, [
    el("span", { role: "cell", class: "sp-k", text: String(n.k) }), cell(n, "is-ngram"), cell(s, "is-self"),
  ])));
  const same = rows.flat().every((x) => x.same_as_plain === 1);
  v.sweepNote.textContent = `Plain decoding: ${fmtMs(r.plain_ms_per_token)} a token. Speed-up: its time per token over each run's, `
    + `every run ${r.generated_tokens} greedy tokens of the same prompt (${r.weight_format}). Each bar: the speed-up, then tokens per pass; past 1× is faster. `
    + (same ? "Every run gave plain decoding's tokens. " : "Some run did not give plain decoding's tokens: a bug. ")
    + "A pass costs more than a decode step (more tokens, and the draft's own work), so speculation wins only where the guesses are kept.";
}

function render(v, r) {
  v.acceptance.set(r.acceptance_rate, r.acceptance_rate === null ? "none proposed" : fmtPct(r.acceptance_rate));
  v.perPass.set(r.tokens_per_pass, fmtNum(r.tokens_per_pass, 3));
  v.speedup.set(r.speedup, `${fmtNum(r.speedup, 3)}×`);
  v.same.set(r.same_as_plain, r.same_as_plain ? "yes" : "no");
  renderPasses(v, r);
  renderPositions(v, r);
  renderSweep(v, r);
  const m = r.machine;
  v.machine.textContent = `Measured here ${measuredAt(m)}: ${threadsOn(m)} (${m.processor}), on an engine beside the serving one, `
    + "one request at a time; the machine is shared, so the times move from run to run.";
}

function measure(ctx, job, v, run) {
  const text = v.text.value;
  ctx.setOptions({ draft: v.draft.value, k: Number(v.k.value), text }, OPTIONS);
  return job.run({ type: "speculative", draft: v.draft.value, k: Number(v.k.value), text, run }, {
    running: "Decoding the prompt, plain and speculative…",
    onProgress: (p) => `Measuring ${p.note} (${p.done} of ${p.total})…`,
    render: (r) => render(v, r),
    done: (r) => `Ran plain decoding and ${Object.values(r.sweep).reduce((n, rows) => n + rows.length, 0)} speculative runs (the chosen draft and k among them).`,
  });
}

export function mount(root, ctx) {
  const v = build(ctx.readOptions(OPTIONS).values);
  root.append(...v.nodes);
  const job = jobRunner(root, { client: ctx.client, progress: v.progress, button: v.again });
  const life = measuring(root, ctx, { job, button: v.again, changed: [v.draft, v.k, v.text],
    measure: (run) => measure(ctx, job, v, run) });
  v.preset.addEventListener("change", () => {
    if (!PRESETS[v.preset.value]) return;
    v.text.value = PRESETS[v.preset.value][1];
    v.preset.value = "";
    life.measure();
  });
  return life.unmount;
}

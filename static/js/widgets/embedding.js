// Section 3, "Embeddings": pick a token (type a word, or an ID) and see the lookup for what it
// is, indexing: the ID selects one row of the embedding table, and that row is the vector. The
// row is drawn as a strip of its real values; beside it, the rows that point the most the same
// way (cosine over the whole table). Click a neighbour to look it up in turn.

import { describeChart, el, scrollBox, svg } from "../lib/dom.js";
import { figure, view as viewOf } from "../lib/figures.js";
import { fmtNum, visibleWhitespace as visible } from "../lib/format.js";
import { escapeLabel, plot } from "../lib/chart.js";
import { jobRunner } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";
import { mountView, teardown } from "../lib/lifecycle.js";

const DEFAULT_TOKEN = " cat";

// Options from the URL (docs/widgets.md): a word (its first token is used) or an ID, and k.
const OPTIONS = {
  token: { type: "string", default: DEFAULT_TOKEN, maxLength: 200 },
  token_id: { type: "int", default: null, min: 0 },
  k: { type: "int", default: 10, choices: [5, 10, 20, 50] },
};

// A token's text for a label: whitespace visible, byte pieces as their bytes.
function shown(tok) {
  if (tok.special) return tok.text;
  if (tok.bytes) return tok.bytes.toUpperCase();
  return visible(tok.text);
}

const VIEW = {  // name: a stat tile [label, figure key, note] or an element "tag.class"
  picked: "p.note.picked", diagram: "div.lookup", strip: "div.chart.strip", stripNote: "p.note.strip-note",
  tokenId: ["Token ID", "token_id", "= its row number"], rowNorm: ["Row length", "row_norm", "L2 norm of the row"],
  topCos: ["Top cosine", "top_cosine", "nearest other row"], listNote: "p.note",
};

function build(opts) {
  const fieldOf = (label, control) => el("label", { class: "field" }, [el("span", { class: "field-label", text: label }), control]);
  const view = {
    wordInput: el("input", { type: "text", class: "word", "aria-label": "Word", name: "token", spellcheck: "false" }),
    idInput: el("input", { type: "number", min: "0", step: "1", "aria-label": "Token ID", name: "token_id" }),
    kSelect: el("select", { "aria-label": "Neighbours" }, OPTIONS.k.choices.map((v) => el("option", { value: String(v), text: String(v) }))),
    progress: el("p", { class: "progress", "aria-live": "polite" }),
    ...viewOf(VIEW),
    list: scrollBox(el("ol", { class: "neighbours" }), "Nearest rows by cosine"),
  };
  view.wordInput.value = opts.token_id === null ? opts.token : "";
  if (opts.token_id !== null) view.idInput.value = String(opts.token_id);
  view.kSelect.value = String(opts.k);
  describeChart(view.strip, "The row's values as a strip", view.stripNote);
  view.form = el("form", { class: "controls" }, [
    fieldOf("word", view.wordInput), fieldOf("or ID", view.idInput), fieldOf("neighbours", view.kSelect),
    el("button", { type: "submit", class: "primary", text: "Look up" }),
  ]);
  view.nodes = [
    view.form, view.progress,
    el("div", { class: "grid" }, [
      figure("The lookup: an ID picks a row", ["live"], [view.picked, view.diagram, view.stripNote, view.strip,
        el("div", { class: "stats" }, [view.tokenId.node, view.rowNorm.node, view.topCos.node])]),
      figure("Rows pointing the same way", ["live"], [view.listNote, view.list]),
    ]),
  ];
  return view;
}

// The lookup drawn as what it is: the ID points at one row of a tall table, and that row is
// the vector (the strip below). Row positions are to scale.
function renderDiagram(view, r) {
  const W = 400, H = 150, tx = 170, tw = 40, ty = 14, th = 118;
  const y = ty + (r.token_id / (r.num_rows - 1)) * th;
  const label = shown(r.token);
  const small = (x, yy, text, extra = {}) => svg("text", { x, y: yy, class: "d-small", text, ...extra });
  const parts = [
    svg("defs", {}, [svg("marker", { id: "emb-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" },
      [svg("path", { d: "M0,0 L10,5 L0,10 z", class: "d-head" })])]),
    svg("text", { x: 2, y: 56, class: "d-label", text: "token" }),
    svg("text", { x: 2, y: 78, class: "d-token", text: label.length > 10 ? `${label.slice(0, 9)}…` : label }),
    svg("text", { x: 2, y: 98, class: "d-id", text: `ID ${r.token_id.toLocaleString("en-US")}` }),
    svg("line", { x1: 96, y1: 93, x2: tx - 8, y2: y, class: "d-arrow", "marker-end": "url(#emb-arrow)" }),
    svg("rect", { x: tx, y: ty, width: tw, height: th, class: "d-table" }),
    small(tx + tw / 2 + 4, ty + th / 2, `${r.num_rows.toLocaleString("en-US")} rows`, { "text-anchor": "middle", transform: `rotate(-90 ${tx + tw / 2 + 4} ${ty + th / 2})` }),
    small(tx + tw / 2, ty - 4, "row 0", { "text-anchor": "middle" }),
    small(tx + tw / 2, ty + th + 13, `row ${(r.num_rows - 1).toLocaleString("en-US")}`, { "text-anchor": "middle" }),
    svg("rect", { x: tx - 3, y: y - 2, width: tw + 6, height: 4, class: "d-row" }),
    svg("line", { x1: tx + tw + 6, y1: y, x2: 240, y2: 70, class: "d-arrow", "marker-end": "url(#emb-arrow)" }),
    svg("text", { x: 246, y: 62, class: "d-label", text: `row ${r.token_id.toLocaleString("en-US")} = the vector` }),
    small(246, 80, `${r.hidden_size} numbers, used as`), small(246, 94, "they are: nothing is"), small(246, 108, "multiplied (drawn below)"),
  ];
  view.diagram.replaceChildren(svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `ID ${r.token_id} selects row ${r.token_id} of ${r.num_rows}` }, parts));
}

// The row as a heatmap strip, with the nearest neighbour's row under it: similar directions
// show as similar stripes.
function renderStrip(view, r) {
  const rows = [{ label: shown(r.token), values: r.row }];
  if (r.nearest_row) rows.unshift({ label: `${shown(r.neighbours[0])} (nearest)`, values: r.nearest_row });
  view.stripNote.textContent = `Row ${r.token_id.toLocaleString("en-US")} as a strip: each of its ${r.hidden_size} values is one column, blue above zero and red below${r.nearest_row ? `, with the nearest row, ${shown(r.neighbours[0])}, under it for comparison` : ""}. Hover for a value.`;
  return plot(view.strip, [{
    type: "heatmap", z: rows.map((x) => x.values), x: r.row.map((_, i) => i), y: rows.map((x) => escapeLabel(x.label)),
    colorscale: "RdBu", reversescale: true, zmid: 0, ygap: 3,
    hovertemplate: "%{y} · dimension %{x}: %{z:.4f}<extra></extra>",
    colorbar: { thickness: 8, len: 1, outlinewidth: 0, tickfont: { size: 9 } },
  }], {
    height: 150, margin: { l: 8, r: 8, t: 4, b: 34 },
    xaxis: { title: { text: `dimension (0–${r.hidden_size - 1})`, font: { size: 10 } }, tickfont: { size: 9 }, fixedrange: true },
    yaxis: { automargin: true, tickfont: { size: 10, family: "ui-monospace, DejaVu Sans Mono, monospace" }, fixedrange: true },
  });
}

function renderNeighbours(view, r, onPick) {
  view.list.replaceChildren(...r.neighbours.map((n, i) => {
    const [chip] = tokenChips([n], { onClick: () => onPick({ token_id: n.id }), title: () => `ID ${n.id} · cosine ${n.cosine.toFixed(4)} · click to look it up` });
    const width = Math.max(0, n.cosine) * 100;   // cosine 1 would fill the bar
    return el("li", { class: "neighbour" }, [
      el("span", { class: "rank muted", text: String(i + 1) }),
      chip,
      el("span", { class: "nid muted", text: `ID ${n.id.toLocaleString("en-US")}` }),
      el("span", { class: "bar" }, [el("span", { class: "fill", style: `width:${width.toFixed(1)}%` })]),
      el("span", { class: "cos", text: n.cosine.toFixed(3) }),
    ]);
  }));
  view.listNote.textContent = `The ${r.neighbours.length} rows of all ${r.num_rows.toLocaleString("en-US")} with the highest cosine to row ${r.token_id.toLocaleString("en-US")}; the token itself (cosine 1) is left out. Click one to look it up.`;
}

// Which token the text or ID picked; `spaced` is the token the word begins with after a space
// (a word typed alone is the token for the start of a text; in a sentence it follows a space).
function renderPicked(view, r, what, spaced, onPick) {
  const tok = shown(r.token);
  if (r.text_tokens && r.text_tokens.length > 1) {
    view.picked.replaceChildren(`“${visible(what.text)}” is ${r.text_tokens.length} tokens; this is the first: `,
      ...tokenChips(r.text_tokens, { className: (t, i) => (i === 0 ? "first" : "rest"), breakLines: false }));
  } else {
    view.picked.textContent = r.text_tokens
      ? `“${visible(what.text)}” is one token, “${tok}”, ID ${r.token_id.toLocaleString("en-US")}.`
      : `Token ID ${r.token_id.toLocaleString("en-US")} is “${tok}”.`;
  }
  if (!spaced || spaced.id === r.token_id) return;
  view.picked.append(" After a space, as inside a sentence, it begins with another token: ",
    ...tokenChips([spaced], { onClick: () => { view.wordInput.value = ` ${what.text}`; onPick({ text: ` ${what.text}` }); },
      title: () => `ID ${spaced.id}: click to look it up` }),
    ` (ID ${spaced.id.toLocaleString("en-US")}).`);
}

export function renderLookup(view, { r, what, spaced }, onPick) {
  renderPicked(view, r, what, spaced, onPick);
  view.tokenId.set(r.token_id, r.token_id.toLocaleString("en-US"));
  view.rowNorm.set(r.row_norm, fmtNum(r.row_norm, 4));
  view.topCos.set(r.neighbours.length ? r.neighbours[0].cosine : null, r.neighbours.length ? r.neighbours[0].cosine.toFixed(4) : "–");
  renderDiagram(view, r);
  renderNeighbours(view, r, onPick);
  return renderStrip(view, r);
}

export function mount(root, ctx) {
  const { opts, view } = mountView(root, ctx, OPTIONS, build);
  const job = jobRunner(root, { client: ctx.client, progress: view.progress });
  let current = null;

  // The embedding reply, and for a word not starting with a space its spaced form's first token.
  function lookUp(what) {
    const k = Number(view.kSelect.value);
    if (what.token_id !== undefined) {
      view.idInput.value = String(what.token_id);
      view.wordInput.value = "";
    }
    current = what;
    ctx.setOptions(what.token_id !== undefined ? { token: null, token_id: what.token_id, k } : { token: what.text, token_id: null, k }, OPTIONS);
    return job.run(async (call) => {
      const r = await call({ type: "embedding", ...what, k });
      const spacedToo = r.text_tokens && !/^\s/.test(what.text);
      const spaced = spacedToo ? await call({ type: "tokenize", text: ` ${what.text}` }, null).then((t) => t.tokens[0], () => null) : null;
      return { r, what, spaced };
    }, {
      running: "Computing cosines over the whole table…",
      loading: true,
      onProgress: (p) => `${p.note} …`,
      render: (reply) => {
        if (what.text !== undefined) view.idInput.value = String(reply.r.token_id);
        return renderLookup(view, reply, lookUp);
      },
    });
  }

  view.form.addEventListener("submit", (event) => {
    event.preventDefault();
    const word = view.wordInput.value;
    if (word !== "" && document.activeElement !== view.idInput) lookUp({ text: word });
    else if (view.idInput.value !== "") lookUp({ token_id: Number(view.idInput.value) });
    else if (word !== "") lookUp({ text: word });
  });
  view.wordInput.addEventListener("input", () => { view.idInput.value = ""; });
  view.idInput.addEventListener("input", () => { view.wordInput.value = ""; });
  view.kSelect.addEventListener("change", () => { if (current) lookUp(current); });

  const offStatus = ctx.connected((hello) => {
    view.idInput.max = String(hello.vocab_size - 1);
    return lookUp(opts.token_id !== null && opts.token_id < hello.vocab_size ? { token_id: opts.token_id } : { text: opts.token || DEFAULT_TOKEN });
  });
  return teardown(root, [job.stop, offStatus], [view.strip]);
}

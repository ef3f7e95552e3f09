// Section 3, "Embeddings": pick a token (type a word, or an ID) and see the lookup for what it
// is, indexing: the ID selects one row of the embedding table, and that row is the vector. The
// row is drawn as a strip of its real values; beside it, the rows that point the most the same
// way (cosine over the whole table). Click a neighbour to look it up in turn.

import { el, setState, svg } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtNum, visibleWhitespace as visible } from "../lib/format.js";
import { escapeLabel, plot, purge } from "../lib/chart.js";
import { tokenChips } from "../lib/tokens.js";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { seq: 0, current: null, alive: true, abort: null };

  // ---- controls ----
  const wordInput = el("input", { type: "text", class: "word", "aria-label": "Word", name: "token", spellcheck: "false" });
  wordInput.value = opts.token_id === null ? opts.token : "";
  const idInput = el("input", { type: "number", min: "0", step: "1", "aria-label": "Token ID", name: "token_id" });
  if (opts.token_id !== null) idInput.value = String(opts.token_id);
  const kSelect = el("select", { "aria-label": "Neighbours" }, OPTIONS.k.choices.map((v) => el("option", { value: String(v), text: String(v) })));
  kSelect.value = String(opts.k);
  const form = el("form", { class: "controls" }, [
    el("label", { class: "field" }, [el("span", { class: "field-label", text: "word" }), wordInput]),
    el("label", { class: "field" }, [el("span", { class: "field-label", text: "or ID" }), idInput]),
    el("label", { class: "field" }, [el("span", { class: "field-label", text: "neighbours" }), kSelect]),
    el("button", { type: "submit", class: "primary", text: "Look up" }),
  ]);
  const progress = el("p", { class: "progress", "aria-live": "polite" });
  const picked = el("p", { class: "note picked" });

  // ---- the lookup, the row, the figures ----
  const diagram = el("div", { class: "lookup", "aria-label": "The lookup as indexing" });
  const strip = el("div", { class: "chart strip" });
  const stripNote = el("p", { class: "note strip-note" });
  const tokenId = stat("Token ID", { key: "token_id", note: "= its row number" });
  const rowNorm = stat("Row length", { key: "row_norm", note: "L2 norm of the row" });
  const topCos = stat("Top cosine", { key: "top_cosine", note: "nearest other row" });
  const list = el("ol", { class: "neighbours", "aria-label": "Nearest rows by cosine" });
  const listNote = el("p", { class: "note" });

  root.append(
    form, progress,
    el("div", { class: "grid" }, [
      figure("The lookup: an ID picks a row", ["live"], [picked, diagram, stripNote, strip,
        el("div", { class: "stats" }, [tokenId.node, rowNorm.node, topCos.node])]),
      figure("Rows pointing the same way", ["live"], [listNote, list]),
    ]),
  );

  // The lookup drawn as what it is: the ID points at one row of a tall table, and that row is
  // the vector (the strip below). Row positions are to scale.
  function drawDiagram(r) {
    const W = 400, H = 150, tx = 170, tw = 40, ty = 14, th = 118;
    const y = ty + (r.token_id / (r.num_rows - 1)) * th;
    const label = shown(r.token);
    const rowText = `row ${r.token_id.toLocaleString("en-US")}`;
    const parts = [
      svg("defs", {}, [svg("marker", { id: "emb-arrow", viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 6, markerHeight: 6, orient: "auto-start-reverse" },
        [svg("path", { d: "M0,0 L10,5 L0,10 z", class: "d-head" })])]),
      svg("text", { x: 2, y: 56, class: "d-label", text: "token" }),
      svg("text", { x: 2, y: 78, class: "d-token", text: label.length > 10 ? `${label.slice(0, 9)}…` : label }),
      svg("text", { x: 2, y: 98, class: "d-id", text: `ID ${r.token_id.toLocaleString("en-US")}` }),
      svg("line", { x1: 96, y1: 93, x2: tx - 8, y2: y, class: "d-arrow", "marker-end": "url(#emb-arrow)" }),
      svg("rect", { x: tx, y: ty, width: tw, height: th, class: "d-table" }),
      svg("text", { x: tx + tw / 2 + 4, y: ty + th / 2, "text-anchor": "middle", transform: `rotate(-90 ${tx + tw / 2 + 4} ${ty + th / 2})`, class: "d-small", text: `${r.num_rows.toLocaleString("en-US")} rows` }),
      svg("text", { x: tx + tw / 2, y: ty - 4, "text-anchor": "middle", class: "d-small", text: "row 0" }),
      svg("text", { x: tx + tw / 2, y: ty + th + 13, "text-anchor": "middle", class: "d-small", text: `row ${(r.num_rows - 1).toLocaleString("en-US")}` }),
      svg("rect", { x: tx - 3, y: y - 2, width: tw + 6, height: 4, class: "d-row" }),
      svg("line", { x1: tx + tw + 6, y1: y, x2: 240, y2: 70, class: "d-arrow", "marker-end": "url(#emb-arrow)" }),
      svg("text", { x: 246, y: 62, class: "d-label", text: `${rowText} = the vector` }),
      svg("text", { x: 246, y: 80, class: "d-small", text: `${r.hidden_size} numbers, used as` }),
      svg("text", { x: 246, y: 94, class: "d-small", text: "they are: nothing is" }),
      svg("text", { x: 246, y: 108, class: "d-small", text: "multiplied (drawn below)" }),
    ];
    diagram.replaceChildren(svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `ID ${r.token_id} selects row ${r.token_id} of ${r.num_rows}` }, parts));
  }

  // The row as a heatmap strip, with the nearest neighbour's row under it: similar directions
  // show as similar stripes.
  function drawStrip(r) {
    const rows = [{ label: shown(r.token), values: r.row }];
    if (r.nearest_row) rows.unshift({ label: `${shown(r.neighbours[0])} (nearest)`, values: r.nearest_row });
    return plot(strip, [{
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

  function drawNeighbours(r) {
    list.replaceChildren(...r.neighbours.map((n, i) => {
      const [chip] = tokenChips([n], { onClick: () => lookUp({ token_id: n.id }), title: () => `ID ${n.id} · cosine ${n.cosine.toFixed(4)} · click to look it up` });
      const width = Math.max(0, n.cosine) * 100;   // cosine 1 would fill the bar
      return el("li", { class: "neighbour" }, [
        el("span", { class: "rank muted", text: String(i + 1) }),
        chip,
        el("span", { class: "nid muted", text: `ID ${n.id.toLocaleString("en-US")}` }),
        el("span", { class: "bar" }, [el("span", { class: "fill", style: `width:${width.toFixed(1)}%` })]),
        el("span", { class: "cos", text: n.cosine.toFixed(3) }),
      ]);
    }));
    listNote.textContent = `The ${r.neighbours.length} rows of all ${r.num_rows.toLocaleString("en-US")} with the highest cosine to row ${r.token_id.toLocaleString("en-US")}; the token itself (cosine 1) is left out. Click one to look it up.`;
  }

  // A word typed alone is the token for the start of a text; in a sentence it follows a space,
  // which is part of another token. Offer that one.
  function offerSpaced(text, tokenIdNow, seq) {
    client.call({ type: "tokenize", text: ` ${text}` }).then((t) => {
      const first = t.tokens[0];
      if (seq !== state.seq || !state.alive || !first || first.id === tokenIdNow) return;
      picked.append(" After a space, as inside a sentence, it begins with another token: ",
        ...tokenChips([first], { onClick: () => { wordInput.value = ` ${text}`; lookUp({ text: ` ${text}` }); },
          title: () => `ID ${first.id}: click to look it up` }),
        ` (ID ${first.id.toLocaleString("en-US")}).`);
    }).catch(() => {});
  }

  function render(r) {
    const tok = shown(r.token);
    if (r.text_tokens && r.text_tokens.length > 1) {
      picked.replaceChildren(`“${visible(state.current.text)}” is ${r.text_tokens.length} tokens; this is the first: `,
        ...tokenChips(r.text_tokens, { className: (t, i) => (i === 0 ? "first" : "rest"), breakLines: false }));
    } else {
      picked.textContent = r.text_tokens
        ? `“${visible(state.current.text)}” is one token, “${tok}”, ID ${r.token_id.toLocaleString("en-US")}.`
        : `Token ID ${r.token_id.toLocaleString("en-US")} is “${tok}”.`;
    }
    if (r.text_tokens && !/^\s/.test(state.current.text)) offerSpaced(state.current.text, r.token_id, state.seq);
    tokenId.set(r.token_id, r.token_id.toLocaleString("en-US"));
    rowNorm.set(r.row_norm, fmtNum(r.row_norm, 4));
    topCos.set(r.neighbours.length ? r.neighbours[0].cosine : null, r.neighbours.length ? r.neighbours[0].cosine.toFixed(4) : "–");
    drawDiagram(r);
    stripNote.textContent = `Row ${r.token_id.toLocaleString("en-US")} as a strip: each of its ${r.hidden_size} values is one column, blue above zero and red below${r.nearest_row ? `, with the nearest row, ${shown(r.neighbours[0])}, under it for comparison` : ""}. Hover for a value.`;
    drawNeighbours(r);
    return drawStrip(r);
  }

  // ---- asking the server ----
  function lookUp(what) {
    const k = Number(kSelect.value);
    if (what.token_id !== undefined) {
      idInput.value = String(what.token_id);
      wordInput.value = "";
    }
    state.current = what;
    ctx.setOptions(what.token_id !== undefined ? { token: null, token_id: what.token_id, k } : { token: what.text, token_id: null, k }, OPTIONS);
    const seq = ++state.seq;
    state.abort?.abort();                       // the previous lookup is no longer wanted
    const abort = state.abort = new AbortController();
    setState(root, "loading");
    progress.textContent = "Computing cosines over the whole table…";
    return client.call({ type: "embedding", ...what, k }, {
      onProgress: (p) => { if (seq === state.seq) progress.textContent = `${p.note} …`; },
      signal: abort.signal,
    }).then((r) => {
      if (seq !== state.seq || !state.alive) return null;
      progress.textContent = "";
      if (what.text !== undefined) idInput.value = String(r.token_id);
      return render(r).then(() => setState(root, "ready"));
    }).catch((err) => {
      if (seq !== state.seq || !state.alive) return;
      progress.textContent = "";
      setState(root, "error", err.message);
    });
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const word = wordInput.value;
    if (word !== "" && document.activeElement !== idInput) lookUp({ text: word });
    else if (idInput.value !== "") lookUp({ token_id: Number(idInput.value) });
    else if (word !== "") lookUp({ text: word });
  });
  wordInput.addEventListener("input", () => { idInput.value = ""; });
  idInput.addEventListener("input", () => { wordInput.value = ""; });
  kSelect.addEventListener("change", () => { if (state.current) lookUp(state.current); });

  const offStatus = ctx.connected((hello) => {
    idInput.max = String(hello.vocab_size - 1);
    const first = opts.token_id !== null && opts.token_id < hello.vocab_size ? { token_id: opts.token_id } : { text: opts.token || DEFAULT_TOKEN };
    return lookUp(first);
  });
  return () => {
    state.alive = false;
    state.abort?.abort();
    offStatus();
    purge(strip);
    root.replaceChildren();
  };
}

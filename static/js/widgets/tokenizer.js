// Section 2, "Tokens": any text cut into the model's real tokens, as you type. Each token is a
// chip (the same chips as the chat's template view): whitespace drawn as marks, special tokens
// marked, byte pieces of a character shown as their bytes. Words against tokens are counted.

import { debounce, el, scrollBox } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtNum } from "../lib/format.js";
import { jobRunner } from "../lib/job.js";
import { tokenChips } from "../lib/tokens.js";
import { teardown } from "../lib/lifecycle.js";

const DEFAULT_TEXT = "Tokenizers don't cut at spaces: unbelievably, 1234567 and naïve café 😀 too.\n<|im_start|>user";
const MAX_CHIPS = 3000;   // beyond this the page would crawl; the counts stay exact
const EXAMPLES = [
  ["Chat markup", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"],
  ["Whitespace", "one space, two  spaces,   three\n\ttab and\n\nblank line"],
  ["Emoji and scripts", "👍🏽 🇫🇷 日本語 Привет مرحبا"],
  ["Numbers", "3.14159 1,000,000 2026-11-30 0xFF"],
];

// Options from the URL (docs/widgets.md).
const OPTIONS = {
  text: { type: "string", default: DEFAULT_TEXT, maxLength: 4000 },
};

const HINT = "Click a token for its ID and bytes.";

// The widget's elements; onExample(text) puts an example into the box.
function build(text, onExample) {
  const input = el("textarea", { class: "text-input", rows: 3, "aria-label": "Text to tokenize", name: "text", spellcheck: "false" });
  input.value = text;
  const view = {
    input,
    examples: el("div", { class: "examples" }, [
      el("span", { class: "muted", text: "Try:" }),
      ...EXAMPLES.map(([label, example]) => el("button", { type: "button", text: label, onclick: () => onExample(example) })),
    ]),
    numTokens: stat("Tokens", { key: "num_tokens", note: "what the model counts" }),
    numWords: stat("Words", { key: "num_words", note: "runs between whitespace" }),
    numChars: stat("Characters", { key: "num_chars", note: "Unicode code points" }),
    ratio: el("p", { class: "note ratio" }),
    chips: scrollBox(el("div", { class: "tokens" }), "Tokens"),
    detail: el("p", { class: "note detail", text: HINT, "aria-live": "polite" }),
    specialNote: el("p", { class: "note special-note", hidden: true }),
    idList: el("code", { class: "id-list" }),
    idSummary: el("summary", { text: "The IDs the model receives" }),
  };
  const legend = el("div", { class: "legend" }, [
    el("span", { class: "tok tok-content", text: "text token" }),
    el("span", { class: "tok tok-special", text: "special token" }),
    el("span", { class: "tok tok-content tok-bytes", text: "F0 9F byte piece" }),
    el("span", { class: "muted", text: "· space  ↵ line break  → tab" }),
  ]);
  view.node = figure("Your text, as the model receives it", ["live"], [
    input, view.examples,
    el("div", { class: "stats" }, [view.numTokens.node, view.numWords.node, view.numChars.node]),
    view.ratio, legend, view.chips, view.detail, view.specialNote,
    el("details", { class: "ids" }, [view.idSummary, view.idList]),
  ]);
  return view;
}

// One token in words: its position, ID, and text or bytes.
function describe(tok, i) {
  const parts = [`Token #${i}`, `ID ${tok.id.toLocaleString("en-US")}`];
  if (tok.special) parts.push(`special token ${tok.text}: the tokenizer matched the whole string before cutting anything else`);
  else if (tok.bytes) parts.push(`bytes ${tok.bytes.toUpperCase()}, part of a character${tok.text ? ` (completes “${tok.text}”)` : " (completed by a later token)"}`);
  else parts.push(`“${tok.text}”`, `bytes ${Array.from(new TextEncoder().encode(tok.text), (b) => b.toString(16).toUpperCase().padStart(2, "0")).join(" ")}`);
  return parts.join(" · ");
}

// The chips (at most MAX_CHIPS) and the list of IDs.
function renderChips(view, reply) {
  const { chips, detail } = view;
  const shown = reply.tokens.slice(0, MAX_CHIPS);
  const nodes = tokenChips(shown, {
    title: (tok, i) => describe(tok, i),
    onClick: (tok, i) => {
      chips.querySelector(".selected")?.classList.remove("selected");
      chips.querySelector(`[data-index="${i}"]`)?.classList.add("selected");
      detail.textContent = describe(tok, i);
    },
  });
  if (reply.tokens.length > shown.length) {
    nodes.push(el("span", { class: "more muted", text: ` … and ${(reply.tokens.length - shown.length).toLocaleString("en-US")} more tokens (counted above, not drawn)` }));
  }
  chips.replaceChildren(...nodes);
  view.idSummary.textContent = `The ${reply.num_tokens.toLocaleString("en-US")} IDs the model receives`;
  view.idList.textContent = `[${shown.map((t) => t.id).join(", ")}${reply.tokens.length > MAX_CHIPS ? ", …" : ""}]`;
  detail.textContent = HINT;
}

// "1 token", "2.38 tokens": a ratio and its unit.
function rate(value, unit) {
  return `${fmtNum(value, 3)} ${unit}${value === 1 ? "" : "s"}`;
}

// The counts, the ratio line and the note on special tokens typed in.
function renderCounts(view, reply) {
  view.numTokens.set(reply.num_tokens, fmtNum(reply.num_tokens));
  view.numWords.set(reply.num_words, fmtNum(reply.num_words));
  view.numChars.set(reply.num_chars, fmtNum(reply.num_chars));
  view.ratio.textContent = reply.num_words
    ? `${rate(reply.num_tokens / reply.num_words, "token")} per word, ${rate(reply.num_chars / reply.num_tokens, "character")} per token, from a vocabulary of ${reply.vocab_size.toLocaleString("en-US")} pieces.`
    : `${fmtNum(reply.num_tokens)} tokens and no words: only whitespace.`;
  const specials = [...new Set(reply.tokens.filter((t) => t.special).map((t) => t.text))];
  view.specialNote.hidden = specials.length === 0;
  view.specialNote.textContent = specials.length
    ? `You typed ${specials.join(", ")}: this tokenizer turns such a string into the special token itself, one ID, not its characters. It does so wherever the text comes from, a message in a chat included, so typed markup reads to the model exactly like the chat template's own.`
    : "";
}

export function renderTokens(view, reply) {
  renderChips(view, reply);
  renderCounts(view, reply);
}

// An empty box: nothing to ask the server.
function renderEmpty(view) {
  view.chips.replaceChildren();
  view.idList.textContent = "[]";
  for (const s of [view.numTokens, view.numWords, view.numChars]) s.set(0);
  view.ratio.textContent = "Type something.";
  view.specialNote.hidden = true;
}

export function mount(root, ctx) {
  const opts = ctx.readOptions(OPTIONS).values;
  let maxBytes = 65536;
  const view = build(opts.text, (text) => { view.input.value = text; changed(); });
  root.append(view.node);
  const job = jobRunner(root, { client: ctx.client });

  function tokenize() {
    const text = view.input.value;
    ctx.setOptions({ text }, OPTIONS);
    if (new TextEncoder().encode(text).length > maxBytes - 256) {
      view.ratio.textContent = `This text is over the ${maxBytes.toLocaleString("en-US")} bytes one message may carry; shorten it.`;
      return job.run(async () => null, { render: () => {} });
    }
    if (!text) return job.run(async () => null, { render: () => renderEmpty(view) });
    return job.run({ type: "tokenize", text }, { render: (reply) => renderTokens(view, reply) });
  }

  const changed = debounce(tokenize, 150);
  view.input.addEventListener("input", changed);
  const offStatus = ctx.connected((hello) => {
    maxBytes = hello.limits.max_message_bytes;
    return tokenize();
  });
  return teardown(root, [job.stop, changed.cancel, offStatus]);
}

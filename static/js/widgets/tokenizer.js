// Section 2, "Tokens": any text cut into the model's real tokens, as you type. Each token is a
// chip (the same chips as the chat's template view): whitespace drawn as marks, special tokens
// marked, byte pieces of a character shown as their bytes. Words against tokens are counted.

import { debounce, el, setState } from "../lib/dom.js";
import { figure, stat } from "../lib/figures.js";
import { fmtNum } from "../lib/format.js";
import { tokenChips } from "../lib/tokens.js";

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

export function mount(root, ctx) {
  const client = ctx.client;
  const opts = ctx.readOptions(OPTIONS).values;
  const state = { seq: 0, maxBytes: 65536, alive: true };

  const input = el("textarea", { class: "text-input", rows: 3, "aria-label": "Text to tokenize", name: "text", spellcheck: "false" });
  input.value = opts.text;
  const examples = el("div", { class: "examples" }, [
    el("span", { class: "muted", text: "Try:" }),
    ...EXAMPLES.map(([label, text]) => el("button", { type: "button", text: label, onclick: () => { input.value = text; changed(); } })),
  ]);

  const numTokens = stat("Tokens", { key: "num_tokens", note: "what the model counts" });
  const numWords = stat("Words", { key: "num_words", note: "runs between whitespace" });
  const numChars = stat("Characters", { key: "num_chars", note: "Unicode code points" });
  const ratio = el("p", { class: "note ratio" });

  const legend = el("div", { class: "legend" }, [
    el("span", { class: "tok tok-content", text: "text token" }),
    el("span", { class: "tok tok-special", text: "special token" }),
    el("span", { class: "tok tok-content tok-bytes", text: "F0 9F byte piece" }),
    el("span", { class: "muted", text: "· space  ↵ line break  → tab" }),
  ]);
  const chips = el("div", { class: "tokens", "aria-label": "Tokens" });
  const detail = el("p", { class: "note detail", text: "Click a token for its ID and bytes." });
  const specialNote = el("p", { class: "note special-note", hidden: true });
  const idList = el("code", { class: "id-list" });
  const idSummary = el("summary", { text: "The IDs the model receives" });
  const ids = el("details", { class: "ids" }, [idSummary, idList]);

  root.append(
    figure("Your text, as the model receives it", ["live"], [
      input, examples,
      el("div", { class: "stats" }, [numTokens.node, numWords.node, numChars.node]),
      ratio, legend, chips, detail, specialNote, ids,
    ]),
  );

  function describe(tok, i) {
    const parts = [`Token #${i}`, `ID ${tok.id.toLocaleString("en-US")}`];
    if (tok.special) parts.push(`special token ${tok.text}: the tokenizer matched the whole string before cutting anything else`);
    else if (tok.bytes) parts.push(`bytes ${tok.bytes.toUpperCase()}, part of a character${tok.text ? ` (completes “${tok.text}”)` : " (completed by a later token)"}`);
    else parts.push(`“${tok.text}”`, `bytes ${Array.from(new TextEncoder().encode(tok.text), (b) => b.toString(16).toUpperCase().padStart(2, "0")).join(" ")}`);
    return parts.join(" · ");
  }

  function render(reply) {
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
    idSummary.textContent = `The ${reply.num_tokens.toLocaleString("en-US")} IDs the model receives`;
    idList.textContent = `[${reply.tokens.slice(0, MAX_CHIPS).map((t) => t.id).join(", ")}${reply.tokens.length > MAX_CHIPS ? ", …" : ""}]`;
    detail.textContent = "Click a token for its ID and bytes.";
    numTokens.set(reply.num_tokens, fmtNum(reply.num_tokens));
    numWords.set(reply.num_words, fmtNum(reply.num_words));
    numChars.set(reply.num_chars, fmtNum(reply.num_chars));
    ratio.textContent = reply.num_words
      ? `${fmtNum(reply.num_tokens / reply.num_words, 3)} tokens per word, ${fmtNum(reply.num_chars / reply.num_tokens, 3)} characters per token, from a vocabulary of ${reply.vocab_size.toLocaleString("en-US")} pieces.`
      : `${fmtNum(reply.num_tokens)} tokens and no words: only whitespace.`;
    const specials = [...new Set(reply.tokens.filter((t) => t.special).map((t) => t.text))];
    specialNote.hidden = specials.length === 0;
    specialNote.textContent = specials.length
      ? `You typed ${specials.join(", ")}: this tokenizer turns such a string into the special token itself, one ID, not its characters. It does so wherever the text comes from, a message in a chat included, so typed markup reads to the model exactly like the chat template's own.`
      : "";
  }

  function tokenize() {
    const text = input.value;
    ctx.setOptions({ text }, OPTIONS);
    if (!text) {
      chips.replaceChildren();
      idList.textContent = "[]";
      for (const s of [numTokens, numWords, numChars]) s.set(0);
      ratio.textContent = "Type something.";
      specialNote.hidden = true;
      return Promise.resolve();
    }
    if (new TextEncoder().encode(text).length > state.maxBytes - 256) {
      ratio.textContent = `This text is over the ${state.maxBytes.toLocaleString("en-US")} bytes one message may carry; shorten it.`;
      return Promise.resolve();
    }
    const seq = ++state.seq;
    return client.call({ type: "tokenize", text }).then((reply) => {
      if (seq === state.seq && state.alive) render(reply);
    });
  }

  const changed = debounce(() => tokenize().then(() => setState(root, "ready")).catch((err) => setState(root, "error", err.message)), 150);
  input.addEventListener("input", changed);

  const offStatus = ctx.connected((hello) => {
    state.maxBytes = hello.limits.max_message_bytes;
    return tokenize().then(() => setState(root, "ready"));
  });
  return () => {
    state.alive = false;
    changed.cancel();
    offStatus();
    root.replaceChildren();
  };
}

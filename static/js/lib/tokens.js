// Token chips: one inline box per token, whitespace made visible, special tokens marked.
// Used by the tokenizer widget and by the chat's view of the chat template.

import { el } from "./dom.js";
import { visibleWhitespace } from "./format.js";

// tokens: [{ id, text, special?, kind?, bytes? }]; a token with `bytes` (hex, from the tokenizer
// widget) is not whole characters on its own: its chip shows those bytes, marked as a byte piece,
// and the character it completes, if any.
// options.className(tok, i) adds classes,
// options.title(tok, i) sets the tooltip, options.onClick(tok, i) makes chips buttons.
export function tokenChips(tokens, options = {}) {
  const nodes = [];
  tokens.forEach((tok, i) => {
    const kind = tok.kind || (tok.special ? "special" : "content");
    const text = kind === "special" ? tok.text : tok.bytes ? tok.bytes.toUpperCase() : visibleWhitespace(tok.text);
    const extra = `${tok.bytes ? " tok-bytes" : ""}${options.className ? ` ${options.className(tok, i)}` : ""}`.trimEnd();
    const chip = el(options.onClick ? "button" : "span", {
      class: `tok tok-${kind}${extra}`,
      type: options.onClick ? "button" : undefined,
      title: options.title ? options.title(tok, i) : `#${i} · id ${tok.id}${kind === "special" ? " · special" : ""}`,
      "data-index": String(i),
      "data-id": String(tok.id),
      text: text || "∅",
    });
    // a byte piece that completes a character also shows that character, after its bytes
    if (tok.bytes && kind !== "special" && tok.text.trim()) chip.append(el("span", { class: "tok-completes", text: visibleWhitespace(tok.text) }));
    if (options.onClick) chip.addEventListener("click", () => options.onClick(tok, i));
    nodes.push(chip);
    if (options.breakLines !== false && tok.text.includes("\n")) nodes.push(el("br"));
  });
  return nodes;
}

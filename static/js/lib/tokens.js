// Token chips: one inline box per token, whitespace made visible, special tokens marked.
// Used by the tokenizer widget and by the chat's view of the chat template.

import { el } from "./dom.js";
import { visibleWhitespace } from "./format.js";

// tokens: [{ id, text, special?, kind? }]; options.className(tok, i) adds classes,
// options.title(tok, i) sets the tooltip, options.onClick(tok, i) makes chips buttons.
export function tokenChips(tokens, options = {}) {
  const nodes = [];
  tokens.forEach((tok, i) => {
    const kind = tok.kind || (tok.special ? "special" : "content");
    const text = kind === "special" ? tok.text : visibleWhitespace(tok.text);
    const extra = options.className ? options.className(tok, i) : "";
    const chip = el(options.onClick ? "button" : "span", {
      class: `tok tok-${kind}${extra ? ` ${extra}` : ""}`,
      type: options.onClick ? "button" : undefined,
      title: options.title ? options.title(tok, i) : `#${i} · id ${tok.id}${kind === "special" ? " · special" : ""}`,
      "data-index": String(i),
      text: text || "∅",
    });
    if (options.onClick) chip.addEventListener("click", () => options.onClick(tok, i));
    nodes.push(chip);
    if (options.breakLines !== false && tok.text.includes("\n")) nodes.push(el("br"));
  });
  return nodes;
}

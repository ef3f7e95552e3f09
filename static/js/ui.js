// Small DOM helpers shared by the widgets. Text always goes in with textContent, never innerHTML.

export function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of [].concat(children)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";
export function svg(tag, attrs = {}, children = []) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of [].concat(children)) if (child) node.append(child);
  return node;
}

let badgeTable = null;
function badges() {
  if (!badgeTable) {
    const script = document.getElementById("sendlens-badges");
    badgeTable = script ? JSON.parse(script.textContent) : {};
  }
  return badgeTable;
}

// A source badge: "live", "measured", "computed" or "simulated" (the table comes from the server).
export function badge(key) {
  const [label, meaning] = badges()[key] || [key, ""];
  return el("span", { class: `badge badge-${key}`, title: meaning, text: label });
}

// A figure with a heading and its source badges.
export function figure(title, badgeKeys, body = []) {
  return el("figure", { class: "figure" }, [
    el("figcaption", { class: "figure-head" }, [
      el("h3", { text: title }),
      el("span", { class: "badges" }, badgeKeys.map(badge)),
    ]),
    ...[].concat(body),
  ]);
}

export function fmtMs(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (value >= 10000) return `${(value / 1000).toFixed(1)} s`;
  if (value >= 100) return `${Math.round(value)} ms`;
  return `${value.toFixed(1)} ms`;
}

// Show whitespace in a token: spaces as ·, newlines as ↵, tabs as →.
export function visibleWhitespace(text) {
  return text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "→");
}

export function setState(root, state, message) {
  root.dataset.state = state;
  let box = root.querySelector(":scope > .widget-error");
  if (state === "error") {
    if (!box) {
      box = el("p", { class: "widget-error", role: "alert" });
      root.prepend(box);
    }
    box.textContent = message || "Something went wrong.";
  } else if (box) {
    box.remove();
  }
}

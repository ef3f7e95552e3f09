// DOM helpers shared by the widgets. Text always goes in with textContent, never innerHTML.

export function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    // styles through the CSSOM: the content security policy refuses style="" attributes
    else if (key === "style") Object.assign(node.style, typeof value === "string" ? parseStyle(value) : value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of [].concat(children)) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function parseStyle(text) {
  const out = {};
  for (const part of text.split(";")) {
    const [name, ...rest] = part.split(":");
    if (name.trim()) out[name.trim().replace(/-([a-z])/g, (_, c) => c.toUpperCase())] = rest.join(":").trim();
  }
  return out;
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

// data-state on a widget's root: "loading", "ready" (shows data from the backend) or "error"
// (with a visible message). Browser tests wait on it.
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

// A labelled control: <label>label <input|select></label>.
export function field(label, control, note) {
  return el("label", { class: "field" }, [el("span", { class: "field-label", text: label }), control,
    note ? el("span", { class: "field-note", text: note }) : null]);
}

export function select(options, value, attrs = {}) {
  const node = el("select", attrs, options.map(([v, t]) => el("option", { value: String(v), text: t })));
  node.value = String(value);
  return node;
}

// Run fn at most once per `ms`, with the last arguments (for inputs that fire on every key).
export function debounce(fn, ms = 250) {
  let timer = null;
  const wrapped = (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
  wrapped.cancel = () => clearTimeout(timer);
  return wrapped;
}

// Turn a control off while its action runs without losing the keyboard's place. A focused button
// that is disabled drops the focus to <body>: it goes to `fallback` at once when one is given (the
// Stop button beside a Send button), else back to the control when it is enabled again (unless the
// reader has moved on meanwhile).
const lostFocus = new WeakSet();
export function setDisabled(control, disabled, fallback = null) {
  const focused = document.activeElement === control;
  control.disabled = disabled;
  if (disabled && focused) {
    if (fallback && !fallback.disabled) fallback.focus();
    else lostFocus.add(control);
  } else if (!disabled && lostFocus.has(control)) {
    lostFocus.delete(control);
    const now = document.activeElement;
    if (!now || now === document.body) control.focus();
  }
}

// A chart for a screen reader: an image with a label, summed up in words by a text node on the
// page (its note), which the chart points to with aria-describedby.
let summaries = 0;
export function describeChart(node, label, summary = null) {
  node.setAttribute("role", "img");
  node.setAttribute("aria-label", label);
  if (summary) {
    if (!summary.id) summary.id = `sendlens-summary-${++summaries}`;
    node.setAttribute("aria-describedby", summary.id);
  }
  return node;
}

// A box that scrolls: the keyboard can reach it (and scroll it with the arrows), and it is named.
export function scrollBox(node, label) {
  node.tabIndex = 0;
  node.setAttribute("aria-label", label);
  return node;
}

// Let Enter and Space act on an element that is not a button (a chip, a cell): it gets a tab stop
// and the role of a button.
export function pressable(node, onPress, label = null) {
  node.tabIndex = 0;
  node.setAttribute("role", "button");
  if (label) node.setAttribute("aria-label", label);
  node.addEventListener("click", onPress);
  node.addEventListener("keydown", (event) => {
    if (event.key !== "Enter" && event.key !== " ") return;
    event.preventDefault();
    onPress(event);
  });
  return node;
}

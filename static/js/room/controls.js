// The teacher's controls on the presenter view: pause and resume, the scheduler (continuous or
// static batching), batch slots, max tokens, one request at a time, prefix caching, chunked
// prefill, one prompt sent by everyone at once, and clearing the room. Each control carries
// data-control (the contract's names); a change calls onAction(action, fields), which the
// presenter sends as a room_control message. showSettings() puts the room's settings (as the
// server last said) back into the controls, except the one the teacher is editing.

import { el, field, select } from "../lib/dom.js";

const TOGGLES = [
  ["one_at_a_time", "one request at a time per student"],
  ["prefix_caching", "prefix caching"],
  ["chunked_prefill", "chunked prefill"],
];

function build() {
  const c = {
    pause: el("button", { type: "button", class: "primary", "data-control": "pause", text: "Pause sending" }),
    scheduling: select([["continuous", "continuous batching"], ["static", "static batching"]], "continuous",
      { "data-control": "scheduling", name: "scheduling" }),
    max_num_seqs: el("input", { type: "number", min: 1, step: 1, "data-control": "max_num_seqs", name: "max_num_seqs" }),
    max_tokens: el("input", { type: "number", min: 1, step: 1, "data-control": "max_tokens", name: "max_tokens" }),
    prompt: el("input", { type: "text", class: "text-input", name: "send_all_prompt", "aria-label": "The prompt everyone sends",
      value: "Name three rivers in Europe." }),
    send_all: el("button", { type: "button", "data-control": "send_all", text: "Everyone: send now" }),
    clear: el("button", { type: "button", class: "danger", "data-control": "clear", text: "Clear the room" }),
    status: el("p", { class: "room-control-status", role: "status", "aria-live": "polite" }),
  };
  for (const [key, label] of TOGGLES) {
    c[key] = el("input", { type: "checkbox", "data-control": key, name: key });
    c[`${key}Label`] = el("label", { class: "field room-toggle" }, [c[key], el("span", { class: "field-label", text: label })]);
  }
  c.node = el("section", { class: "room-controls", "aria-label": "Teacher controls" }, [
    el("div", { class: "controls" }, [c.pause, field("scheduler", c.scheduling), field("batch slots", c.max_num_seqs),
      field("max tokens", c.max_tokens), ...TOGGLES.map(([key]) => c[`${key}Label`])]),
    el("div", { class: "controls room-send-all" }, [c.prompt, c.send_all, c.clear]),
    c.status,
  ]);
  return c;
}

// The settings a control changes: { name: value }, read from the control itself.
function settingOf(c, key) {
  if (key === "scheduling") return { scheduling: c.scheduling.value };
  if (TOGGLES.some(([k]) => k === key)) return { [key]: c[key].checked };
  const n = Number(c[key].value);
  return { [key]: Number.isInteger(n) ? n : c[key].value };
}

function wire(c, onAction, getSettings) {
  c.pause.addEventListener("click", () => onAction(getSettings()?.paused ? "resume" : "pause", {}));
  for (const key of ["scheduling", "max_num_seqs", "max_tokens", ...TOGGLES.map(([k]) => k)]) {
    c[key].addEventListener("change", () => onAction("settings", { settings: settingOf(c, key) }));
  }
  c.send_all.addEventListener("click", () => {
    const prompt = c.prompt.value.trim();
    if (prompt) onAction("send_all", { prompt });
    else c.status.textContent = "Type the prompt everyone sends first.";
  });
  c.clear.addEventListener("click", () => onAction("clear", {}));
}

// The controls' view and its three verbs. onAction(action, fields) -> a promise.
export function controls(onAction) {
  let settings = null;
  const c = build();
  wire(c, (action, fields) => {
    c.status.textContent = `Sending: ${action}…`;
    return onAction(action, fields)
      .then(() => { c.status.textContent = `Done: ${action}.`; })
      .catch((err) => { c.status.textContent = `Refused: ${err.message}`; });
  }, () => settings);
  return {
    node: c.node,
    controls: c,
    showSettings(s) {
      settings = s;
      if (!s) return;
      c.pause.textContent = s.paused ? "Resume sending" : "Pause sending";
      c.pause.setAttribute("aria-pressed", s.paused ? "true" : "false");
      const active = document.activeElement;
      if (active !== c.scheduling) c.scheduling.value = s.scheduling;
      for (const key of ["max_num_seqs", "max_tokens"]) if (active !== c[key]) c[key].value = String(s[key]);
      for (const [key] of TOGGLES) c[key].checked = Boolean(s[key]);
    },
    setEnabled(on) {
      for (const node of c.node.querySelectorAll("button, input, select")) node.disabled = !on;
    },
  };
}

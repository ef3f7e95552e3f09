// Figures and their badges. Every badged number on screen is an element with
// data-figure="<key>" and its raw value in data-value (the text may round it): tests read those.

import { el } from "./dom.js";

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

// A stat tile: label, value, note. With a key, the value is a figure a test can read.
// Returns { node, set(value, text) } — text defaults to the value as given.
export function stat(label, { key = null, note = null, badge: badgeKey = null } = {}) {
  const value = el("span", { class: "stat-value", text: "–" });
  if (key) value.dataset.figure = key;
  const node = el("div", { class: "stat" }, [
    el("span", { class: "stat-label" }, [label, badgeKey ? " " : null, badgeKey ? badge(badgeKey) : null]),
    value,
    note ? el("span", { class: "stat-note", text: note }) : null,
  ]);
  return {
    node,
    set(raw, text) {
      value.textContent = text ?? (raw === null || raw === undefined ? "–" : String(raw));
      if (key) {
        if (raw === null || raw === undefined) delete value.dataset.value;
        else value.dataset.value = String(raw);
      }
    },
  };
}

export function stats(tiles) {
  return el("div", { class: "stats" }, tiles.map((t) => t.node));
}

// A widget's empty view from a table in reading order, { name: entry }: an entry [label, figure
// key or null, note or null, badge] (badge may be left off) is a stat tile, "tag.class.class" an
// empty element for the widget's render functions to fill.
export function view(table) {
  return Object.fromEntries(Object.entries(table).map(([name, entry]) => {
    if (Array.isArray(entry)) return [name, stat(entry[0], { key: entry[1], note: entry[2], badge: entry[3] ?? null })];
    const [tag, ...classes] = entry.split(".");
    return [name, el(tag, { class: classes.join(" ") || null })];
  }));
}

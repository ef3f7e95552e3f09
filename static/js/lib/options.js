// A widget's options come from the URL: /embed/<name>?text=...&layer=3 in an embed, or
// /?<name>.text=...&<name>.layer=3 on the walkthrough. spec: { key: { type, default, min, max, choices } }.
// A value that does not fit the spec falls back to the default (and is reported in `invalid`).

export function readOptions(raw, spec) {
  const values = {}, invalid = [];
  for (const [key, s] of Object.entries(spec)) {
    const text = raw[key];
    let value = s.default;
    if (text !== undefined && text !== "") {
      const parsed = parse(text, s);
      if (parsed === undefined) invalid.push(key);
      else value = parsed;
    }
    values[key] = value;
  }
  return { values, invalid };
}

function parse(text, s) {
  if (s.choices && s.type !== "int") return s.choices.map(String).includes(text) ? text : undefined;
  if (s.type === "int") {
    if (s.choices && s.choices.map(String).includes(text)) return Number.isNaN(Number(text)) ? text : Number(text);
    if (!/^-?\d+$/.test(text)) return undefined;
    const n = Number(text);
    return (s.min !== undefined && n < s.min) || (s.max !== undefined && n > s.max) ? undefined : n;
  }
  if (s.type === "number") {
    const n = Number(text);
    if (!Number.isFinite(n)) return undefined;
    return (s.min !== undefined && n < s.min) || (s.max !== undefined && n > s.max) ? undefined : n;
  }
  if (s.type === "bool") return text === "1" || text === "true" ? true : text === "0" || text === "false" ? false : undefined;
  return text.slice(0, s.maxLength ?? 4000);
}

// The query string for the options that differ from their defaults (for the embed snippet).
export function toQuery(values, spec) {
  const params = new URLSearchParams();
  for (const [key, s] of Object.entries(spec)) {
    const v = values[key];
    if (v !== undefined && v !== null && v !== s.default) params.set(key, typeof v === "boolean" ? (v ? "1" : "0") : String(v));
  }
  return params.toString();
}

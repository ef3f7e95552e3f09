// Formatting numbers and token text for display. The raw numbers stay in data-value.

export function fmtMs(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (value >= 10000) return `${(value / 1000).toFixed(1)} s`;
  if (value >= 100) return `${Math.round(value)} ms`;
  return `${value.toFixed(1)} ms`;
}

// A number with at most `digits` significant digits and thousands separators.
export function fmtNum(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (Number.isInteger(value)) return value.toLocaleString("en-US");
  const abs = Math.abs(value);
  if (abs >= 1000) return Math.round(value).toLocaleString("en-US");
  if (abs === 0) return "0";
  return Number(value.toPrecision(digits)).toLocaleString("en-US", { maximumSignificantDigits: digits });
}

export function fmtPct(fraction, digits = 1) {
  if (fraction === null || fraction === undefined || Number.isNaN(fraction)) return "–";
  return `${(100 * fraction).toFixed(digits)}%`;
}

export function fmtBytes(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(bytes)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0, v = bytes;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return `${i ? v.toPrecision(3) : v} ${units[i]}`;
}

// Show whitespace in a token: spaces as ·, newlines as ↵, tabs as →.
export function visibleWhitespace(text) {
  return text.replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "→");
}

// The engine's weight formats (core/model/linear.py), in words for the prose beside a measurement.
export const WEIGHT_FORMATS = {
  fp32: "the linear layers in fp32, 4 bytes a weight",
  bf16: "the linear layers in bf16, 2 bytes a weight",
  q8_0: "the linear layers in 8-bit q8_0, a byte a weight and an fp16 scale per 32",
  q4_1: "the linear layers in 4-bit q4_1, the model file's own format: about 0.6 bytes a weight with its scales",
};

// How the products round their activations on this machine (core/model/linear.py:
// ActivationRounding), as the engine reports it; fp32's "none" and bf16's own rounding go unsaid.
export const ACTIVATION_ROUNDINGS = {
  int8: "the activations rounded to 8-bit integers per 32 as llama.cpp does",
  int16: "the activations rounded to 16-bit integers per 32",
  bf16: "the activations rounded to bf16",
  mixed: "the activations rounded in more than one way, layer by layer",
};

// attention: how attention rounds its operands (the engine's `attention_operands`): "bf16" for
// q4_1 on the engine's own kernels, said beside the activations; "fp32" goes unsaid.
export function activationRounding(format, rounding, attention) {
  const how = format === "fp32" || format === "bf16" ? "" : ACTIVATION_ROUNDINGS[rounding] || "";
  const att = attention === "bf16" ? "attention's query, keys, values and softmax weights rounded to bf16" : "";
  return [how, att].filter(Boolean).join(", ");
}

// A weight format in words, with how its products round the activations where the engine said so.
export function weightFormat(name, rounding, attention) {
  const base = WEIGHT_FORMATS[name] || `the weights in ${name}`;
  const how = activationRounding(name, rounding, attention);
  return how ? `${base}, ${how}` : base;
}

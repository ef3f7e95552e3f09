// The page's colours for what CSS cannot reach (plotly.js layouts): read from the custom
// properties of static/css/sendlens.css, so charts follow prefers-color-scheme like the rest.
// lib/chart.js can build its layout from chartColors() and redraw on onSchemeChange().

const DARK = window.matchMedia("(prefers-color-scheme: dark)");

// A custom property of the root, e.g. cssColor("--ink") -> "#1d1f23".
export function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// The colours a chart needs: text, muted text, grid lines, panel, and the phase hues.
export function chartColors() {
  return {
    ink: cssColor("--ink"),
    muted: cssColor("--muted"),
    grid: cssColor("--line"),
    zero: cssColor("--line-strong"),
    panel: cssColor("--panel"),
    accent: cssColor("--accent"),
    prefill: cssColor("--prefill"),
    decode: cssColor("--decode"),
    dark: DARK.matches,
  };
}

// Call f(chartColors()) whenever the reader's scheme changes; returns the function that stops it.
export function onSchemeChange(f) {
  const listener = () => f(chartColors());
  DARK.addEventListener("change", listener);
  return () => DARK.removeEventListener("change", listener);
}

// True when the reader asked for less motion: no animated transitions in charts.
export function reducedMotion() {
  return window.matchMedia("(prefers-reduced-motion: reduce)").matches;
}

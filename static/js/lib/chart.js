// The one way widgets draw charts: plotly.js, served by this server from the installed `plotly`
// package (no CDN), loaded once and only when a widget on the page first asks for it.

let loading = null;

export function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  if (!loading) {
    loading = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      // relative to this module (/static/js/lib/ -> /vendor/), so a static export serves it too
      script.src = new URL("../../../vendor/plotly.min.js", import.meta.url).href;
      script.async = true;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => { loading = null; reject(new Error("plotly.js failed to load from this server")); };
      document.head.append(script);
    });
  }
  return loading;
}

// plotly renders a little HTML in labels (<br>, <b>, <a href>); model text must never be markup.
export function escapeLabel(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

const BASE_LAYOUT = {
  margin: { l: 48, r: 12, t: 8, b: 40 },
  paper_bgcolor: "rgba(0,0,0,0)",
  plot_bgcolor: "rgba(0,0,0,0)",
  font: { family: "system-ui, -apple-system, Segoe UI, Roboto, DejaVu Sans, sans-serif", size: 11, color: "#1d1f23" },
  showlegend: false,
};

// Draw (or redraw) a chart into node; returns the Plotly object for later updates.
export async function plot(node, data, layout = {}, config = {}) {
  const Plotly = await loadPlotly();
  await Plotly.react(node, data, { ...BASE_LAYOUT, ...layout, margin: { ...BASE_LAYOUT.margin, ...(layout.margin || {}) } },
    { displayModeBar: false, responsive: true, ...config });
  return Plotly;
}

export function purge(node) {
  if (window.Plotly && node) window.Plotly.purge(node);
}

// The two ends of a widget's life that every widget does alike. The start: read the widget's
// options from the URL, build its view from them and put it in the root. The end (the function
// mount returns, which main.js calls when the widget goes away): stop what it started (timers,
// jobs, the ctx.connected subscription, listeners), free its plotly charts, empty its root.
//
//   const { opts, view } = mountView(root, ctx, OPTIONS, build);
//   ...
//   return teardown(root, [onText.cancel, job.stop, offStatus], [view.chart]);

import { purge } from "./chart.js";

// root: the widget's root; stops: functions called in order; charts: plotly nodes to purge.
export function teardown(root, stops, charts = []) {
  return () => {
    stops.forEach((stop) => stop());
    charts.forEach(purge);
    root.replaceChildren();
  };
}

// options: the widget's URL option specs (docs/widgets.md); build(opts) returns the view, whose
// `nodes` go into root. Returns { opts, view }.
export function mountView(root, ctx, options, build) {
  const opts = ctx.readOptions(options).values;
  const view = build(opts);
  root.append(...view.nodes);
  return { opts, view };
}

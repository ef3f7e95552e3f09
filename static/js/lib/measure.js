// The lifecycle every measuring widget shares: one job runner, a run counter that "Measure again"
// raises (the server caches a job by its fields, so a new `run` measures anew), inputs that
// measure again when changed or typed into, a first run once connected and another after a lost
// connection comes back (ctx.connected), and one function that takes it all down. Beside it, the
// small pieces these widgets all show: a number input, a share bar, when and where it was measured.
//
//   const job = jobRunner(root, { client: ctx.client, progress, button });
//   const life = measuring(root, ctx, { job, button, measure: (run) => job.run({ ..., run }, {...}) });
//   return life.unmount;

import { debounce, el, setState } from "./dom.js";
import { jobRunner } from "./job.js";
import { teardown } from "./lifecycle.js";

// view(table) lives with the stat tiles it builds; the measuring widgets take it from here.
export { view } from "./figures.js";

// root, ctx: the widget's; job: its jobRunner (lib/job.js); button: "Measure again" (null: none);
// measure(run): start a run, returns its promise;
// changed: inputs that measure again on "change"; typed: on "input", after `delay` ms;
// onHello(hello): before each first run (to fit the controls to the model); charts: plotly nodes
// to purge; cleanups: more functions to call on unmount.
export function measuring(root, ctx, { job, button = null, measure, changed = [], typed = [],
  delay = 700, onHello = null, charts = [], cleanups = [] }) {
  let run = 0;
  const go = () => measure(run);
  const later = debounce(go, delay);
  for (const input of changed) input.addEventListener("change", go);
  for (const input of typed) input.addEventListener("input", later);
  button?.addEventListener("click", () => { run += 1; go(); });
  const offStatus = ctx.connected((hello) => { onHello?.(hello); return go(); });
  // cleanups is read at unmount: a widget may push to it after this call (phases.js does)
  const unmount = teardown(root, [later.cancel, job.stop, offStatus, () => cleanups.forEach((fn) => fn())], charts);
  return { later, measure: go, unmount, fail: (err) => setState(root, "error", err.message) };
}

// A measuring widget's view, built from its URL options (`options`, read through ctx) and put in
// root, and its job runner reporting progress in the view's progress line; jobOptions: more of
// jobRunner's options (a button). Returns { v, job }.
export function measuringView(root, ctx, options, build, jobOptions = {}) {
  const v = build(ctx.readOptions(options).values);
  root.append(...v.nodes);
  return { v, job: jobRunner(root, { client: ctx.client, progress: v.progress, ...jobOptions }) };
}

// A number input named for the URL option it sets, within the option's spec; attrs: a class, a step.
export function numberInput(name, label, value, spec, attrs = {}) {
  return el("input", { type: "number", name, "aria-label": label, value: String(value),
    min: spec.min, max: spec.max, step: spec.type === "int" ? 1 : "any", ...attrs });
}

// A bar whose fill is value / max of its width, with the number written beside it.
export function shareBar(prefix, kind, value, max, text) {
  return el("span", { class: `${prefix}-bar` }, [el("span", { class: `${prefix}-fill ${kind}`, style: { width: `${(100 * value) / max}%` } }),
    el("span", { class: `${prefix}-bar-text`, text })]);
}

// "at 06:12 UTC on 2026-12-03" from the server's ISO time of a measurement.
export function measuredAt(m) {
  return `at ${m.measured_at.slice(11, 16)} UTC on ${m.measured_at.slice(0, 10)}`;
}

// "2 torch threads on 4 CPUs": the threads of a measurement, counted in words.
export function threadsOn(m) {
  return `${m.threads} torch thread${m.threads === 1 ? "" : "s"} on ${m.cpu_count} CPU${m.cpu_count === 1 ? "" : "s"}`;
}

// The machine line of a run on worker processes (tensor and pipeline parallelism): n workers that
// `verb` ("talking", "sending") over gloo; crowded: what sharing the cores did, when they were fewer.
export function workersLine(m, n, verb, crowded) {
  return `Measured here: ${n} worker process${n > 1 ? "es" : ""} with ${m.threads_per_worker} torch thread each, on ${m.cpu_count} CPU cores `
    + `(${m.system} ${m.processor}, torch ${m.torch}), ${measuredAt(m)}, ${verb} over gloo on this machine. `
    + (n > m.cpu_count ? crowded : "")
    + `The machine is shared with the server and other work (load average ${m.load_average} over the last minute, on ${m.cpu_count} cores; `
    + "the workers run at a lower priority than the server): times move from run to run.";
}

// The line that says what a run is doing, read out politely by screen readers.
export function progressLine() {
  return el("p", { class: "progress", "aria-live": "polite" });
}

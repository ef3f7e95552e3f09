// Running a widget's server job, one at a time: a new run aborts the one before it (its result
// and errors are then ignored), the progress line says what is happening, the widget's
// "Measure again" button is off while it runs, and the root's data-state ends ready or error.
//
//   const job = jobRunner(root, { client, progress, button });
//   job.run({ type: "gemm", ... }, {
//     running: "Timing the matrix multiplies…",            // progress text at the start
//     onProgress: (p) => `Timing: ${p.note} (${percent(p)})…`,
//     render,                                              // async (result) => drawn
//     done: (r) => `Timed ${r.points.length} products.`,   // progress text once drawn
//   });
//   return () => { job.stop(); ... };                      // in the widget's unmount
//
// A run of several calls in a row passes a function instead of a message: it gets `call(message,
// onProgress)`, the client's call bound to this run, and its resolved value goes to render.

import { setDisabled, setState } from "./dom.js";

// A progress message's share done, for texts such as "Timing: … (40%)…".
export function percent(p) {
  return `${Math.round(100 * p.done / p.total)}%`;
}

// Thrown into a multi-call run whose controller was aborted between its calls.
function aborted() {
  return Object.assign(new Error("aborted"), { code: "aborted" });
}

// root: the widget's root (gets data-state); progress: the element for the progress line (null for
// a widget without one); button: disabled while a run is going (null for widgets that leave it
// on); a button that had the keyboard's focus gets it back when the run is over.
export function jobRunner(root, { client, progress = null, button = null }) {
  const say = (text) => { if (progress) progress.textContent = text; };
  let current = null;     // the AbortController of the newest run
  let stopped = false;    // after stop(), run() starts nothing

  // job: a message for client.call, or async (call) => result for several calls in a row.
  // running: the first progress text; onProgress(p): the text for a progress message;
  // render(result): may return a promise; done: the last text, a string or a function of the result;
  // recover(err): return true when it dealt with the error itself (no error state then);
// loading: set data-state="loading" while it runs (a test waiting for "ready" then waits for it).
  // Returns a promise that settles when this run is over; it never rejects.
  function run(job, { running = null, onProgress = null, render = null, done = "", recover = null, loading = false } = {}) {
    if (stopped) return Promise.resolve();
    current?.abort();
    const controller = new AbortController();
    current = controller;
    const signal = controller.signal;
    if (running !== null) say(running);
    if (loading) setState(root, "loading");
    if (button) setDisabled(button, true);
    const call = (message, toText = onProgress) => {
      if (signal.aborted) return Promise.reject(aborted());   // not sent: it could not be aborted
      return client.call(message, {
        signal,
        onProgress: toText ? (p) => say(toText(p)) : undefined,
      }).then((r) => { if (signal.aborted) throw aborted(); return r; });
    };
    return (typeof job === "function" ? job(call) : call(job)).then(async (r) => {
      if (signal.aborted) return;
      if (render) await render(r);
      say(typeof done === "function" ? done(r) : done);
      setState(root, "ready");
    }).catch((err) => {
      if (signal.aborted || err.code === "aborted") return;
      if (recover?.(err)) return;
      say("");
      setState(root, "error", err.message);
    }).finally(() => { if (button && current === controller) setDisabled(button, false); });
  }

  // The widget is going away: abort the current run and start no other.
  function stop() {
    stopped = true;
    current?.abort();
  }

  // Abort the current run (its result is ignored) but keep taking new ones.
  function cancel() {
    current?.abort();
  }

  return { run, stop, cancel };
}

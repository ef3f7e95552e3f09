// Page-wide announcements from one widget to others (e.g. the chat's finished answer, which the
// "Two phases" widget places on its charts). The last value of each kind is kept, so a widget
// mounted later (widgets mount when scrolled near) still hears the latest one.

const last = new Map();        // name -> the last detail announced
const listeners = new Map();   // name -> Set of functions

export function announce(name, detail) {
  last.set(name, detail);
  for (const fn of listeners.get(name) || []) fn(detail);
}

// fn(detail) for the last announcement, if any, then for every new one. Returns an unsubscribe.
export function listen(name, fn) {
  if (!listeners.has(name)) listeners.set(name, new Set());
  listeners.get(name).add(fn);
  if (last.has(name)) fn(last.get(name));
  return () => listeners.get(name).delete(fn);
}

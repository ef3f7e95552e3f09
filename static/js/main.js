// Boot: mount each widget from its own ES module when it comes near the screen, give it a
// context (its client, from static/js/source.js: the shared websocket client or a recording, and
// its options from the URL), and keep the "Embed this widget" snippet in step with the reader's
// settings.

import { setState } from "./lib/dom.js";
import { readOptions, toQuery } from "./lib/options.js";
import { start } from "./source.js";

const EMBED = document.body.classList.contains("embed");

// Raw options for one widget: the embed's whole query string, or on the walkthrough the
// parameters named "<widget>.<option>".
function rawOptions(name) {
  const params = new URLSearchParams(window.location.search);
  const raw = {};
  for (const [key, value] of params) {
    if (EMBED) raw[key] = value;
    else if (key.startsWith(`${name}.`)) raw[key.slice(name.length + 1)] = value;
  }
  return raw;
}

function makeContext(root, name, client) {
  const frame = root.closest(".widget-frame");
  const snippet = frame?.querySelector(".snippet");
  return {
    name,
    embed: EMBED,
    client,
    options: rawOptions(name),
    // Read this widget's options against its spec: { values, invalid }.
    readOptions(spec) { return readOptions(this.options, spec); },
    // Run start(hello) once connected, and again when a lost connection comes back; while it is
    // lost, the widget says so. Returns the function that stops listening (call it on unmount).
    connected(start) {
      const run = () => this.client.ready().then(start).catch((err) => setState(root, "error", err.message));
      run();
      return this.client.onStatus((status) => {
        if (status === "closed") setState(root, "error", "The connection to the server was lost; reconnecting…");
        else if (status === "open" && root.dataset.state === "error") run();
      });
    },
    // The reader changed a setting: the embed snippet now carries it.
    setOptions(values, spec) {
      if (!snippet) return;
      const query = toQuery(values, spec);
      const src = snippet.dataset.base + (query ? `?${query}` : "");
      snippet.textContent = snippet.dataset.template.replace("SRC", src);
    },
  };
}

// A widget's own style sheet, linked once when the first widget of that name mounts; resolves
// when it has loaded, so the widget never draws unstyled. An embed links its sheet in the page.
const styles = new Map();

function loadStyle(name) {
  const href = new URL(`../css/widgets/${name}.css`, import.meta.url).href;
  if (!styles.has(href)) {
    const present = [...document.querySelectorAll('link[rel="stylesheet"]')].find((l) => l.href === href);
    styles.set(href, present?.sheet ? Promise.resolve() : new Promise((resolve, reject) => {
      const link = present || document.createElement("link");
      link.addEventListener("load", () => resolve(), { once: true });
      link.addEventListener("error", () => reject(new Error(`its style sheet ${href} failed to load`)), { once: true });
      if (!present) {
        link.rel = "stylesheet";
        link.href = href;
        document.head.append(link);
      }
    }));
  }
  return styles.get(href);
}

async function mountWidget(root) {
  const name = root.dataset.widget;
  try {
    const [module] = await Promise.all([import(`./widgets/${name}.js`), loadStyle(name)]);
    await start(root, name, (client) => {
      root.replaceChildren();
      const unmount = module.mount(root, makeContext(root, name, client));
      return typeof unmount === "function" ? unmount : () => {};
    }, { embed: EMBED });
  } catch (err) {
    console.error(err);
    setState(root, "error", `The ${name} widget failed to load: ${err.message}`);
  }
}

const roots = [...document.querySelectorAll("[data-widget]")];
if (EMBED || !("IntersectionObserver" in window)) {
  roots.forEach(mountWidget);
} else {
  // Widgets below the fold mount when scrolled near, so a page of 23 costs only what is seen.
  const observer = new IntersectionObserver((entries) => {
    for (const entry of entries) {
      if (!entry.isIntersecting) continue;
      observer.unobserve(entry.target);
      mountWidget(entry.target);
    }
  }, { rootMargin: "600px 0px" });
  roots.forEach((root) => observer.observe(root));
}

for (const button of document.querySelectorAll(".copy-snippet")) {
  button.addEventListener("click", async () => {
    const code = button.parentElement.querySelector(".snippet");
    try {
      await navigator.clipboard.writeText(code.textContent);
      button.textContent = "Copied";
    } catch {
      const range = document.createRange();
      range.selectNodeContents(code);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      button.textContent = "Selected: press Ctrl+C";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 2000);
  });
}

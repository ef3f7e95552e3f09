// Boot: mount every widget on the page from its own ES module, and wire the embed snippets.

import { setState } from "./ui.js";

for (const root of document.querySelectorAll("[data-widget]")) {
  const name = root.dataset.widget;
  const options = JSON.parse(root.dataset.options || "{}");
  import(`./widgets/${name}.js`)
    .then((module) => {
      root.replaceChildren();
      module.mount(root, options);
    })
    .catch((err) => {
      console.error(err);
      setState(root, "error", `The ${name} widget failed to load: ${err.message}`);
    });
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

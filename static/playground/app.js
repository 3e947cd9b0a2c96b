// The page shell: the key field, the tabs and the panels. Each panel is an ES module with
// `mount(element)`, imported the first time its tab is opened. A panel whose models this server
// does not serve (none in /v1/models has its capability) shows a note instead, and so does one
// whose module is not there.

import { getKey, listModels, setKey } from "./api.js";
import { h, unavailable } from "./ui.js";

// capability: the panel needs a model with each of these (none: it always works).
export const PANELS = [
  { id: "chat", title: "Chat", module: "./chat.js", capability: ["chat"] },
  { id: "voice", title: "Voice", module: "./voice.js", capability: ["transcription", "chat", "speech"] },
  { id: "images", title: "Images", module: "./images.js", capability: ["images"] },
  { id: "documents", title: "Documents", module: "./documents.js", capability: ["documents"] },
  { id: "entities", title: "Entities", module: "./entities.js", capability: ["entities"] },
  { id: "tiers", title: "Memory tiers", module: "./tiers.js", capability: [] },
];

const tabs = new Map(); // id -> {button, element, mounted}

function notice(text) {
  const box = document.getElementById("notice");
  box.textContent = text || "";
  box.hidden = !text;
}

function missingCapabilities(panel, models) {
  return panel.capability.filter(
    (capability) => !models.some((m) => m.capabilities.includes(capability) || m.modality === capability),
  );
}

async function mountPanel(panel, element) {
  let models = [];
  if (panel.capability.length) {
    try {
      models = await listModels();
    } catch (error) {
      unavailable(element, `Could not list the models (GET v1/models): ${error.message}`);
      element.dataset.available = "false";
      return;
    }
    const missing = missingCapabilities(panel, models);
    if (missing.length) {
      unavailable(element, `No model on this server serves ${missing.join(", ")} (GET v1/models), so this panel is off.`);
      element.dataset.available = "false";
      return;
    }
  }
  let module;
  try {
    module = await import(panel.module);
  } catch (error) {
    unavailable(element, `The ${panel.title} panel is not part of this build (${panel.module}: ${error.message}).`);
    element.dataset.available = "false";
    return;
  }
  element.replaceChildren();
  try {
    await module.mount(element);
    element.dataset.available = "true";
  } catch (error) {
    unavailable(element, `The ${panel.title} panel failed to start: ${error.message}`);
    element.dataset.available = "false";
  }
}

function select(id, { focus = false } = {}) {
  const chosen = tabs.get(id) || tabs.values().next().value;
  for (const [tabId, tab] of tabs) {
    const on = tab === chosen;
    tab.button.setAttribute("aria-selected", String(on));
    tab.button.tabIndex = on ? 0 : -1;
    tab.element.hidden = !on;
    if (on && !tab.mounted) {
      tab.mounted = mountPanel(tab.panel, tab.element);
    }
    if (on) {
      if (window.location.hash !== `#${tabId}`) window.history.replaceState(null, "", `#${tabId}`);
      tab.element.dispatchEvent(new CustomEvent("panel-shown"));
    }
  }
  if (focus) chosen.button.focus();
}

// Arrow keys, Home and End move between the tabs (the WAI-ARIA tabs pattern).
function onTabKey(event) {
  const ids = [...tabs.keys()];
  const at = ids.indexOf(event.currentTarget.dataset.panel);
  const moves = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: ids.length - 1 };
  if (!(event.key in moves)) return;
  event.preventDefault();
  select(ids[(moves[event.key] + ids.length) % ids.length], { focus: true });
}

function buildTabs() {
  const bar = document.getElementById("tabs");
  const main = document.getElementById("panels");
  for (const panel of PANELS) {
    const button = h(
      "button",
      {
        type: "button",
        role: "tab",
        id: `tab-${panel.id}`,
        "aria-controls": `panel-${panel.id}`,
        "aria-selected": "false",
        dataset: { panel: panel.id },
        onclick: () => select(panel.id),
        onkeydown: onTabKey,
      },
      panel.title,
    );
    const element = h("section", {
      class: "panel",
      role: "tabpanel",
      id: `panel-${panel.id}`,
      "aria-labelledby": `tab-${panel.id}`,
      hidden: true,
      dataset: { panel: panel.id },
    });
    bar.append(button);
    main.append(element);
    tabs.set(panel.id, { panel, button, element, mounted: null });
  }
}

// After a new key: the panels start over with it (the model list may differ per key).
function remountAll() {
  for (const tab of tabs.values()) {
    tab.mounted = null;
    tab.element.replaceChildren();
  }
  select(window.location.hash.slice(1));
  checkModels();
}

async function checkModels() {
  try {
    const models = await listModels();
    notice(models.length ? "" : "This server lists no models (GET v1/models).");
  } catch (error) {
    const hint = error.status === 401 ? " Enter the server's API key above." : "";
    notice(`GET v1/models failed: ${error.message}${hint}`);
  }
}

function setUpKey() {
  const form = document.getElementById("key-form");
  const input = document.getElementById("api-key");
  input.value = getKey();
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setKey(input.value.trim());
    remountAll();
  });
  document.getElementById("key-forget").addEventListener("click", () => {
    input.value = "";
    setKey("");
    remountAll();
  });
}

setUpKey();
buildTabs();
select(window.location.hash.slice(1));
checkModels();
window.addEventListener("hashchange", () => select(window.location.hash.slice(1)));

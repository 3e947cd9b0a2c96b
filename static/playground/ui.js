// Small DOM helpers the panels share. Text always goes in as text nodes, never as HTML.

let lastId = 0;

// A fresh element id, for label/for pairs.
export function uid(prefix = "f") {
  lastId += 1;
  return `${prefix}-${lastId}`;
}

// h("button", {type: "button", onclick: fn, class: "x", dataset: {a: 1}}, "text", child, ...)
export function h(tag, attrs = {}, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(element.dataset, value);
    } else if (name === "class") {
      element.className = value;
    } else if (name in element && typeof value !== "string") {
      element[name] = value;
    } else {
      element.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

// A labelled control: <div class="field"><label for=id>text</label>control</div>.
export function field(labelText, control, hint) {
  if (!control.id) control.id = uid("field");
  return h(
    "div",
    { class: "field" },
    h("label", { for: control.id }, labelText),
    control,
    hint ? h("span", { class: "hint" }, hint) : null,
  );
}

// <select> of `models`, optionally grouped: groups = [[groupLabel, models], ...].
export function modelSelect(groups, selected) {
  const select = h("select", {});
  for (const [label, models] of groups) {
    if (!models.length) continue;
    const parent = label ? h("optgroup", { label }) : select;
    for (const model of models) {
      parent.append(h("option", { value: model.id, selected: model.id === selected }, model.id));
    }
    if (parent !== select) select.append(parent);
  }
  return select;
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined || Number.isNaN(Number(bytes))) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = Number(bytes);
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatMs(ms) {
  if (ms === null || ms === undefined) return "-";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

// The short name of a tier.
export const TIER_NAMES = {
  tier1_gpu_vram: "VRAM",
  tier2_pinned_ram: "RAM",
  tier3_nvme_ssd: "disk",
};

export function tierName(tier) {
  return TIER_NAMES[tier] || tier || "-";
}

// A note in place of a panel's content: no model serves it, or the module is not there.
export function unavailable(element, text) {
  element.replaceChildren(h("p", { class: "note unavailable" }, text));
}

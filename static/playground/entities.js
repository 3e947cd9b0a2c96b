// The entities panel: a text and free-text labels in, POST v1/entities, the spans highlighted in
// the text by label, each with its score, and the same as a table.

import { apiJSON, modelsWith } from "./api.js";
import { field, formatMs, h, modelSelect, tierName } from "./ui.js";

const SAMPLE_TEXT = "Mario Rossi works in Milan for Ferrari. Tim Cook announced the iPhone in Cupertino.";
const SAMPLE_LABELS = "person, city, company, product";

export async function mount(element) {
  const models = await modelsWith("entities");
  const model = modelSelect([["", models]], models[0] && models[0].id);
  model.name = "model";
  const text = h("textarea", { rows: 4, name: "text" });
  text.value = SAMPLE_TEXT;
  const labels = h("input", { type: "text", name: "labels", value: SAMPLE_LABELS });
  const threshold = h("input", { type: "number", name: "threshold", min: 0, max: 1, step: 0.05, value: "0.5" });
  const run = h("button", { type: "submit", class: "primary" }, "Extract");
  const status = h("p", { class: "status", role: "status", "aria-live": "polite" }, "idle");
  const result = h("div", { class: "entities-result" });

  async function onSubmit(event) {
    event.preventDefault();
    const wanted = labels.value.split(",").map((l) => l.trim()).filter(Boolean);
    if (!text.value.trim() || !wanted.length) {
      status.textContent = "Give a text and at least one label.";
      return;
    }
    run.disabled = true;
    element.dataset.state = "busy";
    status.textContent = `extracting with ${model.value}…`;
    const body = { model: model.value, input: text.value, labels: wanted };
    if (threshold.value !== "") body.threshold = Number(threshold.value);
    try {
      const answer = await apiJSON("v1/entities", body);
      const spans = ((answer.data || [])[0] || {}).entities || [];
      result.replaceChildren(...render(text.value, spans, wanted, answer.hypnos_telemetry || {}));
      status.textContent = `${spans.length} span${spans.length === 1 ? "" : "s"} found`;
    } catch (error) {
      status.textContent = `error: ${error.message}`;
    } finally {
      run.disabled = false;
      element.dataset.state = "idle";
    }
  }

  element.classList.add("entities-panel");
  element.dataset.state = "idle";
  element.replaceChildren(
    h(
      "form",
      { onsubmit: onSubmit },
      h("div", { class: "row" }, field("Model", model), field("Threshold", threshold)),
      field("Text", text),
      field("Labels (comma-separated, any phrases)", labels),
      h("div", { class: "row actions" }, run),
    ),
    status,
    result,
  );
}

// Label -> a hue of its own, stable for the same label list.
function hues(labels) {
  return new Map(labels.map((label, i) => [label, Math.round((i * 360) / Math.max(labels.length, 1) + 20) % 360]));
}

function render(text, spans, labels, telemetry) {
  // Offsets are Unicode scalar values (spec 13): slice the code points, not UTF-16 units.
  const points = Array.from(text);
  const colour = hues([...labels, ...spans.map((s) => s.label).filter((l) => !labels.includes(l))]);
  const sorted = [...spans].sort((a, b) => a.start - b.start || b.end - a.end);
  const pieces = [];
  let at = 0;
  for (const span of sorted) {
    if (span.start < at) continue; // nested (flat: false): listed in the table, not drawn twice
    pieces.push(points.slice(at, span.start).join(""));
    pieces.push(
      h(
        "mark",
        {
          class: "entity",
          style: `--hue: ${colour.get(span.label)}`,
          dataset: { label: span.label, score: String(span.score) },
          title: `${span.label} ${span.score.toFixed(2)}`,
        },
        points.slice(span.start, span.end).join(""),
        h("span", { class: "entity-label" }, `${span.label} ${span.score.toFixed(2)}`),
      ),
    );
    at = span.end;
  }
  pieces.push(points.slice(at).join(""));
  const legend = h(
    "ul",
    { class: "legend", "aria-label": "Labels" },
    ...[...colour.keys()].map((label) =>
      h("li", {}, h("span", { class: "swatch", style: `--hue: ${colour.get(label)}` }), label),
    ),
  );
  const table = h(
    "table",
    { class: "entity-table" },
    h("caption", {}, "Spans"),
    h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "text"), h("th", { scope: "col" }, "label"), h("th", { scope: "col" }, "score"), h("th", { scope: "col" }, "offsets"))),
    h(
      "tbody",
      {},
      ...spans.map((s) =>
        h("tr", {}, h("td", {}, s.text), h("td", {}, s.label), h("td", {}, s.score.toFixed(3)), h("td", {}, `${s.start}–${s.end}`)),
      ),
    ),
  );
  const strip = h(
    "p",
    { class: "hint" },
    `previous tier ${tierName(telemetry.previous_tier)} · switch ${formatMs(telemetry.tier_switch_latency_ms)} · inference ${formatMs(telemetry.inference_latency_ms)}`,
  );
  return [h("p", { class: "entity-text" }, ...pieces), legend, table, strip];
}

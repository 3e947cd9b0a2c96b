// The documents panel: a file converted by POST v1/documents/convert with stream = true, each
// page shown as its document.page event arrives, its pictures fetched from the picture store
// (return_pictures), and the final document event's usage under them.
import { apiJSON, modelsWith, streamSSE } from "./api.js";
import { field, formatMs, h, modelSelect, uid, unavailable } from "./ui.js";

const ACCEPT = ".pdf,.docx,.pptx,.xlsx,.html,.htm,.md,.png,.jpg,.jpeg,.tif,.tiff,.bmp,.webp";

function count(n, word) {
  return `${n ?? 0} ${word}${n === 1 ? "" : "s"}`;
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

export async function mount(element) {
  const models = await modelsWith("documents");
  if (!models.length) {
    unavailable(element, "No document conversion model is served by this server.");
    return;
  }
  const model = modelSelect([["", models]]);
  const file = h("input", { type: "file", name: "file", accept: ACCEPT, required: true });
  const pages = h("input", { type: "text", name: "pages", placeholder: "all", pattern: "\\d+(-\\d+)?" });
  const ocr = h("input", { type: "checkbox", name: "ocr", checked: true });
  const pictures = h("input", { type: "checkbox", name: "return_pictures", checked: true });
  const convert = h("button", { type: "submit", class: "primary" }, "Convert");
  const stop = h("button", { type: "button", disabled: true }, "Stop");
  const form = h(
    "form",
    { class: "doc-form" },
    h(
      "div",
      { class: "row" },
      field("Model", model),
      field("Document", file),
      field("Pages", pages, "one page or a range: 3, 2-5"),
    ),
    h(
      "div",
      { class: "row" },
      h("div", { class: "field" }, h("label", {}, ocr, " OCR scanned pages")),
      h("div", { class: "field" }, h("label", {}, pictures, " Keep the pictures (picture store)")),
    ),
    h("div", { class: "row" }, convert, stop),
  );
  const status = h("p", { class: "status doc-status", role: "status", "aria-live": "polite" });
  const output = h("ol", { class: "doc-pages", "aria-label": "Converted pages" });
  const summary = h("p", { class: "doc-summary" });
  element.append(h("div", { class: "doc-panel" }, form, status, output, summary));

  let controller = null;
  stop.addEventListener("click", () => controller?.abort());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    controller = new AbortController();
    convert.disabled = true;
    stop.disabled = false;
    output.replaceChildren();
    delete output.dataset.done;
    summary.textContent = "";
    status.classList.remove("error");
    status.textContent = "Uploading…";
    const view = { status, output, summary, expected: 0 };
    try {
      const chosen = file.files[0];
      const body = {
        model: model.value,
        file: await readAsDataURL(chosen),
        filename: chosen.name,
        ocr: ocr.checked,
        return_pictures: pictures.checked,
        stream: true,
      };
      if (pages.value.trim()) body.pages = pages.value.trim();
      await streamSSE("v1/documents/convert", body, (data) => onEvent(view, data), controller.signal);
    } catch (error) {
      const stopped = error.name === "AbortError";
      status.textContent = stopped ? "Stopped." : `The conversion failed: ${error.message}`;
      status.classList.toggle("error", !stopped);
    } finally {
      convert.disabled = false;
      stop.disabled = true;
      controller = null;
    }
  });
}

function onEvent(view, data) {
  if (data.object === "document.started") {
    view.expected = (data.pages || []).length;
    view.status.textContent = `Converting ${view.expected} of ${data.page_count} pages…`;
  } else if (data.object === "document.page") {
    view.output.append(pageView(data));
    view.status.textContent = `Page ${data.page} ready (${view.output.children.length} of ${view.expected || "?"}).`;
  } else if (data.object === "document") {
    const usage = data.usage || {};
    view.output.dataset.done = "true";
    view.status.textContent = `Done: ${usage.pages ?? view.output.children.length} pages.`;
    const expires = data.pictures_expire_at;
    const kept = usage.pictures && expires ? `; the pictures are kept until ${expires}` : "";
    view.summary.textContent = `${count(usage.pictures, "picture")}, ${count(usage.tables, "table")}${kept}.`;
  } else if (data.error) {
    view.status.textContent = `The conversion failed: ${data.error.message}`;
    view.status.classList.add("error");
  }
}

function pageView(page) {
  const heading = h("h3", { id: uid("doc") }, `Page ${page.page}`);
  const facts = `${count(page.pictures, "picture")}, ${count(page.tables, "table")}, ${formatMs(page.ms)}`;
  const urls = page.picture_urls || [];
  return h(
    "li",
    { class: "doc-page", dataset: { page: page.page }, "aria-labelledby": heading.id },
    heading,
    h("p", { class: "doc-facts" }, facts),
    // Focusable, so a long page scrolls from the keyboard.
    h("pre", { class: "doc-markdown", tabindex: "0", "aria-label": `Markdown of page ${page.page}` }, page.markdown),
    h(
      "div",
      { class: "doc-pictures" },
      urls.map((url, index) => pictureView(url, page.page, index + 1)),
    ),
  );
}

// One picture from the store: its record carries the image (base64) and docling's caption. The
// URL is an absolute path (/v1/documents/…), which apiJSON resolves under the page's folder.
function pictureView(url, pageNumber, index) {
  const caption = h("figcaption", {}, `Picture ${index} of page ${pageNumber}`);
  const figure = h("figure", { class: "doc-picture", "aria-busy": "true" }, caption);
  apiJSON(url)
    .then((record) => {
      const alt = record.caption || `Picture ${record.index} of page ${record.page}`;
      figure.prepend(h("img", { src: `data:${record.mime || "image/png"};base64,${record.image}`, alt }));
      if (record.caption) caption.textContent = record.caption;
    })
    .catch((error) => {
      caption.textContent = `Picture ${index} of page ${pageNumber} could not be loaded: ${error.message}`;
    })
    .finally(() => figure.removeAttribute("aria-busy"));
  return figure;
}

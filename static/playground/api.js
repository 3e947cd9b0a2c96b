// The playground's one way to the API: relative URLs from the page's own folder (so a reverse
// proxy's prefix, /hypnos/ say, stays in front of v1/...), the key from localStorage as a bearer
// header (never in a URL), and errors as the API's error envelope says them.

const KEY_ITEM = "hypnos.key";

// The page is the root of the server's URL space: "/" normally, "/prefix/" behind a proxy (and
// "/prefix" without the slash is the same place).
const pagePath = window.location.pathname.endsWith("/") ? window.location.pathname : `${window.location.pathname}/`;
export const BASE = new URL(pagePath, window.location.origin);

export function getKey() {
  return window.localStorage.getItem(KEY_ITEM) || "";
}

export function setKey(key) {
  if (key) window.localStorage.setItem(KEY_ITEM, key);
  else window.localStorage.removeItem(KEY_ITEM);
  modelsPromise = null;
}

// "v1/models" or "/v1/models" -> the URL under the page's folder; absolute URLs are kept.
export function apiURL(path) {
  if (/^[a-z]+:\/\//i.test(path)) return path;
  return new URL(String(path).replace(/^\/+/, ""), BASE).href;
}

// An error answer of the API: `error.message`, `type`, `code`, `param` of the envelope.
export class ApiError extends Error {
  constructor(status, body, fallback) {
    const error = (body && body.error) || {};
    const message = typeof error === "string" ? error : error.message;
    super(message || fallback || `HTTP ${status}`);
    this.status = status;
    this.type = error.type || null;
    this.code = error.code || null;
    this.param = error.param || null;
  }
}

export async function errorOf(response) {
  let body = null;
  const text = await response.text().catch(() => "");
  try {
    body = JSON.parse(text);
  } catch {
    body = null;
  }
  return new ApiError(response.status, body, text.slice(0, 200) || response.statusText);
}

// fetch() with the key. options.key overrides the stored key (the tier view's admin key).
export function apiFetch(path, options = {}) {
  const { key, ...init } = options;
  const headers = new Headers(init.headers || {});
  const bearer = key === undefined || key === "" ? getKey() : key;
  if (bearer && !headers.has("Authorization")) headers.set("Authorization", `Bearer ${bearer}`);
  return window.fetch(apiURL(path), { ...init, headers });
}

// A JSON call: POST `body` when it is given (GET without), the parsed answer, or an ApiError.
export async function apiJSON(path, body, options = {}) {
  const init = { ...options };
  const headers = new Headers(init.headers || {});
  if (body !== undefined && body !== null) {
    init.method = init.method || "POST";
    if (body instanceof FormData) {
      init.body = body;
    } else {
      headers.set("Content-Type", "application/json");
      init.body = JSON.stringify(body);
    }
  }
  init.headers = headers;
  const response = await apiFetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// POST `body` as JSON to an SSE route; onEvent(parsed JSON, response) for each `data:` line
// until `data: [DONE]` (or the end of the body). Comments and other fields are skipped. Aborting
// `signal` closes the connection, which the server takes as a cancel. Answers the Response (its
// headers: x-request-id and the telemetry headers some routes send).
export async function streamSSE(path, body, onEvent, signal) {
  // No Accept: text/event-stream; the routes negotiate JSON (their errors) and answer 406 to it.
  const headers = { "Content-Type": "application/json" };
  const response = await apiFetch(path, { method: "POST", headers, body: JSON.stringify(body), signal });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, "");
        buffer = buffer.slice(newline + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trimStart();
        if (data === "[DONE]") return response;
        onEvent(JSON.parse(data), response);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
  return response;
}

// What each modality serves, for a server that does not report `capabilities`.
const MODALITY_CAPABILITIES = {
  text_generation: ["chat"],
  vision: ["chat", "vision"],
  speech_to_text: ["transcription"],
  text_to_speech: ["speech"],
  embeddings: ["embeddings"],
  image_generation: ["images"],
  document_conversion: ["documents"],
  entity_extraction: ["entities"],
};

let modelsPromise = null;

// GET /v1/models once (refresh: true asks again); each model as the API reports it, with
// `capabilities` (chat, vision, tools, thinking, audio_in, transcription, speech, embeddings,
// images, edit, upscale, documents, entities, ...) and `modality`.
export function listModels({ refresh = false } = {}) {
  if (refresh || !modelsPromise) {
    modelsPromise = apiJSON("v1/models")
      .then((answer) =>
        (answer.data || []).map((model) => ({
          ...model,
          capabilities: model.capabilities || MODALITY_CAPABILITIES[model.modality] || [],
        })),
      )
      .catch((error) => {
        modelsPromise = null;
        throw error;
      });
  }
  return modelsPromise;
}

// The models that serve `capability` (a capability or a modality name).
export async function modelsWith(capability) {
  const models = await listModels();
  return models.filter((model) => model.capabilities.includes(capability) || model.modality === capability);
}

// The chat panel: POST v1/chat/completions with stream: true, tokens shown as they arrive,
// Stop aborts the fetch (the server cancels generation when the connection closes), thoughts
// (reasoning_content) apart from the answer, tool calls as the deltas bring them, and a
// telemetry strip from the last chunk's hypnos_telemetry and usage.

import { listModels, streamSSE } from "./api.js";
import { field, formatMs, h, modelSelect, tierName, uid } from "./ui.js";

// The capabilities a chat model may have, in the picker's group order.
const GROUPS = [
  ["vision", "Chat + vision"],
  ["tools", "Chat + tools"],
  ["thinking", "Chat + thinking"],
  ["audio_in", "Chat + audio in"],
  ["chat", "Chat"],
];

export async function mount(element) {
  const models = (await listModels()).filter((m) => m.capabilities.includes("chat"));
  const chat = new ChatPanel(element, models);
  chat.render();
}

function groupModels(models) {
  const placed = new Set();
  return GROUPS.map(([capability, label]) => {
    const group = models.filter((m) => m.capabilities.includes(capability) && !placed.has(m.id));
    group.forEach((m) => placed.add(m.id));
    return [label, group];
  });
}

function numberInput(attrs) {
  return h("input", { type: "number", inputmode: "decimal", ...attrs });
}

class ChatPanel {
  constructor(element, models) {
    this.element = element;
    this.models = models;
    this.history = [];
    this.controller = null;
    this.image = null; // data URL of the attachment
  }

  render() {
    const preferred = this.models.find((m) => m.current_tier === "tier1_gpu_vram") || this.models[0];
    this.model = modelSelect(groupModels(this.models), preferred && preferred.id);
    this.model.name = "model";
    this.model.addEventListener("change", () => this.onModelChange());
    this.system = h("textarea", { rows: 2, name: "system", placeholder: "You are a helpful assistant." });
    this.temperature = numberInput({ name: "temperature", min: 0, max: 2, step: 0.1, placeholder: "engine default" });
    this.topP = numberInput({ name: "top_p", min: 0, max: 1, step: 0.05, placeholder: "engine default" });
    this.maxTokens = numberInput({ name: "max_tokens", min: 1, step: 1, placeholder: "512" });
    this.seed = numberInput({ name: "seed", step: 1, placeholder: "random" });
    this.jsonMode = h("input", { type: "checkbox", name: "json_mode" });
    this.reasoning = h(
      "select",
      { name: "reasoning_effort" },
      h("option", { value: "" }, "model default"),
      ...["none", "low", "medium", "high"].map((v) => h("option", { value: v }, v)),
    );
    this.tools = h("textarea", {
      rows: 4,
      name: "tools",
      spellcheck: "false",
      placeholder: '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]',
    });
    this.imageInput = h("input", { type: "file", accept: "image/*", name: "image" });
    this.imageInput.addEventListener("change", () => this.onImage());
    this.imagePreview = h("div", { class: "attachment" });
    this.imageHint = h("span", { class: "hint" });
    this.prompt = h("textarea", { rows: 3, name: "prompt", required: true, placeholder: "Ask something (Ctrl+Enter sends)" });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        this.form.requestSubmit();
      }
    });
    this.send = h("button", { type: "submit", class: "primary" }, "Send");
    this.stop = h("button", { type: "button", disabled: true, onclick: () => this.onStop() }, "Stop");
    this.clear = h("button", { type: "button", onclick: () => this.onClear() }, "New conversation");
    this.status = h("p", { class: "status", role: "status", "aria-live": "polite" }, "idle");
    this.log = h("div", { class: "chat-log", "aria-label": "Conversation", role: "log" });

    const fieldsetId = uid("sampling");
    this.form = h(
      "form",
      { class: "chat-form", onsubmit: (event) => this.onSubmit(event) },
      h(
        "div",
        { class: "row" },
        field("Model", this.model),
        h("div", { class: "field" }, h("label", {}, this.jsonMode, " JSON mode (response_format json_object)")),
        field("Reasoning effort", this.reasoning),
      ),
      field("System prompt", this.system),
      h(
        "details",
        { class: "options" },
        h("summary", { id: fieldsetId }, "Sampling, tools and attachment"),
        h(
          "div",
          { class: "row" },
          field("Temperature", this.temperature),
          field("Top p", this.topP),
          field("Max tokens", this.maxTokens),
          field("Seed", this.seed),
        ),
        field("Tools (JSON array of OpenAI function tools)", this.tools),
        field("Image attachment", this.imageInput),
        this.imageHint,
        this.imagePreview,
      ),
      field("Message", this.prompt),
      h("div", { class: "row actions" }, this.send, this.stop, this.clear),
    );
    this.element.classList.add("chat-panel");
    this.element.dataset.state = "idle";
    this.element.replaceChildren(this.log, this.status, this.form);
    this.onModelChange();
  }

  selectedModel() {
    return this.models.find((m) => m.id === this.model.value);
  }

  onModelChange() {
    const model = this.selectedModel();
    const sees = Boolean(model && model.capabilities.includes("vision"));
    this.imageInput.disabled = !sees;
    this.imageHint.textContent = sees ? "" : "This model does not see images (no vision capability).";
    if (!sees) this.setImage(null);
  }

  onImage() {
    const file = this.imageInput.files[0];
    if (!file) return this.setImage(null);
    const reader = new FileReader();
    reader.onload = () => this.setImage(reader.result);
    reader.readAsDataURL(file);
  }

  setImage(dataURL) {
    this.image = dataURL;
    if (!dataURL) this.imageInput.value = "";
    this.imagePreview.replaceChildren(
      dataURL ? h("img", { src: dataURL, alt: "The image attached to the next message" }) : "",
    );
  }

  setState(state, text) {
    this.element.dataset.state = state;
    this.status.textContent = text;
    const busy = state === "streaming" || state === "waiting";
    this.send.disabled = busy;
    this.stop.disabled = !busy;
  }

  onClear() {
    if (this.controller) this.controller.abort();
    this.history = [];
    this.log.replaceChildren();
    this.setState("idle", "idle");
  }

  onStop() {
    if (this.controller) this.controller.abort();
  }

  // The request body from the form; throws on a tools field that is not a JSON array.
  body(messages) {
    const body = { model: this.model.value, messages, stream: true };
    const numbers = { temperature: this.temperature, top_p: this.topP, max_tokens: this.maxTokens, seed: this.seed };
    for (const [name, input] of Object.entries(numbers)) {
      if (input.value !== "") body[name] = Number(input.value);
    }
    if (this.jsonMode.checked) body.response_format = { type: "json_object" };
    if (this.reasoning.value) body.reasoning_effort = this.reasoning.value;
    const tools = this.tools.value.trim();
    if (tools) {
      const parsed = JSON.parse(tools);
      if (!Array.isArray(parsed)) throw new SyntaxError("tools must be a JSON array");
      body.tools = parsed;
    }
    return body;
  }

  userMessage(text) {
    if (!this.image) return { role: "user", content: text };
    return {
      role: "user",
      content: [
        { type: "text", text },
        { type: "image_url", image_url: { url: this.image } },
      ],
    };
  }

  async onSubmit(event) {
    event.preventDefault();
    const text = this.prompt.value.trim();
    if (!text || this.controller) return;
    const user = this.userMessage(text);
    const system = this.system.value.trim();
    const messages = [...(system ? [{ role: "system", content: system }] : []), ...this.history, user];
    let body;
    try {
      body = this.body(messages);
    } catch (error) {
      this.setState("idle", `The tools field is not valid JSON: ${error.message}`);
      return;
    }
    this.log.append(this.bubble("user", text, this.image));
    this.prompt.value = "";
    this.setImage(null);
    const answer = new AnswerView(body.model);
    this.log.append(answer.element);
    this.history.push(user);
    await this.stream(body, answer);
  }

  async stream(body, answer) {
    this.controller = new AbortController();
    this.setState("waiting", `waiting for ${body.model}…`);
    try {
      await streamSSE(
        "v1/chat/completions",
        body,
        (chunk, response) => {
          answer.onChunk(chunk, response);
          if (this.element.dataset.state === "waiting" && answer.started) this.setState("streaming", "streaming…");
        },
        this.controller.signal,
      );
      answer.finish();
      const message = answer.message();
      if (message) this.history.push(message);
      this.setState("idle", answer.failed ? `error: ${answer.failed}` : `done (${answer.finishReason || "end of stream"})`);
    } catch (error) {
      if (error.name === "AbortError") {
        answer.stopped();
        const message = answer.message();
        if (message) this.history.push(message);
        this.setState("idle", "stopped");
      } else {
        answer.error(error.message);
        this.history.pop();
        this.setState("idle", `error: ${error.message}`);
      }
    } finally {
      this.controller = null;
      this.log.scrollTop = this.log.scrollHeight;
    }
  }

  bubble(role, text, image) {
    return h(
      "article",
      { class: `message ${role}`, "aria-label": `${role} message` },
      h("div", { class: "role" }, role),
      h("div", { class: "content" }, text),
      image ? h("img", { class: "thumb", src: image, alt: "attached image" }) : null,
    );
  }
}

// One assistant answer being streamed.
class AnswerView {
  constructor(model) {
    this.content = "";
    this.reasoningText = "";
    this.toolCalls = [];
    this.finishReason = null;
    this.failed = null;
    this.started = false;
    this.reasoningBox = h("pre", { class: "reasoning-text" });
    this.reasoning = h(
      "details",
      { class: "reasoning", hidden: true, open: true },
      h("summary", {}, "Reasoning"),
      this.reasoningBox,
    );
    this.text = h("div", { class: "content answer-text" });
    this.tools = h("div", { class: "tool-calls", hidden: true, "aria-label": "Tool calls" });
    this.telemetry = h("dl", { class: "telemetry", "aria-label": "Telemetry of this answer" });
    this.element = h(
      "article",
      { class: "message assistant streaming", "aria-label": "assistant message" },
      h("div", { class: "role" }, `assistant · ${model}`),
      this.reasoning,
      this.text,
      this.tools,
      this.telemetry,
    );
  }

  onChunk(chunk, response) {
    if (!this.requestId) this.requestId = response.headers.get("x-request-id");
    if (chunk.error) {
      this.failed = chunk.error.message || "the stream failed";
    }
    const choice = (chunk.choices || [])[0] || {};
    const delta = choice.delta || {};
    if (delta.reasoning_content) {
      this.started = true;
      this.reasoningText += delta.reasoning_content;
      this.reasoningBox.textContent = this.reasoningText;
      this.reasoning.hidden = false;
    }
    if (delta.content) {
      this.started = true;
      this.content += delta.content;
      this.text.textContent = this.content;
    }
    for (const call of delta.tool_calls || []) {
      this.started = true;
      this.addToolCall(call);
    }
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    if (chunk.hypnos_telemetry || chunk.usage) this.showTelemetry(chunk.hypnos_telemetry || {}, chunk.usage || {});
  }

  // Calls arrive whole, one per chunk (spec 7.5); fragments by index are joined as OpenAI's are.
  addToolCall(call) {
    const index = call.index ?? this.toolCalls.length;
    const known = this.toolCalls[index];
    if (known) {
      known.function.arguments += (call.function && call.function.arguments) || "";
    } else {
      this.toolCalls[index] = {
        id: call.id,
        type: call.type || "function",
        function: { name: (call.function && call.function.name) || "", arguments: (call.function && call.function.arguments) || "" },
      };
    }
    this.tools.hidden = false;
    this.tools.replaceChildren(
      h("div", { class: "role" }, "Tool calls"),
      ...this.toolCalls.map((c) =>
        h("div", { class: "tool-call" }, h("code", {}, `${c.function.name}(`), h("code", {}, prettyArguments(c.function.arguments)), h("code", {}, ")"), c.id ? h("span", { class: "hint" }, ` ${c.id}`) : null),
      ),
    );
  }

  showTelemetry(telemetry, usage) {
    const engine = telemetry.engine || {};
    const cached =
      engine.cached_tokens ?? (usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : undefined) ?? 0;
    const items = [
      ["previous tier", tierName(telemetry.previous_tier)],
      ["switch", formatMs(telemetry.tier_switch_latency_ms)],
      ["ttft", formatMs(engine.ttft_ms)],
      ["tokens/s", engine.decode_tokens_per_s !== undefined ? engine.decode_tokens_per_s.toFixed(1) : "-"],
      ["cached tokens", String(cached)],
      ["tokens", usage.completion_tokens !== undefined ? `${usage.prompt_tokens} in / ${usage.completion_tokens} out` : "-"],
    ];
    if (telemetry.evicted_models && telemetry.evicted_models.length) items.push(["evicted", telemetry.evicted_models.join(", ")]);
    if (this.requestId) items.push(["request", this.requestId]);
    this.telemetry.replaceChildren(
      ...items.flatMap(([name, value]) => [h("dt", {}, name), h("dd", { dataset: { field: name } }, value)]),
    );
  }

  finish() {
    this.element.classList.remove("streaming");
    if (this.failed) this.error(this.failed);
    if (!this.content && !this.toolCalls.length && !this.failed) this.text.textContent = "(no text)";
    if (this.finishReason) this.element.dataset.finish = this.finishReason;
  }

  stopped() {
    this.element.classList.remove("streaming");
    this.element.dataset.finish = "stopped";
    this.telemetry.replaceChildren(
      h("dt", {}, "stopped"),
      h("dd", {}, "by the user; the server sends telemetry with the last chunk, which never came"),
      ...(this.requestId ? [h("dt", {}, "request"), h("dd", { dataset: { field: "request" } }, this.requestId)] : []),
    );
  }

  error(message) {
    this.element.classList.remove("streaming");
    this.element.classList.add("failed");
    this.element.dataset.finish = "error";
    this.element.append(h("p", { class: "error", role: "alert" }, message));
  }

  // The assistant message for the history (none when no text came). Tool calls are shown, not
  // kept: the playground runs no tools, so it has no tool messages to answer them with.
  message() {
    return this.content ? { role: "assistant", content: this.content } : null;
  }
}

function prettyArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text));
  } catch {
    return text;
  }
}

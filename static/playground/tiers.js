// The tier view: GET v1/memory/status every few seconds while the panel is shown; each model
// drawn in the tier it is in (VRAM, RAM, disk) with its bytes, leases, slots and placement, the
// budgets as bars, the recent evictions with their reason, and promote / demote buttons that
// POST v1/memory/tier with the admin key. A model that changed tier since the last poll is
// marked, so a request made in another panel visibly moves it.

import { apiJSON } from "./api.js";
import { field, formatBytes, formatMs, h, tierName } from "./ui.js";

const POLL_MS = 2000;
const ADMIN_ITEM = "hypnos.adminKey";
const TIERS = [
  ["tier1_gpu_vram", "Tier 1 · VRAM"],
  ["tier2_pinned_ram", "Tier 2 · RAM"],
  ["tier3_nvme_ssd", "Tier 3 · disk"],
];
const ORDER = TIERS.map(([tier]) => tier);

export function mount(element) {
  new TierView(element).start();
}

class TierView {
  constructor(element) {
    this.element = element;
    this.previous = new Map(); // model id -> tier at the last poll
    this.moved = new Map(); // model id -> {from, at}
    this.timer = null;
    this.busy = new Set();
  }

  start() {
    this.adminKey = h("input", {
      type: "password",
      autocomplete: "off",
      name: "admin-key",
      placeholder: "empty: the API key above",
    });
    this.adminKey.value = window.sessionStorage.getItem(ADMIN_ITEM) || "";
    this.adminKey.addEventListener("change", () => {
      if (this.adminKey.value) window.sessionStorage.setItem(ADMIN_ITEM, this.adminKey.value);
      else window.sessionStorage.removeItem(ADMIN_ITEM);
    });
    this.status = h("p", { class: "status", role: "status", "aria-live": "polite" }, "loading…");
    this.budgets = h("div", { class: "budgets", "aria-label": "Memory budgets" });
    this.columns = h("div", { class: "tier-columns" });
    this.evictions = h("div", { class: "evictions" });
    this.refreshButton = h("button", { type: "button", onclick: () => this.refresh() }, "Refresh now");
    this.element.classList.add("tiers-panel");
    this.element.replaceChildren(
      h(
        "div",
        { class: "row" },
        field("Admin key (for moving models; kept for this tab only)", this.adminKey),
        h("div", { class: "field" }, this.refreshButton),
      ),
      this.status,
      this.budgets,
      this.columns,
      this.evictions,
    );
    this.element.addEventListener("panel-shown", () => this.refresh());
    this.refresh();
    this.timer = window.setInterval(() => this.tick(), POLL_MS);
  }

  tick() {
    if (!this.element.isConnected) {
      window.clearInterval(this.timer);
      return;
    }
    if (!this.element.hidden && document.visibilityState === "visible") this.refresh();
  }

  async refresh() {
    if (this.loading) return;
    this.loading = true;
    try {
      const status = await apiJSON("v1/memory/status");
      this.draw(status);
      this.status.textContent = `updated ${new Date().toLocaleTimeString()}`;
      this.status.classList.remove("error");
    } catch (error) {
      this.status.textContent = `GET v1/memory/status failed: ${error.message}`;
      this.status.classList.add("error");
    } finally {
      this.loading = false;
    }
  }

  draw(status) {
    const now = Date.now();
    for (const model of status.models || []) {
      const before = this.previous.get(model.id);
      if (before && before !== model.current_tier) this.moved.set(model.id, { from: before, at: now });
      this.previous.set(model.id, model.current_tier);
    }
    this.drawBudgets(status);
    // Redrawn every poll: a keyboard user's focus goes back to the same button.
    const focused = this.columns.contains(document.activeElement) ? document.activeElement.getAttribute("aria-label") : null;
    this.columns.replaceChildren(
      ...TIERS.map(([tier, title]) => {
        const models = (status.models || []).filter((m) => (m.current_tier || "tier3_nvme_ssd") === tier);
        return h(
          "section",
          { class: "tier-column", dataset: { tier }, "aria-label": title },
          h("h3", {}, title, h("span", { class: "count" }, ` (${models.length})`)),
          models.length ? models.map((m) => this.card(m, now)) : h("p", { class: "hint" }, "nothing here"),
        );
      }),
    );
    if (focused) {
      const again = [...this.columns.querySelectorAll("button")].find((b) => b.getAttribute("aria-label") === focused);
      if (again) again.focus();
    }
    this.drawEvictions(status.recent_evictions || []);
  }

  drawBudgets(status) {
    const worker = status.worker || {};
    const capabilities = status.capabilities || {};
    const tier1Total =
      worker.tier1_vram_budget_bytes ??
      (status.tier1_vram_used_bytes || 0) + (status.tier1_vram_free_bytes || 0);
    const tier2Total =
      worker.tier2_pinned_ram_budget_bytes ??
      (status.tier2_pinned_ram_used_bytes || 0) + (status.tier2_pinned_ram_free_bytes || 0);
    const device = capabilities.device_name || worker.device || "device";
    const simulated = (capabilities.simulated || worker.simulated) && !/simulated/i.test(device) ? " (simulated)" : "";
    this.budgets.replaceChildren(
      h("p", { class: "hint" }, `${device}${simulated}`),
      bar("Tier 1 · VRAM booked", status.tier1_vram_used_bytes, tier1Total, "tier1_gpu_vram"),
      bar("Tier 2 · pinned RAM", status.tier2_pinned_ram_used_bytes, tier2Total, "tier2_pinned_ram"),
      status.process_memory_cap_bytes
        ? bar("Process memory", status.process_memory_bytes, status.process_memory_cap_bytes, "process")
        : h("p", { class: "hint" }, `process memory ${formatBytes(status.process_memory_bytes)}`),
    );
  }

  card(model, now) {
    const placement = model.placement || {};
    const moved = this.moved.get(model.id);
    const recent = moved && now - moved.at < 60_000;
    const at = ORDER.indexOf(model.current_tier);
    const facts = [
      ["weights", formatBytes(model.total_weight_bytes)],
      ["VRAM", formatBytes((placement.vram_weight_bytes || 0) + (placement.vram_kv_and_workspace_bytes || 0))],
      ["RAM", formatBytes(placement.pinned_ram_bytes || 0)],
      ["leases", String(model.active_leases ?? 0)],
      ["slots", model.slots !== undefined ? String(model.slots) : "-"],
      ["layers", placementLayers(placement)],
      ["context", placement.allocated_context_len ? String(placement.allocated_context_len) : "-"],
      ["requests", String(model.total_requests_served ?? 0)],
      ["idle", model.idle_seconds !== undefined ? `${Math.round(model.idle_seconds)} s` : "-"],
      ["reload", formatMs(model.reload_estimate_ms)],
    ];
    const buttons = h("div", { class: "row actions" });
    ORDER.forEach((target, i) => {
      if (at >= 0 && i !== at) buttons.append(this.moveButton(model, target, i < at ? "Promote" : "Demote"));
    });
    return h(
      "article",
      {
        class: `model-card${recent ? " moved" : ""}${model.active_leases ? " leased" : ""}`,
        dataset: { model: model.id, tier: model.current_tier },
        "aria-label": `${model.id} in ${tierName(model.current_tier)}`,
      },
      h(
        "header",
        {},
        h("strong", {}, model.id),
        h("span", { class: "tag" }, model.modality || ""),
        model.priority ? h("span", { class: "tag" }, model.priority) : null,
        model.enabled === false ? h("span", { class: "tag warn" }, "disabled") : null,
        model.active_leases ? h("span", { class: "tag busy" }, "in use") : null,
      ),
      recent ? h("p", { class: "moved-note" }, `moved here from ${tierName(moved.from)}`) : null,
      h("dl", { class: "facts" }, ...facts.flatMap(([name, value]) => [h("dt", {}, name), h("dd", {}, value)])),
      model.problem ? h("p", { class: "error" }, model.problem) : null,
      buttons,
    );
  }

  moveButton(model, target, verb) {
    return h(
      "button",
      {
        type: "button",
        disabled: this.busy.has(model.id),
        "aria-label": `${verb} ${model.id} to ${tierName(target)}`,
        onclick: () => this.move(model.id, target, verb),
      },
      `${verb} to ${tierName(target)}`,
    );
  }

  async move(modelId, target, verb) {
    this.busy.add(modelId);
    this.status.textContent = `${verb.toLowerCase()}ing ${modelId} to ${tierName(target)}…`;
    this.status.classList.remove("error");
    try {
      const answer = await apiJSON(
        "v1/memory/tier",
        { model: modelId, target_tier: target },
        { key: this.adminKey.value || undefined },
      );
      this.status.textContent = answer.status === "moving" ? answer.message : `${modelId} is now in ${tierName(target)}`;
    } catch (error) {
      this.status.textContent = `${verb} ${modelId} failed (${error.status}): ${error.message}`;
      this.status.classList.add("error");
    } finally {
      this.busy.delete(modelId);
      await this.refresh();
    }
  }

  drawEvictions(evictions) {
    this.evictions.replaceChildren(
      h("h3", {}, "Recent evictions"),
      evictions.length
        ? h(
            "ul",
            {},
            ...[...evictions].reverse().map((e) =>
              h(
                "li",
                { dataset: { model: e.model } },
                h("strong", {}, e.model),
                ` to ${tierName(e.to_tier)}`,
                e.for_model ? ` for ${e.for_model}` : "",
                `: ${e.reason || "no reason given"}`,
                e.unix_ms ? h("span", { class: "hint" }, ` ${new Date(e.unix_ms).toLocaleTimeString()}`) : null,
              ),
            ),
          )
        : h("p", { class: "hint" }, "none yet"),
    );
  }
}

function placementLayers(placement) {
  const parts = [];
  if (placement.gpu_layers) parts.push(`${placement.gpu_layers} GPU`);
  if (placement.pinned_ram_layers) parts.push(`${placement.pinned_ram_layers} RAM`);
  if (placement.ssd_layers) parts.push(`${placement.ssd_layers} disk`);
  if (placement.cpu_expert_layers) parts.push(`${placement.cpu_expert_layers} CPU experts`);
  return parts.join(" · ") || "-";
}

// A labelled budget bar: <meter> for assistive technology, a drawn bar for the eye.
function bar(label, used, total, kind) {
  const fraction = total ? Math.min(Math.max((used || 0) / total, 0), 1) : 0;
  return h(
    "div",
    { class: "budget", dataset: { budget: kind } },
    h("span", { class: "budget-label" }, label),
    h(
      "div",
      {
        class: "bar",
        role: "meter",
        "aria-label": label,
        "aria-valuemin": "0",
        "aria-valuemax": String(total || 0),
        "aria-valuenow": String(used || 0),
        "aria-valuetext": `${formatBytes(used)} of ${formatBytes(total)}`,
      },
      h("div", { class: "fill", style: `width: ${(fraction * 100).toFixed(1)}%` }),
    ),
    h("span", { class: "budget-figure" }, `${formatBytes(used)} of ${formatBytes(total)}`),
  );
}

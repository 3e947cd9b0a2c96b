// The API reference page (/docs): Swagger UI on the schema the server generates (/v1/openapi.json).
// "Authorize" takes an API key; it stays in this page and is sent as Authorization: Bearer.
window.addEventListener("DOMContentLoaded", () => {
  const root = document.getElementById("swagger-ui");
  window.ui = window.SwaggerUIBundle({
    url: root.dataset.schemaUrl,
    domNode: root,
    deepLinking: true,
    presets: [window.SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});

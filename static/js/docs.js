// Boots Swagger UI for /docs. A file, not an inline script, so the page keeps the 'self'-only CSP.
const root = document.getElementById("swagger-ui");
window.SwaggerUIBundle({
  url: root.dataset.openapiUrl,
  dom_id: "#swagger-ui",
  deepLinking: true,
  // No validator badge: it would call a public validation service.
  validatorUrl: null,
});

// Boots Swagger UI for /docs. A file, not an inline script, so the page keeps the 'self'-only CSP.
const root = document.getElementById("swagger-ui");
const options = {
  dom_id: "#swagger-ui",
  deepLinking: true,
  // No validator badge: it would call a public validation service.
  validatorUrl: null,
};
// A proxy that serves this server under a path (https://host/manyeyes/docs) passes on its paths
// without that prefix, so the spec's own (/api/v1/...) would send "Try it out" outside it.
const prefix = new URL(".", window.location.href).pathname.replace(/\/$/, "");
if (prefix) {
  fetch(root.dataset.openapiUrl)
    .then((response) => (response.ok ? response.json() : Promise.reject(new Error(response.statusText))))
    .then((spec) => window.SwaggerUIBundle({ ...options, spec: { ...spec, servers: [{ url: prefix }] } }))
    .catch(() => window.SwaggerUIBundle({ ...options, url: root.dataset.openapiUrl }));
} else {
  window.SwaggerUIBundle({ ...options, url: root.dataset.openapiUrl });
}

// The URL is the permalink: text, pair, model, layer and head, restored on load and on back/forward.

export function readPermalink() {
  const params = new URLSearchParams(window.location.search);
  const int = (name) => {
    const n = Number.parseInt(params.get(name) ?? "", 10);
    return Number.isFinite(n) && n >= 0 ? n : null;
  };
  return {
    text: params.get("text") ?? "",
    pair: params.get("pair") ?? "",
    model: params.get("model") ?? "",
    layer: int("layer"),
    head: int("head"),
  };
}

export function writePermalink({ text, pair, model, layer, head }, push = false) {
  const params = new URLSearchParams({ text });
  if (pair) params.set("pair", pair);
  params.set("model", model);
  params.set("layer", layer);
  params.set("head", head);
  const url = `${window.location.pathname}?${params}`;
  if (url === window.location.pathname + window.location.search) return;
  if (push) window.history.pushState(null, "", url);
  else window.history.replaceState(null, "", url);
}

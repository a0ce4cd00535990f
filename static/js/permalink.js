// The permalink: the whole view (text, controls, chosen heads) is saved on the server under a
// content id, so the address bar holds only `?view=<id>` however long the text. Links in the old
// form (?text=…&model=…&layer=…&head=…) still open.

import { requestJson } from "./api.js";

const VIEW_ID = /^[0-9a-f]{18}$/;

// Returns { view } (an id to fetch), { badView } (a view id no link of this page holds: cut short
// when copied, say; it opened a plain page without a word), { legacy } (the old query fields) or
// {} for a plain page.
export function readPermalink() {
  const params = new URLSearchParams(window.location.search);
  const id = params.get("view");
  if (id && VIEW_ID.test(id)) return { view: id };
  if (id !== null) return { badView: id };
  if (!params.get("text")) return {};
  const int = (name) => {
    const n = Number.parseInt(params.get(name) ?? "", 10);
    return Number.isFinite(n) && n >= 0 ? n : 0;
  };
  return {
    legacy: {
      text: params.get("text"),
      text_pair: params.get("pair") || null,
      model: params.get("model") ?? "",
      layer: int("layer"),
      head: int("head"),
    },
  };
}

export function loadView(id) {
  return requestJson(`api/v1/views/${id}`);
}

export async function saveView(state) {
  const { id } = await requestJson("api/v1/views", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(state),
  });
  return id;
}

// The entry keeps the view itself too (`view`, what was saved under `id`): Back and Forward, and a
// reload, open it from there, so a server that forgot it (a restart) does not leave the address
// naming one run while another stays on screen under "This link has expired".
export function writePermalink(id, push = false, view = null) {
  const url = `${window.location.pathname}?view=${id}`;
  const entry = view ? { view, id } : null;
  // The same address again is the same entry, its view kept now (an entry opened from a link had none).
  const same = url === window.location.pathname + window.location.search;
  if (push && !same) window.history.pushState(entry, "", url);
  else window.history.replaceState(entry, "", url);
}

// The view this history entry keeps, if it is the one its address names.
export function rememberedView(id) {
  const entry = window.history.state;
  return entry && entry.id === id && entry.view ? entry.view : null;
}

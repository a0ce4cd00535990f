// "Download data": the focused matrix as CSV or JSON, with the tokens that label it.

// content: a string, or a Blob (a file the server made).
export function saveFile(name, type, content) {
  const url = URL.createObjectURL(new Blob([content], { type }));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

// Quoted always; a leading "=" or "@" (or a sign before more text) would run as a spreadsheet formula.
function csvCell(value) {
  let s = String(value);
  if (/^[=@]/.test(s) || /^[+-]./.test(s)) s = "'" + s;
  return `"${s.replace(/"/g, '""')}"`;
}

function rowsOf(view) {
  const nCols = view.cols.length;
  return view.rows.map((_, r) => view.cols.map((_k, c) => (view.masked(r, c) ? null : view.values[r * nCols + c])));
}

// Each token by its label on screen (the Labels option): a byte-level model's three byte tokens
// of 我 were three columns "我" (each token's text is the character it is part of), and MiniLM's
// [UNK] read as the character it could not read. The JSON keeps the text and offsets besides.
export function downloadCsv(name, data) {
  const { view, labels } = data;
  const header = ["query_index", "query_token", ...view.cols.map((k) => `${k}:${labels[k]}`)];
  const lines = [header.map(csvCell).join(",")];
  rowsOf(view).forEach((row, r) => {
    const q = view.rows[r];
    lines.push([csvCell(q), csvCell(labels[q]), ...row.map((v) => (v === null ? "" : v.toPrecision(7)))].join(","));
  });
  saveFile(`${name}.csv`, "text/csv", lines.join("\r\n") + "\r\n");
}

export function downloadJson(name, data, meta) {
  const { view, tokens, labels } = data;
  const describe = (i) => ({
    index: i, label: labels[i], text: tokens[i].text, piece: tokens[i].piece ?? null, start: tokens[i].start ?? null,
    end: tokens[i].end ?? null, special: tokens[i].special, segment: tokens[i].segment,
  });
  const body = {
    ...meta,
    queries: view.rows.map(describe),
    keys: view.cols.map(describe),
    attention: rowsOf(view),
  };
  saveFile(`${name}.json`, "application/json", JSON.stringify(body, null, 1));
}

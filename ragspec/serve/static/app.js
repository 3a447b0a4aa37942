// ragspec's page: POST /v1/ask with stream: true, read its server-sent events (sources, text, citation, done)
// and render the answer as it grows; every citation becomes a highlighted span linked to its source document.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { text: "", citations: [], sources: [], docs: new Map(), started: 0, firstText: 0 };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("apikey").value || localStorage.getItem("ragspec-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function renderAnswer() {
  const box = $("answer");
  box.textContent = "";
  let at = 0;
  const cits = [...state.citations].sort((a, b) => a.answer_start - b.answer_start);
  cits.forEach((c) => {
    if (c.answer_start < at) return;
    box.append(state.text.slice(at, c.answer_start));
    const m = el("mark", { "data-i": state.citations.indexOf(c), title: `[${c.source}] ${c.path} ${c.start}–${c.end}` },
                 state.text.slice(c.answer_start, c.answer_end));
    m.addEventListener("click", () => showCitation(c, m));
    box.append(m, el("sup", {}, `[${c.source}]`));
    at = c.answer_end;
  });
  box.append(state.text.slice(at));
}

function renderSources() {
  const ol = $("sources");
  ol.textContent = "";
  state.sources.forEach((s) => {
    const li = el("li", { value: s.source });
    const lines = s.lines ? `lines ${s.lines[0]}–${s.lines[1]}` : `chars ${s.start}–${s.end}`;
    li.append(el("span", { class: "path" }, s.path + (s.key ? "#" + s.key : "")), " ",
              el("span", { class: "dim" }, `${lines} · score ${s.score.toFixed(4)}`));
    li.addEventListener("click", () => showSpan(s, s.start, s.end, "chunk"));
    ol.append(li);
  });
}

async function documentText(id) {
  if (!state.docs.has(id)) {
    const r = await fetch(`/v1/documents/${id}`, { headers: headers() });
    if (!r.ok) throw new Error(`document ${id}: HTTP ${r.status}`);
    state.docs.set(id, await r.json());
  }
  return state.docs.get(id);
}

async function showSpan(source, start, end, cls) {
  const doc = await documentText(source.document_id);
  $("doc-title").textContent = `[${source.source}] ${doc.path}${doc.key ? "#" + doc.key : ""} · ${start}–${end}`;
  const pre = $("doc");
  pre.classList.remove("dim");
  pre.textContent = "";
  const span = el(cls === "chunk" ? "span" : "mark", { class: cls, id: "span" }, doc.text.slice(start, end));
  pre.append(doc.text.slice(0, start), span, doc.text.slice(end));
  span.scrollIntoView({ block: "center" });
}

function showCitation(c, markEl) {
  document.querySelectorAll("#answer mark.on").forEach((m) => m.classList.remove("on"));
  markEl.classList.add("on");
  const source = state.sources.find((s) => s.source === c.source);
  if (source) showSpan(source, c.start, c.end, "quote").catch((e) => ($("error").textContent = e.message));
}

function showStats(stats) {
  const parts = [];
  if (stats) {
    parts.push(`${stats.new_tokens} tokens in ${stats.steps} steps`);
    parts.push(`${stats.mean_accepted.toFixed(2)} tokens/step`);
    if (stats.speedup_estimate) parts.push(`speed-up ${stats.speedup_estimate.toFixed(2)}×`);
    parts.push(`${stats.decode_tokens_per_s.toFixed(1)} tok/s`);
    if (stats.prefix_reused_tokens) parts.push(`${stats.prefix_reused_tokens} prompt tokens reused`);
  }
  if (state.firstText) parts.push(`time to first token ${Math.round(state.firstText - state.started)} ms`);
  $("stats").textContent = parts.join(" · ");
}

function handle(event, data) {
  if (event === "sources") {
    state.sources = data.sources;
    renderSources();
    if (data.warnings.length) $("error").textContent = data.warnings.join(" ");
  } else if (event === "text") {
    if (data.text && !state.firstText) { state.firstText = performance.now(); showStats(null); }
    state.text += data.text;
    renderAnswer();
  } else if (event === "citation") {
    state.citations.push(data);
    renderAnswer();
  } else if (event === "done") {
    state.text = data.text;
    state.citations = data.citations;
    renderAnswer();
    showStats(data.stats);
    document.body.dataset.done = "1";
  } else if (event === "error") {
    $("error").textContent = data.error.message;
  }
}

async function ask(question) {
  Object.assign(state, { text: "", citations: [], sources: [], started: performance.now(), firstText: 0 });
  delete document.body.dataset.done;
  $("error").textContent = "";
  $("stats").textContent = "";
  renderAnswer();
  renderSources();
  const r = await fetch("/v1/ask", { method: "POST", headers: headers(), body: JSON.stringify({ question, stream: true }) });
  if (r.status === 401) {
    $("apikey").hidden = false;
    throw new Error("this server needs an API key: enter it and ask again");
  }
  if (!r.ok) {
    let msg = `HTTP ${r.status}`;
    try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) handle(event, JSON.parse(data));
    }
  }
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const q = $("question").value.trim();
  if (!q) return;
  if ($("apikey").value) localStorage.setItem("ragspec-key", $("apikey").value);
  $("go").disabled = true;
  ask(q).catch((err) => ($("error").textContent = err.message)).finally(() => ($("go").disabled = false));
});
$("question").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); }
});
fetch("/healthz").then((r) => r.json()).then((h) => {
  $("model").textContent = h.model;
  if (h.auth) $("apikey").hidden = false;
}).catch(() => {});

// memproxy inspector: a reader of the session admin API (/v1/sessions, /v1/usage, /v1/search).
// Every piece of content reaches the page through textContent (el() below), never as HTML; the
// key lives in sessionStorage and travels only as an Authorization header to this origin.
"use strict";

const KEY = "memproxy.key";
const main = document.getElementById("main");

// --- building the page: elements and text only ---------------------------------------------------

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node[name] = value;  // properties (href, type, value, open, hidden): never innerHTML
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const num = (n) => (n === null || n === undefined ? "—" : Number(n).toLocaleString("en-US"));
const cost = (c) => (c === null || c === undefined ? "—" : "$" + Number(c).toFixed(4));
const when = (t) => (t ? new Date(t * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC" : "—");
const link = (href, text, cls) => el("a", { href, class: cls }, text);
const route = (...parts) => "#/" + parts.map(encodeURIComponent).join("/");
const facts = (pairs) => el("dl", { class: "facts" },
  pairs.filter(Boolean).map(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));

function show(...nodes) {
  main.replaceChildren(...nodes.flat(Infinity).filter(Boolean));
}

function failure(error) {
  return el("p", { class: "error", role: "alert" }, error.message);
}

// --- the API ------------------------------------------------------------------------------------

async function api(path, body) {
  const init = { headers: { Authorization: "Bearer " + sessionStorage.getItem(KEY) },
                 cache: "no-store", credentials: "omit" };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch("../v1" + path, init);  // relative: the proxy may be served under a prefix
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new Error((data && data.error && data.error.message) || `HTTP ${response.status}`);
    error.status = response.status;
    throw error;
  }
  return data;
}

const sessionPath = (tenant, id, rest = "") =>
  `/sessions/${encodeURIComponent(id)}${rest}?tenant=${encodeURIComponent(tenant)}`;

// --- messages as a conversation -------------------------------------------------------------------

// A part that is not text, in a few words: an image by its URL (never inline data, which can be
// megabytes), audio and files by their name or size.
function part(p) {
  if (!p || typeof p !== "object") return JSON.stringify(p);
  if (p.type === "text" || p.type === "input_text" || p.type === "output_text") return p.text;
  if (p.type === "refusal") return "[refused] " + p.refusal;
  const url = (p.image_url && typeof p.image_url === "object") ? p.image_url.url : p.image_url;
  if (typeof url === "string") return url.startsWith("data:") ? `[image, ${size(url)} inline]` : `[image ${url}]`;
  const file = p.file || p;
  if (p.type === "file" || p.type === "input_file") {
    return `[file ${file.filename || file.file_id || ""}${file.file_data ? ", " + size(file.file_data) + " inline" : ""}]`;
  }
  if (p.type === "input_audio") return `[audio, ${size((p.input_audio || {}).data || "")} inline]`;
  const shown = JSON.stringify(p);
  return shown.length > 2000 ? shown.slice(0, 2000) + "…" : shown;
}

function size(data) {  // of base64, bare or in a data URL
  const text = String(data);
  const bytes = Math.round((text.startsWith("data:") ? text.length - text.indexOf(",") - 1 : text.length) * 3 / 4);
  return bytes >= 1048576 ? (bytes / 1048576).toFixed(1) + " MB" : Math.ceil(bytes / 1024) + " KB";
}

function text(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map(part).join("\n");
  return JSON.stringify(content, null, 2);
}

// What an assistant said aloud (its audio answer's transcript) or refused, where it wrote nothing.
function spoken(m) {
  if (m.audio && typeof m.audio.transcript === "string") return "[spoken] " + m.audio.transcript;
  if (typeof m.refusal === "string" && m.refusal) return "[refused] " + m.refusal;
  return "";
}

function pretty(args) {
  try { return JSON.stringify(JSON.parse(args), null, 2); } catch { return String(args); }
}

function message(m, position, extra) {
  const head = el("div", { class: "msg-head" },
    el("span", { class: "role" }, m.role),
    position !== undefined && el("span", { class: "muted" }, "#" + position),
    m.name && el("span", { class: "muted" }, m.name),
    m.tool_call_id && el("span", { class: "muted" }, "result of " + m.tool_call_id),
    extra);
  const calls = (m.tool_calls || []).map((c) => el("div", { class: "call" },
    el("div", { class: "call-name" }, "→ " + (c.function ? c.function.name : c.type) + "  ",
      el("span", { class: "muted" }, c.id || "")),
    el("pre", {}, pretty(c.function ? c.function.arguments : JSON.stringify(c)))));
  const body = text(m.content) || spoken(m);
  return el("div", { class: "msg role-" + String(m.role).replace(/[^a-z]/g, "") },
    head, body && el("div", { class: "content" }, body), calls);
}

const stored = (r, extra) => message(r.message, r.position, [el("span", { class: "muted" }, num(r.tokens) + " tok"), extra]);

// --- pages ----------------------------------------------------------------------------------------

function signIn(error) {
  const input = el("input", { type: "password", id: "key", autocomplete: "off", placeholder: "proxy or admin key" });
  show(el("section", { class: "card signin" },
    el("h1", {}, "Sign in"),
    el("p", { class: "muted" }, "A proxy key shows its tenant's sessions; an admin key shows every tenant's."),
    el("form", { id: "signin", onsubmit: async (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value);
      try {
        await whoAmI();
        render();
      } catch (e) {
        signOut(e);
      }
    } }, input, el("button", { type: "submit" }, "Sign in")),
    error && failure(error)));
  input.focus();
}

async function whoAmI() {
  const usage = await api("/usage");
  sessionStorage.setItem(KEY + ".tenant", usage.tenant === null ? "" : usage.tenant);
}

function signOut(error) {
  sessionStorage.removeItem(KEY);
  sessionStorage.removeItem(KEY + ".tenant");
  if (location.hash !== "#/") history.replaceState(null, "", "#/");
  header();
  signIn(error);
}

function header() {
  const tenant = sessionStorage.getItem(KEY + ".tenant");
  const signed = sessionStorage.getItem(KEY) !== null;
  document.getElementById("who").textContent = !signed ? "" : tenant ? "tenant " + tenant : "admin: every tenant";
  document.getElementById("signout").hidden = !signed;
}

function usageFacts(u) {
  return facts([["sessions", num(u.sessions)], ["turns", num(u.turns)], ["summariser calls", num(u.summary_calls)],
    ["prompt tokens", num(u.prompt_tokens)], ["completion tokens", num(u.completion_tokens)], ["cost", cost(u.cost)],
    ["tokens saved", num(u.tokens_saved)], ["deleted sessions", num(u.deleted_sessions.sessions)]]);
}

const SORTS = {
  activity: (s) => s.updated_at,
  upstream: (s) => s.usage.prompt_tokens + s.usage.completion_tokens,
  cost: (s) => s.usage.cost || 0,
  turns: (s) => s.usage.turns,
  messages: (s) => s.message_count,
};

async function listPage() {
  const admin = sessionStorage.getItem(KEY + ".tenant") === "";
  const [usage, page] = await Promise.all([api("/usage"), api("/sessions?limit=200")]);
  let sessions = page.data, next = page.next;
  const filter = el("input", { type: "search", id: "filter", placeholder: "filter by id or title" });
  const sort = el("select", { id: "sort" }, Object.keys(SORTS).map((k) => el("option", { value: k }, "sort: " + k)));
  const rows = el("tbody");
  const more = el("button", { type: "button", hidden: !next, onclick: async () => {
    const further = await api("/sessions?limit=200&after=" + encodeURIComponent(next));
    sessions = sessions.concat(further.data); next = further.next; more.hidden = !next; fill();
  } }, "Load more");
  function fill() {
    const wanted = filter.value.toLowerCase(), key = SORTS[sort.value];
    const shown = sessions.filter((s) => (s.id + " " + (s.title || "")).toLowerCase().includes(wanted))
      .sort((a, b) => key(b) - key(a));
    rows.replaceChildren(...shown.map((s) => el("tr", {},
      el("td", {}, link(route("session", s.tenant, s.id), s.id)),
      admin && el("td", {}, s.tenant),
      el("td", { class: "title" }, s.title || ""),
      el("td", { class: "when" }, when(s.updated_at)),
      el("td", { class: "n" }, num(s.message_count)), el("td", { class: "n" }, num(s.usage.turns)),
      el("td", { class: "n" }, num(s.usage.prompt_tokens + s.usage.completion_tokens)),
      el("td", { class: "n" }, cost(s.usage.cost)), el("td", { class: "n" }, num(s.usage.tokens_saved)),
      el("td", { class: "n" }, s.summary_version ? "v" + s.summary_version : "—"))));
    if (!shown.length) rows.append(el("tr", {}, el("td", { colSpan: 10, class: "muted" }, "No sessions.")));
  }
  filter.addEventListener("input", fill);
  sort.addEventListener("change", fill);
  fill();

  const query = el("input", { type: "search", id: "query", placeholder: "search what was said" });
  const hits = el("div", { id: "hits" });
  const search = el("form", { class: "row", onsubmit: async (event) => {
    event.preventDefault();
    try {
      const found = await api("/search", { query: query.value, limit: 20 });
      hits.replaceChildren(...found.data.map((h) => el("div", { class: "hit" },
        link(route("session", h.tenant, h.session_id), h.session_id),
        el("span", { class: "muted" }, ` #${h.position} · score ${h.score} · ${h.matched.join(", ")}`),
        message(h.message))), found.data.length ? null : el("p", { class: "muted" }, "No match."));
    } catch (e) { hits.replaceChildren(failure(e)); }
  } }, query, el("button", { type: "submit" }, "Search"));

  const perTenant = admin ? el("div", { id: "tenants" }) : null;
  if (admin) tenantUsage(perTenant, sessions).catch((e) => perTenant.replaceChildren(failure(e)));
  return [el("h1", {}, "Sessions"),
    el("section", { class: "card" }, el("h2", {}, admin ? "Usage, every tenant" : "Usage, tenant " + usage.tenant),
      usageFacts(usage), perTenant),
    el("section", { class: "card" }, el("h2", {}, "Search messages"), search, hits),
    el("div", { class: "row" }, filter, sort),
    el("table", { id: "sessions" }, el("thead", {}, el("tr", {},
      ["session", admin && "tenant", "title", "last activity", "messages", "turns", "tokens upstream", "cost",
        "tokens saved", "summary"].filter(Boolean).map((h) => el("th", {}, h)))), rows),
    more];
}

// Usage per tenant, for an admin key: the tenants of the sessions listed (at most 50).
async function tenantUsage(perTenant, sessions) {
  const tenants = [...new Set(sessions.map((s) => s.tenant))].sort().slice(0, 50);
  const each = await Promise.all(tenants.map((t) => api("/usage?tenant=" + encodeURIComponent(t))));
  perTenant.replaceChildren(el("table", {}, el("thead", {}, el("tr", {},
    ["tenant", "sessions", "turns", "prompt", "completion", "cost", "saved"].map((h) => el("th", {}, h)))),
  el("tbody", {}, each.map((u) => el("tr", {}, el("td", {}, u.tenant), ...[u.sessions, u.turns, u.prompt_tokens,
    u.completion_tokens].map((n) => el("td", { class: "n" }, num(n))), el("td", { class: "n" }, cost(u.cost)),
  el("td", { class: "n" }, num(u.tokens_saved)))))));
}

function sentLine(t) {
  const s = t.sent;
  if (!s) return "—";
  return [s.summary_version ? "summary v" + s.summary_version : "no summary", `${s.stored_included} kept`,
    `${s.stored_omitted} left out`, s.tool_outputs_trimmed && `${s.tool_outputs_trimmed} trimmed`,
    s.recalled.length && `${s.recalled.length} recalled`].filter(Boolean).join(" · ");
}

function summaryBox(s, open) {
  return el("details", { class: "summary", open },
    el("summary", {}, `Summary v${s.version} · covers ${num(s.covers_messages)} messages · ${num(s.tokens)} tok ` +
      `(replaced ${num(s.replaced_tokens)}) · ${s.model || ""} · ${when(s.created_at)}`),
    el("div", { class: "content" }, s.text));
}

async function sessionPage(tenant, id) {
  const s = await api(sessionPath(tenant, id));
  const chatTurns = s.turns.filter((t) => t.stored_messages > 0);
  const turnAt = new Map(chatTurns.map((t) => [t.stored_from_position, t]));  // the latest turn wins
  const covered = s.summary ? s.summary.covers_messages : 0;
  const conversation = [];
  const branchesAt = (p) => s.superseded.filter((b) => b.forked_at === p).map((b) =>
    el("details", { class: "branch" }, el("summary", {}, `Superseded branch: ${b.messages.length} message(s) ` +
      `replaced from position ${b.forked_at}`), b.messages.map((r) => stored(r))));
  for (const r of s.messages) {
    conversation.push(branchesAt(r.position));
    const t = turnAt.get(r.position);
    if (t) conversation.push(el("div", { class: "turn-mark" }, `Turn ${t.turn} · ${t.model} · ${when(t.created_at)} · `,
      link(route("turn", tenant, id, t.turn), "what was sent")));
    conversation.push(stored(r, r.position < covered && el("span", { class: "tag" }, "in summary")));
  }
  const last = s.messages.length ? s.messages[s.messages.length - 1].position : -1;
  conversation.push(s.superseded.filter((b) => b.forked_at > last).map((b) => branchesAt(b.forked_at)));
  const earlier = s.summary_history.filter((h) => !s.summary || h.version !== s.summary.version);
  return [el("p", {}, link("#/", "← sessions")),
    el("h1", {}, s.id),
    el("p", { class: "muted" }, `tenant ${s.tenant} · created ${when(s.created_at)} · last activity ${when(s.updated_at)}`),
    el("p", {}, link(route("context", tenant, id), "Preview the next request →", "button")),
    el("section", { class: "card" }, el("h2", {}, "Usage"), facts([["messages", num(s.message_count)],
      ["tokens stored", num(s.tokens_stored)], ["turns", num(s.usage.turns)], ["prompt tokens", num(s.usage.prompt_tokens)],
      ["completion tokens", num(s.usage.completion_tokens)], ["cost", cost(s.usage.cost)],
      ["tokens saved", num(s.usage.tokens_saved)]])),
    Object.keys(s.metadata || {}).length > 0 && el("details", { class: "card" }, el("summary", {}, "Metadata"),
      el("pre", {}, JSON.stringify(s.metadata, null, 2))),
    el("h2", {}, "Summaries"),
    s.summary ? summaryBox(s.summary, true) : el("p", { class: "muted" }, "No summary in use."),
    earlier.length > 0 && el("details", { class: "history" }, el("summary", {}, `Earlier versions (${earlier.length})`),
      earlier.map((h) => summaryBox(h, false))),
    el("h2", {}, "Conversation"),
    (s.system || []).map((m) => message(m, undefined, el("span", { class: "tag" }, "system prompt"))),
    el("div", { id: "conversation" }, conversation),
    el("h2", {}, "Turns"),
    el("table", { id: "turns" }, el("thead", {}, el("tr", {}, ["turn", "kind", "model", "time", "context", "prompt",
      "completion", "cost", "what was sent"].map((h) => el("th", {}, h)))),
    el("tbody", {}, s.turns.map((t) => el("tr", {}, el("td", {}, t.sent ? link(route("turn", tenant, id, t.turn), String(t.turn)) : t.turn),
      el("td", {}, t.kind), el("td", {}, t.model), el("td", {}, when(t.created_at)),
      ...[t.context_tokens, t.prompt_tokens, t.completion_tokens].map((n) => el("td", { class: "n" }, num(n))),
      el("td", { class: "n" }, cost(t.cost)), el("td", {}, sentLine(t))))))];
}

async function turnPage(tenant, id, number) {
  const s = await api(sessionPath(tenant, id));
  const t = s.turns.find((x) => String(x.turn) === number);
  if (!t) throw new Error(`No turn ${number} in this session.`);
  const back = el("p", {}, link(route("session", tenant, id), "← " + id));
  if (!t.sent) return [back, el("h1", {}, `Turn ${t.turn}`), el("p", { class: "muted" }, `A ${t.kind} turn: no record of what was sent.`)];
  const sent = t.sent, at = new Map(s.messages.map((r) => [r.position, r]));
  const range = (from, to) => { const out = []; for (let p = from; p < to; p++) if (at.has(p)) out.push(stored(at.get(p))); return out; };
  const head = Math.max(0, sent.stored_included - (t.stored_from_position - sent.from_position));
  const summary = s.summary_history.find((h) => h.version === sent.summary_version);
  return [back, el("h1", {}, `Turn ${t.turn}: what was sent, and why`),
    el("p", { class: "muted" }, `${t.model} · ${when(t.created_at)} · ${num(t.context_tokens)} tokens sent · ` +
      `prompt ${num(t.prompt_tokens)}, completion ${num(t.completion_tokens)}, cost ${cost(t.cost)}`),
    el("section", { class: "card", id: "sent" }, facts([
      ["summary sent", sent.summary_version ? `v${sent.summary_version}` : "none"],
      ["stored messages sent", `${num(sent.stored_included)} (from position ${sent.from_position}${head ? `, and the first ${head} as the head` : ""})`],
      ["stored messages left out", num(sent.stored_omitted)],
      ["left out with no summary for them", num(sent.unsummarised_omitted)],
      ["marker saying so", sent.marker ? "yes" : "no"],
      ["tool outputs trimmed", num(sent.tool_outputs_trimmed)],
      ["repeats deduplicated", num(sent.deduplicated)],
      ["recalled", sent.recalled.length ? sent.recalled.map((r) => `${r.session_id} #${r.position}`).join(", ") : "none"],
      ["messages this turn stored", `${num(t.stored_messages)} from position ${t.stored_from_position}`]])),
    summary && summaryBox(summary, true),
    el("p", { class: "muted" }, "Messages by position on the current branch (an edit since may have replaced some)."),
    sent.from_position > head && el("details", { class: "left-out" },
      el("summary", {}, `Left out: positions ${head}–${sent.from_position - 1}`), range(head, sent.from_position)),
    sent.recalled.length > 0 && el("section", { class: "recalled" }, el("h2", {}, "Recalled"),
      sent.recalled.map((r) => (r.session_id === id && at.has(r.position) ? stored(at.get(r.position)) :
        el("p", {}, link(route("session", tenant, r.session_id), r.session_id), ` #${r.position}`)))),
    el("h2", {}, "Kept"), head > 0 && range(0, head), range(sent.from_position, t.stored_from_position),
    el("h2", {}, "New in this turn, and the answer"), range(t.stored_from_position, t.stored_from_position + t.stored_messages)];
}

async function contextPage(tenant, id) {
  const c = await api(sessionPath(tenant, id, "/context"));
  const detail = (p) => Object.entries(p).filter(([k]) => !["part", "messages", "tokens", "excerpts"].includes(k))
    .map(([k, v]) => `${k.replace(/_/g, " ")}: ${Array.isArray(v) ? v.join(" ") : v}`).join(" · ");
  const recalled = c.parts.find((p) => p.part === "recalled");
  return [el("p", {}, link(route("session", tenant, id), "← " + id)),
    el("h1", {}, "The next request"),
    el("p", { class: "muted" }, `What the session's next turn would send to ${c.model}, part by part (for a client sending only its new messages).`),
    el("section", { class: "card" }, facts([["tokens", `${num(c.tokens)} of ${num(c.budget.input_tokens)} allowed`],
      ["window", num(c.budget.window)], ["output reserve", num(c.budget.output_reserve)],
      ["safety margin", num(c.budget.safety_margin)], ["would summarise first", c.would_summarize ? "yes" : "no"],
      ["expired", c.expired ? "yes: the next turn starts afresh" : "no"]])),
    el("table", { id: "parts" }, el("thead", {}, el("tr", {}, ["part", "messages", "tokens", "", "details"].map((h) => el("th", {}, h)))),
      el("tbody", {}, c.parts.map((p) => el("tr", {}, el("td", {}, p.part.replace(/_/g, " ")),
        el("td", { class: "n" }, num(p.messages)), el("td", { class: "n" }, num(p.tokens)),
        el("td", {}, el("progress", { max: Math.max(1, c.budget.input_tokens), value: p.tokens || 0 })),
        el("td", { class: "muted" }, detail(p)))))),
    recalled && recalled.excerpts.length > 0 && el("p", {}, "Recalled: ",
      recalled.excerpts.map((r) => `${r.session_id} #${r.position} (${r.role}${r.hit ? ", matched " + r.matched.join(" ") : ""})`).join("; ")),
    el("h2", {}, "Messages as sent"),
    el("div", { id: "sent-messages" }, c.messages.map((m, i) => message(m, undefined, el("span", { class: "muted" }, "sent " + (i + 1)))))];
}

// --- routing --------------------------------------------------------------------------------------

let rendering = 0;

async function render() {
  header();
  if (sessionStorage.getItem(KEY) === null) return signIn();
  const [page, ...args] = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const pages = { session: sessionPage, turn: turnPage, context: contextPage };
  const mine = ++rendering;  // a page still loading when another is asked for is never shown
  show(el("p", { class: "muted" }, "Loading…"));
  try {
    const nodes = await (pages[page] || listPage)(...args);
    if (mine !== rendering) return;
    show(nodes);
    window.scrollTo(0, 0);
  } catch (e) {
    if (mine !== rendering) return;
    if (e.status === 401) return signOut(e);
    show(el("p", {}, link("#/", "← sessions")), failure(e));
  }
}

document.getElementById("signout").addEventListener("click", () => signOut());
window.addEventListener("hashchange", render);
render();

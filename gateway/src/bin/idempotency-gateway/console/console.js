// The gateway's console: a thin client of its admin API. The token lives
// in this tab's sessionStorage and goes in the Authorization header, never
// in a URL; every value a sender chose is written as text (textContent),
// never as HTML.
"use strict";
const $ = (id) => document.getElementById(id);
let token = sessionStorage.getItem("gateway-admin-token") || "";

function say(text) { $("status").textContent = text; }

async function api(method, path) {
  const res = await fetch(path, { method, headers: { Authorization: "Bearer " + token }, cache: "no-store" });
  let body = null;
  try { body = await res.json(); } catch (_) { body = { error: "not JSON" }; }
  if (!res.ok) { throw new Error(res.status + ": " + (body && body.error ? body.error : "")); }
  return body;
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  row.appendChild(td);
  return td;
}

function button(row, text, id, onclick) {
  const td = document.createElement("td");
  const b = document.createElement("button");
  b.type = "button"; b.textContent = text; b.id = id;
  b.addEventListener("click", () => onclick().catch((e) => say(e.message)));
  td.appendChild(b); row.appendChild(td);
}

function slug(s) { return String(s).replace(/[^A-Za-z0-9]/g, "_"); }
const q = (pairs) => new URLSearchParams(pairs.filter(([, v]) => v)).toString();

async function routes() {
  const body = await api("GET", "/admin/routes");
  const tbody = $("routes").tBodies[0];
  tbody.replaceChildren();
  for (const r of body.routes) {
    const tr = document.createElement("tr");
    tr.id = "route-" + slug(r.prefix);
    cell(tr, r.prefix); cell(tr, r.preset); cell(tr, r.mode);
    const p = cell(tr, r.paused ? "paused since " + r.paused.since + " by " + r.paused.by + ": " + r.paused.reason : "no");
    if (r.paused) { p.className = "paused"; }
    cell(tr, r.queue ? r.queue.depth + " queued, " + r.queue.dead_letters + " dead (whole queue)" : "");
    const verb = r.paused ? "resume" : "pause";
    button(tr, r.paused ? "Resume" : "Pause", verb + "-" + slug(r.prefix), async () => {
      const pairs = [["prefix", r.prefix]];
      if (verb === "pause") { pairs.push(["by", "console"], ["reason", $("pause-reason").value]); }
      await api("POST", "/admin/routes/" + verb + "?" + q(pairs));
      await routes();
    });
    tbody.appendChild(tr);
  }
}

function deadFilters() { return [["route", $("dead-route").value], ["error", $("dead-error").value]]; }

async function dead() {
  const body = await api("GET", "/admin/dead?" + q(deadFilters().concat([["limit", "100"]])));
  const tbody = $("dead").tBodies[0];
  tbody.replaceChildren();
  for (const d of body.dead_letters) {
    const tr = document.createElement("tr");
    tr.id = "dead-" + slug(d.id);
    const id = cell(tr, d.id);
    id.addEventListener("click", () => showDead(d.id).catch((e) => say(e.message)));
    cell(tr, d.key); cell(tr, d.path); cell(tr, d.attempts); cell(tr, d.error);
    button(tr, "Replay", "replay-" + slug(d.id), async () => {
      await api("POST", "/admin/dead/" + encodeURIComponent(d.id) + "/replay");
      say("replayed " + d.id);
      await dead();
    });
    tbody.appendChild(tr);
  }
  $("dead-summary").textContent = body.dead_letters.length + " shown of " + body.total + (body.next_cursor ? " (more: narrow the filters)" : "");
}

async function showDead(id) {
  const d = await api("GET", "/admin/dead/" + encodeURIComponent(id));
  let body = "";
  try { body = new TextDecoder().decode(Uint8Array.from(atob(d.body_base64), (c) => c.charCodeAt(0))); } catch (_) { body = "(not text)"; }
  const lines = ["id: " + d.id, "key: " + d.key, d.method + " " + d.uri, "attempts: " + d.attempts, "dead at: " + d.dead_at];
  for (const a of d.attempt_errors) { if (a.error) { lines.push("attempt " + a.attempt + ": " + a.error); } }
  for (const h of d.headers) { lines.push(h.name + ": " + h.value); }
  lines.push("", body);
  $("dead-detail").textContent = lines.join("\n");
}

async function journal() {
  const id = $("journal-id").value;
  let records;
  if (id) {
    const body = await api("GET", "/admin/keys?" + q([["id", id], ["route", $("journal-route").value]]));
    records = body.matches.map((m) => m.journal);
  } else {
    const body = await api("GET", "/admin/journal?" + q([["route", $("journal-route").value], ["outcome", $("journal-outcome").value], ["limit", "100"]]));
    records = body.records;
  }
  const tbody = $("journal").tBodies[0];
  tbody.replaceChildren();
  for (const r of records) {
    const tr = document.createElement("tr");
    tr.className = "journal-record";
    const k = cell(tr, r.key);
    k.addEventListener("click", () => { $("journal-detail").textContent = JSON.stringify(r, null, 2); $("key").value = r.key; });
    cell(tr, r.route); cell(tr, r.copies); cell(tr, r.last_seen);
    tbody.appendChild(tr);
  }
}

async function inspectKey() {
  const body = await api("GET", "/admin/keys/" + encodeURIComponent($("key").value));
  $("key-detail").textContent = JSON.stringify(body, null, 2);
}

async function forgetKey() {
  const body = await api("DELETE", "/admin/keys/" + encodeURIComponent($("key").value) + "?" + q([["by", "console"]]));
  $("key-detail").textContent = JSON.stringify(body, null, 2);
}

async function start() {
  await routes();
  $("login").hidden = true; $("main").hidden = false;
  say("");
  await dead().catch((e) => { $("dead-summary").textContent = e.message; });
}

function on(id, event, f) {
  $(id).addEventListener(event, (e) => { e.preventDefault(); f().catch((err) => say(err.message)); });
}

document.addEventListener("DOMContentLoaded", () => {
  on("login", "submit", async () => {
    token = $("token").value.trim();
    sessionStorage.setItem("gateway-admin-token", token);
    $("token").value = "";
    await start();
  });
  on("dead-filter", "submit", dead);
  on("dead-dry-run", "click", async () => {
    const body = await api("POST", "/admin/dead/replay?" + q(deadFilters().concat([["dry_run", "true"]])));
    $("dead-summary").textContent = "would replay " + body.matched + " of " + body.dead_letters;
    $("dead-replay-filtered").disabled = false;
  });
  on("dead-replay-filtered", "click", async () => {
    const body = await api("POST", "/admin/dead/replay?" + q(deadFilters()));
    $("dead-replay-filtered").disabled = true;
    say("replayed " + body.replayed);
    await dead();
  });
  on("journal-filter", "submit", journal);
  on("key-form", "submit", inspectKey);
  on("key-forget", "click", forgetKey);
  if (token) { start().catch((e) => say(e.message)); }
});

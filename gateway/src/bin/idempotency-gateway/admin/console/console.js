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
  for (const a of d.attempt_errors) { lines.push("attempt " + a.attempt + " at " + a.at + ": " + a.error); }
  if (d.attempts_not_kept > 0) { lines.push(d.attempts_not_kept + " other attempts not kept"); }
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

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

function plot(canvas, series, top) {
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  g.strokeStyle = "#ccc"; g.strokeRect(0, 0, canvas.width, canvas.height);
  series.forEach((points, i) => {
    if (points.length < 2) { return; }
    g.strokeStyle = COLORS[i % COLORS.length]; g.beginPath();
    points.forEach((y, x) => {
      const px = (x / (points.length - 1)) * canvas.width;
      const py = canvas.height - (top > 0 ? (y / top) : 0) * (canvas.height - 4) - 2;
      if (x === 0) { g.moveTo(px, py); } else { g.lineTo(px, py); }
    });
    g.stroke();
  });
}

async function charts() {
  const body = await api("GET", "/admin/stats");
  const s = body.samples;
  const outcomes = [...new Set(s.flatMap((x) => Object.keys(x.requests)))].sort();
  const rates = outcomes.map((o) => s.slice(1).map((x, i) => {
    const dt = (x.at_ms - s[i].at_ms) / 1000;
    return dt > 0 ? Math.max(0, ((x.requests[o] || 0) - (s[i].requests[o] || 0)) / dt) : 0;
  }));
  const top = Math.max(1, ...rates.flat());
  plot($("chart-rate"), rates, top);
  $("chart-rate-legend").textContent = "requests per second by outcome (top " + top.toFixed(1) + "/s): " +
    outcomes.map((o, i) => o + " " + COLORS[i % COLORS.length]).join(", ");
  const dup = ["replayed", "waited"];
  const ratio = s.slice(1).map((x, i) => {
    let all = 0, dups = 0;
    for (const o of outcomes) {
      const d = (x.requests[o] || 0) - (s[i].requests[o] || 0);
      all += d; if (dup.includes(o)) { dups += d; }
    }
    return all > 0 ? dups / all : 0;
  });
  plot($("chart-ratio"), [ratio], 1);
  const last = ratio.length ? ratio[ratio.length - 1] : 0;
  $("chart-ratio-legend").textContent = "duplicate ratio (replayed and waited of all), now " + (100 * last).toFixed(1) + " %";
}

async function start() {
  await routes();
  $("login").hidden = true; $("main").hidden = false;
  say("");
  await dead().catch((e) => { $("dead-summary").textContent = e.message; });
  await charts().catch((e) => say(e.message));
  setInterval(() => { charts().catch((e) => say(e.message)); routes().catch((e) => say(e.message)); }, 5000);
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

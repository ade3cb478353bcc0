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

// The last stats read: the duplicate ratio of each preset, for the routes.
let lastRatio = {};

function age(seconds) {
  if (seconds === null || seconds === undefined) { return ""; }
  if (seconds < 60) { return seconds.toFixed(0) + " s"; }
  if (seconds < 3600) { return (seconds / 60).toFixed(0) + " min"; }
  return (seconds / 3600).toFixed(1) + " h";
}

// An entry that waited longer than this makes a route ask for attention.
const OLD_ENTRY_S = 60;

async function routes() {
  const body = await api("GET", "/admin/routes");
  const tbody = $("routes").tBodies[0];
  tbody.replaceChildren();
  const attention = [];
  let queued = false;
  for (const r of body.routes) {
    const tr = document.createElement("tr");
    tr.id = "route-" + slug(r.prefix);
    cell(tr, r.prefix); cell(tr, r.preset); cell(tr, r.mode === "ack_then_deliver" ? "ack then deliver" : r.mode);
    cell(tr, [r.upstream].concat(r.destinations || []).filter(Boolean).join(", "));
    const p = cell(tr, r.paused ? "paused since " + r.paused.since + " by " + r.paused.by + ": " + r.paused.reason : "no");
    if (r.paused) { p.className = "paused"; attention.push(r.prefix + " is paused"); }
    if (r.queue) {
      queued = true;
      const old = r.queue.oldest_s !== null && r.queue.oldest_s !== undefined && r.queue.oldest_s > OLD_ENTRY_S;
      const qc = cell(tr, r.queue.depth + " queued" + (r.queue.depth > 0 && r.queue.oldest_s !== null ? ", oldest " + age(r.queue.oldest_s) : ""));
      if (old) { qc.className = "attention"; attention.push(r.prefix + ": an entry has waited " + age(r.queue.oldest_s)); }
    } else {
      cell(tr, "none (synchronous)");
    }
    const b = cell(tr, r.breaker || (r.queue ? "closed" : ""));
    if (r.breaker && r.breaker !== "closed") { b.className = "attention"; attention.push(r.prefix + ": breaker " + r.breaker); }
    const d = cell(tr, r.queue ? String(r.queue.dead_letters) + (r.queue.scope === "queue" ? " (whole queue)" : "") : "");
    if (r.queue && r.queue.dead_letters > 0) { d.className = "attention"; }
    const ratio = lastRatio[r.preset];
    cell(tr, ratio === undefined ? "" : (100 * ratio).toFixed(1) + " %");
    const verb = r.paused ? "resume" : "pause";
    button(tr, r.paused ? "Resume" : "Pause", verb + "-" + slug(r.prefix), async () => {
      const pairs = [["prefix", r.prefix]];
      if (verb === "pause") { pairs.push(["by", "console"], ["reason", $("pause-reason").value]); }
      await api("POST", "/admin/routes/" + verb + "?" + q(pairs));
      await routes();
    });
    tbody.appendChild(tr);
  }
  const dead = body.routes.find((r) => r.queue && r.queue.dead_letters > 0);
  if (dead) { attention.push(dead.queue.dead_letters + " dead letters"); }
  const health = $("health");
  if (attention.length === 0) {
    health.className = "fine";
    health.textContent = "Everything is fine: " + body.routes.length + " route" + (body.routes.length === 1 ? "" : "s") +
      ", none paused, no breaker open, no dead letters" + (queued ? ", nothing waiting over " + OLD_ENTRY_S + " s" : "") + ".";
  } else {
    health.className = "attention";
    health.textContent = "Needs attention: " + attention.join("; ") + ".";
  }
  // Dead letters exist only on routes that acknowledge then deliver.
  $("dead-section").hidden = !queued;
  return queued;
}

function deadFilters() { return [["route", $("dead-route").value], ["destination", $("dead-destination").value], ["error", $("dead-error").value]]; }

async function dead() {
  const body = await api("GET", "/admin/dead?" + q(deadFilters().concat([["limit", "100"]])));
  const tbody = $("dead").tBodies[0];
  tbody.replaceChildren();
  for (const d of body.dead_letters) {
    const tr = document.createElement("tr");
    tr.id = "dead-" + slug(d.id);
    const id = cell(tr, d.id);
    id.addEventListener("click", () => showDead(d.id).catch((e) => say(e.message)));
    cell(tr, d.key); cell(tr, d.destination ? d.path + " → " + d.destination : d.path); cell(tr, d.attempts); cell(tr, d.error);
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
    cell(tr, r.route);
    // What became of it, as the journal says: `stale`, `executed`, `replayed ×2`.
    const outcomes = Object.entries(r.outcomes || {}).map(([o, n]) => (n > 1 ? o + " ×" + n : o));
    cell(tr, outcomes.join(", ")).className = "journal-outcomes";
    cell(tr, r.copies); cell(tr, r.last_seen);
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

// One colour per outcome, each distinct, the same on every chart and every
// reload; an outcome this page does not know takes the next unused colour.
const OUTCOME_COLORS = {
  executed: "#1f77b4", replayed: "#2ca02c", waited: "#98df8a", failed: "#d62728",
  in_flight_rejected: "#ff7f0e", mismatch: "#9467bd", key_missing: "#8c564b",
  rejected_bad_input: "#e377c2", store_error: "#7f7f7f", lease_lost: "#bcbd22",
  passed_through: "#17becf", run_limit_exceeded: "#aec7e8", reply_deadline: "#ffbb78",
  completion_abandoned: "#ff9896", unverified: "#c5b0d5", panicked: "#000000",
  shed: "#c49c94", too_many_copies: "#f7b6d2", stale: "#dbdb8d",
};

function colorsFor(names) {
  const used = new Set();
  const out = {};
  for (const n of names) { if (OUTCOME_COLORS[n]) { out[n] = OUTCOME_COLORS[n]; used.add(out[n]); } }
  let hue = 0;
  for (const n of names) {
    if (out[n]) { continue; }
    let c;
    do { c = "hsl(" + Math.round(hue % 360) + ", 70%, 40%)"; hue += 137.5; } while (used.has(c));
    out[n] = c; used.add(c);
  }
  return out;
}

function clock(ms) {
  const d = new Date(ms);
  return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0");
}

// Draws `series` ({name, color, points: [[at_ms, value]]}) with a value
// axis from 0 to `top` labelled in `unit` and a time axis; the axes'
// labels also go in the canvas's data-y-axis and data-x-axis.
function plot(canvas, series, top, unit, format) {
  const g = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height;
  const left = 64, right = 8, topPad = 8, bottom = 22;
  const w = W - left - right, h = H - topPad - bottom;
  g.clearRect(0, 0, W, H);
  g.font = "11px system-ui, sans-serif";
  const all = series.flatMap((s) => s.points.map((p) => p[0]));
  const t0 = all.length ? Math.min(...all) : Date.now() - 3600e3;
  const t1 = all.length ? Math.max(...all) : Date.now();
  const x = (t) => left + (t1 > t0 ? (t - t0) / (t1 - t0) : 1) * w;
  const y = (v) => topPad + h - (top > 0 ? Math.min(v, top) / top : 0) * h;
  // Value axis: 0, half and top, with the unit.
  g.strokeStyle = "#ddd"; g.fillStyle = "#444"; g.textAlign = "right"; g.textBaseline = "middle";
  const ticks = [0, top / 2, top];
  for (const v of ticks) {
    g.beginPath(); g.moveTo(left, y(v)); g.lineTo(W - right, y(v)); g.stroke();
    g.fillText(format(v) + " " + unit, left - 4, y(v));
  }
  // Time axis: the first, middle and last sample's clock time.
  g.textAlign = "center"; g.textBaseline = "top";
  const times = [t0, (t0 + t1) / 2, t1];
  times.forEach((t, i) => {
    g.textAlign = i === 0 ? "left" : i === 2 ? "right" : "center";
    g.fillText(clock(t), x(t), topPad + h + 4);
  });
  g.strokeStyle = "#888"; g.beginPath(); g.moveTo(left, topPad); g.lineTo(left, topPad + h); g.lineTo(W - right, topPad + h); g.stroke();
  for (const s of series) {
    if (s.points.length < 2) { continue; }
    g.strokeStyle = s.color; g.lineWidth = 2; g.beginPath();
    s.points.forEach(([t, v], i) => { if (i === 0) { g.moveTo(x(t), y(v)); } else { g.lineTo(x(t), y(v)); } });
    g.stroke(); g.lineWidth = 1;
  }
  canvas.dataset.yAxis = ticks.map((v) => format(v) + " " + unit).join(" | ");
  canvas.dataset.xAxis = times.map(clock).join(" | ");
}

function legend(ul, series) {
  ul.replaceChildren();
  for (const s of series) {
    const li = document.createElement("li");
    li.className = "series";
    li.dataset.color = s.color;
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.backgroundColor = s.color;
    const name = document.createElement("span");
    name.textContent = s.label;
    li.append(sw, name);
    ul.appendChild(li);
  }
}

async function charts() {
  const body = await api("GET", "/admin/stats");
  const s = body.samples;
  lastRatio = s.length ? (s[s.length - 1].duplicate_ratio || {}) : {};
  const outcomes = [...new Set(s.flatMap((x) => Object.keys(x.requests)))].sort();
  const colors = colorsFor(outcomes);
  const rates = outcomes.map((o) => ({
    name: o, color: colors[o],
    points: s.slice(1).map((x, i) => {
      const dt = (x.at_ms - s[i].at_ms) / 1000;
      return [x.at_ms, dt > 0 ? Math.max(0, ((x.requests[o] || 0) - (s[i].requests[o] || 0)) / dt) : 0];
    }),
  }));
  const top = Math.max(1, ...rates.flatMap((r) => r.points.map((p) => p[1])));
  plot($("chart-rate"), rates, top, "/s", (v) => v.toFixed(v < 10 ? 1 : 0));
  for (const r of rates) {
    const now = r.points.length ? r.points[r.points.length - 1][1] : 0;
    r.label = r.name + " (now " + now.toFixed(1) + "/s)";
  }
  legend($("chart-rate-legend"), rates);
  const dup = ["replayed", "waited"];
  const ratio = s.slice(1).map((x, i) => {
    let all = 0, dups = 0;
    for (const o of outcomes) {
      const d = (x.requests[o] || 0) - (s[i].requests[o] || 0);
      all += d; if (dup.includes(o)) { dups += d; }
    }
    return [x.at_ms, all > 0 ? 100 * dups / all : 0];
  });
  const last = ratio.length ? ratio[ratio.length - 1][1] : 0;
  const series = [{ name: "duplicate ratio", color: "#9467bd", points: ratio, label: "duplicate ratio (replayed and waited of all), now " + last.toFixed(1) + " %" }];
  plot($("chart-ratio"), series, 100, "%", (v) => v.toFixed(0));
  legend($("chart-ratio-legend"), series);
}

async function refresh() {
  await charts().catch((e) => say(e.message));
  return routes();
}

async function start() {
  const queued = await refresh();
  $("login").hidden = true; $("main").hidden = false;
  say("");
  if (queued) { await dead().catch((e) => { $("dead-summary").textContent = e.message; }); }
  setInterval(() => { refresh().catch((e) => say(e.message)); }, 5000);
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

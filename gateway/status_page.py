"""The admin listener's status page: one static HTML file with plain JS, no build step.

The page carries no data: it is served without a key, and its script fetches ``/admin/pods`` and
``/admin/rollouts`` (with the admin key the operator pasted, kept in ``sessionStorage`` and sent as a
header, never in a URL) and ``/metrics`` (for the shed counters) every 2 s. Everything from the
gateway goes into the DOM through ``textContent``, so a pod name or a reason cannot become markup.
The inline script and style are pinned by hash in the Content-Security-Policy, so nothing else runs.
"""

from __future__ import annotations

import base64
import hashlib

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; background: #fafafa; }
h1 { font-size: 1.4em; margin: 0 0 .3em; } h2 { font-size: 1.15em; margin: 1.2em 0 .4em; }
h3 { font-size: 1em; margin: .8em 0 .3em; }
table { border-collapse: collapse; margin: .2em 0 .8em; background: #fff; }
th, td { border: 1px solid #ccc; padding: .2em .5em; text-align: left; vertical-align: top; }
th { background: #eee; font-weight: 600; }
.ok { color: #176f2c; font-weight: 600; } .bad { color: #b00020; font-weight: 600; }
.warn { color: #9a5b00; font-weight: 600; } .muted { color: #777; }
#bar { display: flex; gap: .6em; align-items: center; flex-wrap: wrap; }
#refresh { margin-left: auto; } .mono { font-family: ui-monospace, monospace; font-size: .9em; }
"""

SCRIPT = r"""
"use strict";
const KEY = "sluicegate.adminKey";
const REFRESH_MS = 2000;
const DASH = "\u2013";  // shown for "no value"

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}
function row(cells, header) {
  const tr = el("tr");
  for (const cell of cells) {
    const td = el(header ? "th" : "td");
    if (cell instanceof Node) td.appendChild(cell);
    else td.textContent = cell === null || cell === undefined ? DASH : String(cell);
    tr.appendChild(td);
  }
  return tr;
}
function table(head, rows) {
  const t = el("table");
  t.appendChild(row(head, true));
  for (const r of rows) t.appendChild(r instanceof Node ? r : row(r));
  return t;
}
function num(x, digits) { return typeof x === "number" ? x.toFixed(digits) : DASH; }
function pct(x) { return typeof x === "number" ? (x * 100).toFixed(0) + " %" : DASH; }
function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? {"authorization": "Bearer " + key} : {};
}
async function getJSON(path) {
  const resp = await fetch(path, {headers: headers(), cache: "no-store"});
  let body = null;
  try { body = await resp.json(); } catch (_) { /* not JSON */ }
  if (!resp.ok) {
    const message = body && body.error && body.error.message ? body.error.message : "HTTP " + resp.status;
    throw new Error(path + ": " + message);
  }
  return body;
}
async function shedCounts() {
  const resp = await fetch("/metrics", {cache: "no-store"});
  if (!resp.ok) throw new Error("/metrics: HTTP " + resp.status);
  const counts = [];
  for (const line of (await resp.text()).split("\n")) {
    const m = /^sluicegate_shed_total\{([^}]*)\}\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const pair of m[1].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    const n = Number(m[2]);
    counts.push({model: labels.model, criticality: labels.criticality, reason: labels.reason, n});
  }
  return counts;
}

function healthCell(state) {
  const cls = state.health === "healthy" ? "ok" : state.health === "unhealthy" ? "bad" : "warn";
  return el("span", state.health, cls);
}
function breakerCell(state, reason) {
  const span = el("span", state, state === "closed" ? "ok" : "bad");
  if (reason) { const wrap = el("span"); wrap.append(span, " " + reason); return wrap; }
  return span;
}
function renderPods(data) {
  const box = document.getElementById("pods");
  box.replaceChildren();
  const groups = new Map();
  for (const pod of data.pods) {
    const gpu = pod.mig ? pod.mig.gpu_uuid || "GPU (unknown uuid)" : "no MIG identity";
    if (!groups.has(gpu)) groups.set(gpu, []);
    groups.get(gpu).push(pod);
  }
  if (!groups.size) box.appendChild(el("p", "No pods.", "muted"));
  for (const [gpu, pods] of groups) {
    box.appendChild(el("h3", gpu, "mono"));
    pods.sort((a, b) => slice(a).localeCompare(slice(b)) || a.name.localeCompare(b.name));
    const rows = pods.map(pod => {
      const s = pod.state, load = s.load;
      const tr = row([slice(pod), pod.name, healthCell(s), s.device_fault || s.health_reason,
        breakerCell(s.breaker.pressure, s.breaker.pressure_reason),
        breakerCell(s.breaker.outlier, s.breaker.outlier_reason),
        load.fresh ? pct(load.kv_cache_usage) : "stale", load.waiting, load.running, s.in_flight,
        pod.models.join(", ")]);
      tr.dataset.pod = pod.name;
      return tr;
    });
    box.appendChild(table(["MIG slice", "pod", "health", "reason", "pressure breaker", "outlier breaker",
      "KV cache", "waiting", "running", "in flight", "models"], rows));
  }
}
function slice(pod) {
  const m = pod.mig;
  if (!m) return "whole GPU";
  const gi = m.gpu_instance_id;
  const where = gi === null || gi === undefined ? "" : " @ GI " + gi;
  return (m.profile || "slice") + where + (m.mig_uuid ? " " + m.mig_uuid : "");
}

function renderShedding(pods, counts) {
  const box = document.getElementById("shedding");
  box.replaceChildren();
  const flags = [["failing open (no fresh pressure data)", pods.failing_open],
                 ["panic (routing across every live pod)", pods.panic]];
  for (const [what, models] of flags) {
    const p = el("p");
    p.append(what + ": ", models.length ? el("span", models.join(", "), "bad") : el("span", "none", "ok"));
    box.appendChild(p);
  }
  const shed = counts.filter(c => c.n > 0);
  box.appendChild(shed.length
    ? table(["model", "criticality", "reason", "shed"],
            shed.map(c => [c.model, c.criticality, c.reason, c.n]))
    : el("p", "Nothing shed since start.", "muted"));
}

function renderRollouts(data) {
  const box = document.getElementById("rollouts");
  box.replaceChildren();
  if (!data.rollouts.length) box.appendChild(el("p", "No rollouts.", "muted"));
  for (const r of data.rollouts) {
    const section = el("section");
    section.dataset.rollout = r.route;
    const stateCls = r.state === "rolled_back" ? "bad" : r.state === "promoted" ? "ok" : "warn";
    const h = el("h3", r.route + " ");
    h.appendChild(el("span", r.state, stateCls + " rollout-state"));
    section.appendChild(h);
    const now = r.step_started_at + r.hold_elapsed_s;  // the server's clock, as the history's "at"
    section.appendChild(table(["step", "weights", "hold", "min samples", "on rollback"], [[
      (r.step + 1) + " of " + r.steps.length + " (" + r.steps.join(" → ") + " %)",
      Object.entries(r.weights).map(([v, w]) => v + " " + w + " %").join(", "),
      num(r.hold_elapsed_s, 0) + " s of " + num(r.min_hold_s, 0) + " s", r.min_samples, r.on_rollback]]));
    section.appendChild(table(["variant", "clean samples", "infra samples (not held against it)"],
      Object.entries(r.samples).map(([v, s]) => [v, s.clean, s.infra])));
    const last = r.history.length ? r.history[r.history.length - 1] : null;
    const verdict = r.verdict || (last && last.evidence);
    if (verdict) {
      section.appendChild(el("p", "Judge: " + verdict.decision + " " + DASH + " " + verdict.reason));
      section.appendChild(table(["metric", "n stable", "n canary", "stable", "canary", "effect", "margin",
        "statistic", "threshold", "triggered"], verdict.metrics.map(m => {
          const tr = row([m.metric, m.n_stable, m.n_canary, num(m.stable, 4), num(m.canary, 4),
            num(m.effect, 3), num(m.margin, 3), num(m.statistic, 2), num(m.threshold, 2),
            m.triggered ? el("span", "yes", "bad") : "no"]);
          return tr;
        })));
    } else {
      section.appendChild(el("p", "Judge: no verdict yet.", "muted"));
    }
    section.appendChild(table(["when", "what", "reason", "step", "canary %", "triggered"],
      r.history.slice().reverse().map(e => {
        const tr = row([num(now - e.at, 0) + " s ago", e.what, e.reason, e.step + 1, e.percent,
          e.triggered.join(", ") || DASH]);
        tr.className = "event";
        return tr;
      })));
    box.appendChild(section);
  }
}

async function refresh() {
  const status = document.getElementById("refresh");
  try {
    const [pods, rollouts, counts] = await Promise.all(
      [getJSON("/admin/pods"), getJSON("/admin/rollouts"), shedCounts()]);
    renderPods(pods);
    renderShedding(pods, counts);
    renderRollouts(rollouts);
    status.className = "muted";
    status.textContent = "updated " + new Date().toLocaleTimeString();
  } catch (err) {
    status.className = "bad";
    status.textContent = String(err.message || err);
  }
  document.body.dataset.refreshed = String(Number(document.body.dataset.refreshed || 0) + 1);
}
async function loop() { await refresh(); setTimeout(loop, REFRESH_MS); }

document.getElementById("key-form").addEventListener("submit", event => {
  event.preventDefault();
  const input = document.getElementById("key");
  if (input.value) sessionStorage.setItem(KEY, input.value); else sessionStorage.removeItem(KEY);
  input.value = "";
  refresh();
});
loop();
"""


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Sluicegate status</title>
<style>{STYLE}</style>
</head>
<body>
<div id="bar">
<h1>Sluicegate</h1>
<form id="key-form">
<label>Admin key
<input id="key" type="password" autocomplete="off" placeholder="kept in this tab only"></label>
<button type="submit">Use key</button>
</form>
<span id="refresh" class="muted">loading…</span>
</div>
<h2>Shedding</h2>
<div id="shedding"></div>
<h2>Pods by GPU and MIG slice</h2>
<div id="pods"></div>
<h2>Rollouts</h2>
<div id="rollouts"></div>
<script>{SCRIPT}</script>
</body>
</html>
"""

# The page's own script and style only; data calls back to this listener only; never framed.
CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

// unbroken dashboard: renders what /api/stream pushes (a snapshot, and a job's timeline on a job page).
// Plain JavaScript and SVG, no framework, nothing fetched from the internet.
"use strict";

const page = document.body.dataset.page;
const subject = decodeURIComponent(location.pathname.split("/")[2] || "");
const $ = (id) => document.getElementById(id);

function esc(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function table(element, columns, rows, rowClass) {
  if (!rows.length) {
    element.innerHTML = `<tr><td class="empty">none</td></tr>`;
    return;
  }
  const head = `<tr>${columns.map(([title]) => `<th>${esc(title)}</th>`).join("")}</tr>`;
  const body = rows.map((row) => `<tr class="${esc(rowClass ? rowClass(row) : "")}" data-name="${esc(row.name ?? row.id ?? "")}">` +
    columns.map(([, cell]) => `<td>${cell(row)}</td>`).join("") + "</tr>").join("");
  element.innerHTML = head + body;
}

const badge = (cls, text) => `<span class="badge ${esc(cls)}">${esc(text)}</span>`;
const time = (ts) => new Date(ts * 1000).toLocaleTimeString();
const pct = (x) => (x === null || x === undefined ? "-" : `${(x * 100).toFixed(1)}%`);

function renderNodes(nodes) {
  table($("nodes"), [
    ["node", (n) => `<a href="/nodes/${esc(n.name)}">${esc(n.name)}</a>`],
    ["health", (n) => badge("health", n.health_status)],
    ["deep check", (n) => badge(`deep-${n.deep_health}`, n.deep_health)],
    ["fault", (n) => esc(n.fault_type || "")],
    ["reason", (n) => esc(n.fault_reason || "")],
    ["job", (n) => (n.job ? `<a href="/jobs/${esc(n.job)}">${esc(n.job)}</a>` : "")],
    ["heartbeat", (n) => (n.heartbeat_age_s === null ? "-" : `${n.heartbeat_age_s} s ago`)],
  ], nodes, (n) => `health-${n.health_status}`);
}

function progressBar(job) {
  if (!job.total_steps) return esc(job.step);
  const done = Math.min(100, (100 * job.step) / job.total_steps);
  return `<div class="bar" title="${job.step} / ${job.total_steps}"><span style="width:${done.toFixed(1)}%"></span></div>`;
}

function renderJobs(jobs) {
  table($("jobs"), [
    ["job", (j) => `<a href="/jobs/${esc(j.name)}">${esc(j.name)}</a>`],
    ["phase", (j) => badge(`phase-${j.phase}`, j.phase)],
    ["progress", progressBar],
    ["step", (j) => esc(j.step)],
    ["restarts", (j) => `${j.restarts} of ${j.max_retry}`],
    ["goodput", (j) => pct(j.goodput)],
    ["reason", (j) => esc(j.reason || "")],
  ], jobs, (j) => `phase-row-${j.phase}`);
}

function renderCheckpoints(rows) {
  table($("checkpoints"), [
    ["job", (c) => esc(c.job)], ["tier", (c) => esc(c.tier)], ["newest committed step", (c) => esc(c.newest_step ?? "-")],
    ["age", (c) => (c.age_s === null ? "-" : `${c.age_s} s`)], ["failures", (c) => esc(c.failures)],
    ["last failure", (c) => esc(c.last_failure || "")],
  ], rows);
}

function renderEvents(events, filter) {
  const shown = events.filter(filter).slice(-100).reverse();
  table($("events"), [
    ["time", (e) => time(e.ts)], ["object", (e) => `${esc(e.kind)} ${esc(e.name)}`], ["type", (e) => esc(e.type)],
    ["reason", (e) => esc(e.reason)], ["message", (e) => esc(e.message)],
  ], shown, (e) => e.type);
  for (const row of $("events").querySelectorAll("tr")) {
    const cell = row.children[3];
    if (cell) cell.classList.add("reason");
  }
}

function fact(label, value, id) {
  return `<div><span>${esc(label)}</span><b id="${esc(id)}">${esc(value)}</b></div>`;
}

function renderPlot(svg, t) {
  const W = 1000, H = 320, L = 60, R = 20, T = 15, B = 30;
  const samples = t.samples;
  const start = Math.min(t.created_at, ...samples.map((s) => s.t));
  const end = Math.max(t.now, ...samples.map((s) => s.t), start + 1);
  // Scaled to the steps reached, not the total: a long job's first hours would be a flat line.
  const reached = Math.max(1, ...samples.map((s) => s.step), ...t.lost.map((l) => l.to_step));
  const top = t.job.total_steps && t.job.total_steps <= reached * 1.25 ? t.job.total_steps : Math.ceil(reached * 1.1);
  const x = (ts) => L + ((ts - start) / (end - start)) * (W - L - R);
  const y = (step) => H - B - (step / top) * (H - T - B);
  const parts = [
    `<line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"/>`,
    `<line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"/>`,
    `<text x="${L - 6}" y="${y(top) + 4}" text-anchor="end">${top}</text>`,
    `<text x="${L - 6}" y="${H - B}" text-anchor="end">0</text>`,
    `<text x="${L}" y="${H - 8}">${time(start)}</text>`,
    `<text x="${W - R}" y="${H - 8}" text-anchor="end">${time(end)}</text>`,
  ];
  for (const l of t.lost) {
    parts.push(`<rect class="lost" data-steps="${l.steps}" x="${x(l.from_t)}" y="${y(l.to_step)}" ` +
      `width="${Math.max(2, x(l.to_t) - x(l.from_t))}" height="${Math.max(3, y(l.from_step) - y(l.to_step))}"><title>${l.steps} steps lost</title></rect>`);
  }
  const colors = ["#0969da", "#8250df", "#1a7f37", "#bc4c00", "#bf3989", "#0550ae"];
  const attempts = [...new Set(samples.map((s) => s.attempt))];
  for (const a of attempts) {
    const mine = samples.filter((s) => s.attempt === a);
    const points = mine.map((s) => `${x(s.t).toFixed(1)},${y(s.step).toFixed(1)}`).join(" ");
    const color = colors[a % colors.length], last = mine[mine.length - 1];
    parts.push(`<polyline class="attempt" data-attempt="${a}" stroke="${color}" points="${points}"/>`);
    // the newest point of each attempt as a dot: an attempt with a single sample is still visible
    parts.push(`<circle class="head" data-attempt="${a}" fill="${color}" r="3.5" cx="${x(last.t).toFixed(1)}" cy="${y(last.step).toFixed(1)}">` +
      `<title>attempt ${a}: step ${last.step} at ${time(last.t)}</title></circle>`);
  }
  for (const m of t.markers) {
    parts.push(`<line class="marker ${esc(m.kind)}" data-kind="${esc(m.kind)}" x1="${x(m.t)}" y1="${T}" x2="${x(m.t)}" y2="${H - B}">` +
      `<title>${esc(m.label)} (${time(m.t)})</title></line>`);
  }
  svg.innerHTML = parts.join("");
}

function renderStepTimes(t) {
  // straggler scores: the node's slowest rank's work against the job's other nodes (docs/stragglers.md)
  table($("step-times"), [
    ["node", (r) => `<a href="/nodes/${esc(r.node)}">${esc(r.node)}</a>`],
    ["median step", (r) => (r.median_step_s === null ? "-" : `${(r.median_step_s * 1000).toFixed(1)} ms`)],
    ["straggler score", (r) => (r.score === null ? "-" : r.score.toFixed(2))],
    ["slowest rank", (r) => (r.rank === null ? "-" : r.rank)],
    ["slowest section", (r) => esc(r.section || "-")],
  ], t.step_times, (r) => (r.slow ? "slow" : ""));
  $("step-time-note").textContent = `straggler policy ${t.straggler_policy}, threshold ${t.straggler_threshold}; ` +
    `hang timeout ${t.hang_timeout.seconds} s (${t.hang_timeout.why})`;
}

function render(data) {
  const s = data.snapshot;
  if (page === "overview") {
    $("cluster").textContent = `${s.cluster.name} (${s.cluster.status})`;
    renderNodes(s.nodes);
    renderJobs(s.jobs);
    renderCheckpoints(s.checkpoints);
    const job = $("filter-job").value.trim(), node = $("filter-node").value.trim();
    renderEvents(s.events, (e) => (!job || (e.kind === "Job" && e.name.includes(job))) && (!node || (e.kind === "Node" && e.name.includes(node)) || (node && e.message.includes(node))));
  } else if (page === "job" && data.timeline) {
    const t = data.timeline, j = t.job;
    $("title").innerHTML = `job <b>${esc(j.name)}</b> ${badge(`phase-${j.phase}`, j.phase)}`;
    $("facts").innerHTML = fact("phase", j.phase, "phase") + fact("step", j.total_steps ? `${j.step} / ${j.total_steps}` : j.step, "step") +
      fact("restarts", `${j.restarts} of ${j.max_retry}`, "restarts") + fact("steps lost", t.steps_lost, "steps-lost") +
      fact("goodput", pct(j.goodput), "goodput") +
      fact("recovery", t.recoveries.length ? t.recoveries.map((r) => `${r.toFixed(1)} s`).join(", ") : "-", "recovery") +
      `<div><span>progress</span>${progressBar(j)}</div>`;
    $("history").innerHTML = t.history.map((h) => `<li class="step-${esc(h.phase)}" title="${esc(h.message)}">` +
      `${badge(`phase-${h.phase}`, h.phase)} <time>${time(h.t)}</time></li>`).join("");
    renderPlot($("plot"), t);
    renderStepTimes(t);
    renderEvents(s.events, (e) => e.kind === "Job" && e.name === j.name);
  } else if (page === "node" && data.node) {
    const n = data.node, retired = n.state === "Retired";
    $("title").innerHTML = `node <b>${esc(subject)}</b> ` + badge("health", n.health_status) + (retired ? " retired" : "");
    document.body.className = `health-${n.health_status}`;
    $("facts").innerHTML = fact("health", n.health_status, "health") + fact("state", n.state, "state") +
      fact("deep check", n.deep_health, "deep") + fact("fault", n.fault_type || "-", "fault") +
      fact("job", n.job || "-", "job") + fact("heartbeat", n.heartbeat_age_s === null ? "-" : `${n.heartbeat_age_s} s ago`, "heartbeat") +
      fact("address", n.address || "-", "address") + fact("reboots", n.reboots, "reboots") +
      (n.replaced_by ? `<div><span>replaced by</span><b id="replaced-by"><a href="/nodes/${esc(n.replaced_by)}">${esc(n.replaced_by)}</a></b></div>` : "") +
      (n.fault_reason ? `<div class="wide"><span>reason</span><b id="reason">${esc(n.fault_reason)}</b></div>` : "");
    renderEvents(s.events, (e) => (e.kind === "Node" && e.name === subject) || e.message.includes(subject));
  }
}

let latest = null;
function connect() {
  const query = page === "job" ? `?job=${encodeURIComponent(subject)}` : page === "node" ? `?node=${encodeURIComponent(subject)}` : "";
  const source = new EventSource(`/api/stream${query}`);
  source.onopen = () => { $("live").className = "on"; $("live").textContent = "live"; };
  source.onerror = () => { $("live").className = "off"; $("live").textContent = "reconnecting"; };
  source.onmessage = (message) => { latest = JSON.parse(message.data); render(latest); };
}
for (const id of ["filter-job", "filter-node"]) {
  const input = $(id);
  if (input) input.addEventListener("input", () => latest && render(latest));
}
connect();

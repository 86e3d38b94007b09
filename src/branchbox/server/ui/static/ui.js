// The /ui page's script: adopts the server-rendered tree, applies /v1/events to it, shows
// a node's runs and the diff of two nodes. No framework, no build step.
//
// Cost stays flat with the number of nodes: events are queued and applied once per
// animation frame, each touching only the nodes it names (found in a Map by id); ages
// and resource use are refreshed by one request every STATS_MS for the whole page, and
// only the text that changed is written. Everything that came from a sandbox (ids,
// output, paths) is put in the page as text, never as HTML.
"use strict";

// Resource use is re-read every STATS_MS, or STATS_SHARE times as long as the last read
// took if that is longer: a daemon busy reading a thousand cgroups is asked less often.
const STATS_MS = 5000;
const STATS_SHARE = 20;
const AGES_MS = 1000;
const STATS_SOON_MS = 300; // after a fork or a create: new nodes get their use soon
const RUNS_KEPT = 5;
const DIFF_SHOWN = 500;
const HIDDEN_FLUSH_MS = 1000;
const RETIRED_KEPT = 2000; // greyed nodes a page keeps; beyond, the oldest leaves go

const nodes = new Map(); // id -> {li, kids, parts: {state, age, cpu, mem, badges}, ...}
const runs = new Map(); // id -> recent exec events, oldest first
const retiredOrder = []; // ids of greyed nodes, oldest first
const queue = [];
let selected = []; // at most two ids, the last clicked last
let scheduled = false;
let lastCpu = new Map(); // id -> [cpu seconds, when], for a CPU percentage
let statsSoon = null; // the one pending refresh, however many nodes arrive
let statsBusy = false; // one request in flight at most

const $ = (sel, root = document) => root.querySelector(sel);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function setText(e, text) {
  if (e.textContent !== text) e.textContent = text;
}

function adopt(li) {
  const card = $(".card", li);
  const node = {
    li, card, kids: $(".kids", li), created: parseFloat(li.dataset.created),
    parts: {
      state: $(".state", card), age: $(".age", card), cpu: $(".cpu", card),
      mem: $(".mem", card), badges: $(".badges", card),
    },
  };
  nodes.set(li.dataset.id, node);
  if (li.classList.contains("retired")) retiredOrder.push(li.dataset.id);
  return node;
}

function familySection(family) {
  let section = document.querySelector(`section.family[data-family="${CSS.escape(family)}"]`);
  if (!section) {
    section = el("section", "family");
    section.dataset.family = family;
    const h2 = el("h2", null, "family ");
    h2.append(el("code", null, family));
    section.append(h2, el("ul", "tree"));
    $("#families").append(section);
  }
  return $(".tree", section);
}

function addNode(id, parent, family, created, state) {
  if (nodes.has(id)) return nodes.get(id);
  const li = el("li", `node state-${state}`);
  li.dataset.id = id;
  li.dataset.parent = parent || "";
  li.dataset.created = String(created);
  const card = el("div", "card");
  card.tabIndex = 0;
  for (const [cls, text] of [["sid", id], ["state", state], ["age", ""], ["cpu", ""],
                             ["mem", ""], ["badges", ""]]) {
    card.append(el("span", cls, text));
  }
  li.append(card, el("ul", "kids"));
  const up = parent && nodes.get(parent);
  (up ? up.kids : familySection(family)).append(li);
  const node = adopt(li);
  setText(node.parts.age, age(Math.max(0, Date.now() / 1000 - created)));
  if (statsSoon === null && !statsBusy) statsSoon = setTimeout(refreshStats, STATS_SOON_MS);
  return node;
}

function setState(node, state) {
  node.li.className = node.li.className.replace(/\bstate-\S+/, `state-${state}`);
  setText(node.parts.state, state);
}

// A node that is no longer a sandbox (closed, or merged into its parent): greyed, and
// kept until RETIRED_KEPT newer ones are; one with children shown under it stays.
function retire(node, state) {
  setState(node, state);
  if (node.li.classList.contains("retired")) return;
  node.li.classList.add("retired");
  retiredOrder.push(node.li.dataset.id);
  for (let i = 0; retiredOrder.length > RETIRED_KEPT && i < retiredOrder.length;) {
    const old = nodes.get(retiredOrder[i]);
    if (old && old.kids.children.length) {
      i++;
      continue;
    }
    retiredOrder.splice(i, 1);
    if (!old) continue;
    const section = old.li.closest("section.family");
    old.li.remove();
    nodes.delete(old.li.dataset.id);
    runs.delete(old.li.dataset.id);
    if (section && !section.querySelector("li.node")) section.remove();
  }
}

// One badge of each kind per node, showing the latest: a parent merged into a thousand
// times has one "merged" badge, not a thousand.
function badge(node, cls, text) {
  const old = node.parts.badges.querySelector(`.badge.${cls}`);
  if (old) setText(old, text);
  else node.parts.badges.append(el("span", `badge ${cls}`, text));
}

const short = (id) => (id || "").slice(0, 12);

// One event, applied to the nodes it names.
function apply(ev) {
  const node = nodes.get(ev.sandbox);
  switch (ev.type) {
    case "create":
    case "start": // a stopped sandbox running again, same id
      addNode(ev.sandbox, ev.parent, ev.family, ev.ts, "ready");
      break;
    case "fork":
      for (const child of ev.children || []) {
        addNode(child, ev.sandbox, ev.family, ev.ts, "ready");
      }
      break;
    case "merge": {
      const winner = nodes.get(ev.winner);
      if (node && winner) {
        for (const kid of Array.from(winner.kids.children)) {
          kid.dataset.parent = ev.sandbox;
          node.kids.append(kid);
        }
        node.merges = (node.merges || 0) + 1;
        const times = node.merges > 1 ? ` (${node.merges} merges)` : "";
        badge(node, "merged", `merged ← ${short(ev.winner)}${times}`);
      }
      if (winner) {
        badge(winner, "winner", `won → ${short(ev.sandbox)}`);
        retire(winner, "merged");
      }
      if (node) setState(node, "ready");
      break;
    }
    case "close":
      if (node) retire(node, "closed");
      break;
    case "gone":
    case "pause":
    case "resume":
      if (node) setState(node, { gone: "gone", pause: "paused", resume: "ready" }[ev.type]);
      break;
    case "checkpoint":
    case "restore":
      if (node) badge(node, "checkpoint", `${ev.type} ${ev.name || short(ev.checkpoint)}`);
      break;
    case "commit":
      if (node) badge(node, "commit", `committed v${ev.version}`);
      break;
    case "frozen": // a persistent sandbox kept as a space at its idle timeout
      if (node) badge(node, "checkpoint", ev.space_id ? `frozen: ${ev.space_id}` : "not frozen");
      break;
    case "exec": {
      const list = runs.get(ev.sandbox) || [];
      list.push(ev);
      if (list.length > RUNS_KEPT) list.shift();
      runs.set(ev.sandbox, list);
      if (selected[selected.length - 1] === ev.sandbox) showDetails(ev.sandbox);
      break;
    }
    case "lost":
      showBanner(ev.count < 0
        ? "The daemon restarted: reload the page for its current sandboxes."
        : `${ev.count} events were dropped while this page was behind; reload for the ` +
          "full picture.");
      break;
  }
}

function flush() {
  scheduled = false;
  for (const ev of queue.splice(0)) apply(ev);
  setText($("#counts"), `${nodes.size} nodes`);
}

// Applied once per frame; a hidden tab gets no frames, so there a timer drains the queue
// (which would otherwise grow for as long as the tab stays hidden).
function enqueue(ev) {
  queue.push(ev);
  if (!scheduled) {
    scheduled = true;
    if (document.hidden) setTimeout(flush, HIDDEN_FLUSH_MS);
    else requestAnimationFrame(flush);
  }
}

function showBanner(text) {
  const banner = $("#banner");
  banner.textContent = text;
  banner.hidden = false;
}

function connect() {
  const status = $("#status");
  const source = new EventSource(`/v1/events?since=${document.body.dataset.lastEvent}`);
  source.onopen = () => { setText(status, "live"); status.className = "status live"; };
  source.onerror = () => { setText(status, "reconnecting…"); status.className = "status"; };
  source.onmessage = (msg) => enqueue(JSON.parse(msg.data));
}

// ----------------------------------------------------------------- ages and resources
function age(seconds) {
  if (seconds < 60) return `${Math.floor(seconds)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function refreshAges() {
  const now = Date.now() / 1000;
  for (const node of nodes.values()) {
    if (!node.li.classList.contains("retired")) {
      setText(node.parts.age, age(Math.max(0, now - node.created)));
    }
  }
}

async function refreshStats() {
  if (statsBusy) return;
  clearTimeout(statsSoon);
  statsBusy = true;
  const started = performance.now();
  try {
    if (!document.hidden) await readStats();
  } finally {
    statsBusy = false;
    const took = performance.now() - started;
    statsSoon = setTimeout(refreshStats, Math.max(STATS_MS, took * STATS_SHARE));
  }
}

async function readStats() {
  let reply;
  try {
    reply = await fetch("/ui/stats", { credentials: "same-origin" });
  } catch {
    return;
  }
  if (!reply.ok) return;
  const now = performance.now() / 1000;
  const next = new Map();
  for (const [id, [state, cpu, mem]] of Object.entries((await reply.json()).sandboxes)) {
    const node = nodes.get(id);
    if (!node) continue;
    if (!node.li.classList.contains("retired")) setState(node, state);
    if (cpu !== null) {
      const before = lastCpu.get(id);
      const pct = before ? ((cpu - before[0]) / (now - before[1])) * 100 : null;
      setText(node.parts.cpu, pct === null ? `cpu ${cpu.toFixed(2)} s`
        : `cpu ${Math.max(0, pct).toFixed(0)}%`);
      next.set(id, [cpu, now]);
    }
    if (mem !== null) setText(node.parts.mem, `mem ${(mem / 1048576).toFixed(1)} MiB`);
  }
  lastCpu = next;
}

// ----------------------------------------------------------- selection, details, diff
function select(id) {
  selected = selected.filter((s) => s !== id);
  selected.push(id);
  if (selected.length > 2) selected.shift();
  for (const node of nodes.values()) node.card.classList.remove("selected");
  for (const s of selected) nodes.get(s)?.card.classList.add("selected");
  showDetails(id);
  if (selected.length === 2) showDiff(selected[0], selected[1]);
}

function field(dl, name, value) {
  dl.append(el("dt", null, name), el("dd", null, value));
}

function showDetails(id) {
  const node = nodes.get(id);
  const box = $("#details");
  box.replaceChildren(el("h2", null, "Sandbox"));
  if (!node) return;
  const dl = el("dl");
  field(dl, "id", id);
  field(dl, "parent", node.li.dataset.parent || "—");
  field(dl, "state", node.parts.state.textContent);
  field(dl, "age", node.parts.age.textContent);
  field(dl, "resources", `${node.parts.cpu.textContent} ${node.parts.mem.textContent}`);
  box.append(dl, el("h3", null, "Last runs"));
  const list = runs.get(id) || [];
  if (!list.length) box.append(el("p", "hint", "No run seen yet."));
  for (const run of list.slice().reverse()) {
    const item = el("div", "run");
    const outcome = run.error ? `${run.error.name}: ${run.error.value}`
      : run.exit_code !== null && run.exit_code !== undefined ? `exit ${run.exit_code}` : "ok";
    item.append(el("div", "run-head",
      `${run.op} · ${outcome} · ${(run.duration * 1000).toFixed(0)} ms`));
    item.append(el("pre", "code", run.code));
    if (run.stdout) item.append(el("pre", "stdout", run.stdout));
    if (run.stderr) item.append(el("pre", "stderr", run.stderr));
    if (run.text) item.append(el("pre", "text", run.text));
    box.append(item);
  }
}

async function showDiff(a, b) {
  const box = $("#diff");
  box.replaceChildren(el("h2", null, "Diff"),
    el("p", "hint", `${short(b)} relative to ${short(a)}…`));
  let result;
  try {
    const reply = await fetch(`/v1/sandboxes/${encodeURIComponent(a)}/diff`, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Branchbox-UI": "1" },
      body: JSON.stringify({ other: b }),
    });
    result = await reply.json();
    if (!reply.ok) throw new Error(result.error || reply.statusText);
  } catch (err) {
    box.replaceChildren(el("h2", null, "Diff"), el("p", "error", String(err.message || err)));
    return;
  }
  if (selected[0] !== a || selected[1] !== b) return; // the selection moved on
  box.replaceChildren(el("h2", null, "Diff"),
    el("p", "hint", `files of ${short(b)} relative to ${short(a)}`));
  for (const kind of ["added", "removed", "modified"]) {
    const paths = result[kind] || [];
    const section = el("div", `diff-${kind}`);
    section.dataset.count = String(paths.length);
    section.append(el("h3", null, `${kind} (${paths.length})`));
    const ul = el("ul");
    for (const path of paths.slice(0, DIFF_SHOWN)) ul.append(el("li", null, path));
    section.append(ul);
    box.append(section);
  }
}

function start() {
  for (const li of document.querySelectorAll("li.node")) adopt(li);
  const initial = JSON.parse($("#bb-runs").textContent);
  for (const [id, list] of Object.entries(initial)) runs.set(id, list);
  const families = $("#families");
  const chosen = (event) => {
    const li = event.target.closest(".card")?.parentElement;
    if (li?.dataset.id) select(li.dataset.id);
  };
  families.addEventListener("click", chosen);
  families.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      chosen(event);
    }
  });
  connect();
  refreshAges();
  refreshStats();
  setInterval(refreshAges, AGES_MS);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refreshStats();
  });
}

start();

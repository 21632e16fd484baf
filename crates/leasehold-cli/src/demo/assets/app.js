"use strict";
// The demo page: draws what the server streams (server-sent events) and sends the controls.
// No framework and no build step: the file is embedded in the leasehold binary as it is.

const KINDS = ["counter", "ttl-counter", "lease"];
const WINDOW_S = 40; // seconds of history in each chart
const STATS = [
  ["admitted", "admitted"],
  ["refused", "refused"],
  ["over_admitted", "over limit"],
  ["crashes", "crashed"],
  ["recovered", "reclaimed"],
];
const SVG = "http://www.w3.org/2000/svg";
// The largest seed the server takes: 2^53 - 1, the largest integer a page reads exactly, so a
// seed shown here is the seed that ran.
const MAX_SEED = Number.MAX_SAFE_INTEGER;

let frames = [];
let state = null;

const $ = (id) => document.getElementById(id);
const columns = Object.fromEntries(KINDS.map((k) => [k, $("col-" + k)]));

function controlsToParams() {
  return {
    limit: Number($("limit").value),
    crash_probability: Number($("crash").value),
    ttl_ms: Math.round(Number($("ttl").value) * 1000),
    task_ms: Math.round(Number($("task").value) * 1000),
    speed: Number($("speed").value),
    seed: Number($("seed").value),
  };
}

function paramsToControls(p) {
  $("limit").value = p.limit;
  $("crash").value = p.crash_probability;
  $("ttl").value = p.ttl_ms / 1000;
  $("task").value = p.task_ms / 1000;
  const speed = $("speed");
  if (![...speed.options].some((o) => Number(o.value) === p.speed)) {
    speed.add(new Option(p.speed + "×", String(p.speed)));
  }
  speed.value = [...speed.options].find((o) => Number(o.value) === p.speed).value;
  $("seed").value = p.seed;
}

function applyState(s, fillControls) {
  state = s;
  const phase = $("phase");
  phase.textContent = s.phase;
  phase.className = "phase " + s.phase;
  $("store").textContent = "store: " + s.store;
  $("start").disabled = s.phase === "running";
  $("start").textContent = s.phase === "paused" ? "Resume" : "Start";
  $("pause").disabled = s.phase !== "running";
  for (const input of document.querySelectorAll(".controls input, .controls select")) {
    input.disabled = s.phase !== "idle";
  }
  if (fillControls) paramsToControls(s.params);
}

function hint(text, isError) {
  const h = $("hint");
  if (!h.dataset.normal) h.dataset.normal = h.textContent;
  h.textContent = text || h.dataset.normal;
  h.classList.toggle("error", Boolean(isError));
}

async function post(path, body) {
  try {
    const response = await fetch(path, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body || {}),
    });
    if (!response.ok) {
      hint(await response.text(), true);
      return;
    }
    hint();
  } catch (e) {
    hint("The demo server does not answer: " + e, true);
  }
}

// A seed above 2^53 - 1 would reach the server rounded to another number: refuse it here,
// with the same bound the server checks.
function postSettings(path) {
  const params = controlsToParams();
  if (!Number.isSafeInteger(params.seed) || params.seed < 0 || params.seed > MAX_SEED) {
    hint("seed must be a whole number from 0 to " + MAX_SEED + " (2^53 - 1)", true);
    return;
  }
  post(path, params);
}

$("start").addEventListener("click", () => postSettings("/api/start"));
$("pause").addEventListener("click", () => post("/api/pause"));
$("reset").addEventListener("click", () => postSettings("/api/reset"));

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function drawStats(col, s) {
  const box = col.querySelector(".stats");
  if (!box.children.length) {
    for (const [key, label] of STATS) {
      const d = document.createElement("div");
      d.className = "stat";
      d.dataset.stat = key;
      d.innerHTML = "<b>0</b><span>" + label + "</span>";
      if (key === "over_admitted") d.title = "over-admitted: admissions that made more tasks run than the limit";
      box.appendChild(d);
    }
  }
  for (const d of box.children) {
    const value = s ? s[d.dataset.stat] : 0;
    d.querySelector("b").textContent = value;
    d.classList.toggle("alert", d.dataset.stat === "over_admitted" && value > 0);
  }
}

function drawGrid(col, s, limit) {
  const running = s ? s.running : 0;
  const crashed = s ? s.crashed : 0;
  const cells = Math.max(limit, running + crashed);
  const grid = col.querySelector(".grid");
  grid.style.setProperty("--per-row", Math.min(limit, 10));
  let html = "";
  for (let i = 0; i < cells; i++) {
    let cls = "cell";
    if (i < running) cls += " live";
    else if (i < running + crashed) cls += " crashed";
    if (i >= limit) cls += " over";
    html += '<i class="' + cls + '"></i>';
  }
  grid.innerHTML = html;
  const note = col.querySelector(".gridnote");
  note.innerHTML = s
    ? "count <b>" + s.counted + "</b> · available <b>" + s.available + "</b> · running <b>" +
      running + "</b> · held by crashed <b>" + crashed + "</b>" +
      (s.shed ? ' · <span class="alert" title="arrivals not submitted because the store fell ' +
        'behind: this column did not get every task">shed <b>' + s.shed + "</b></span>" : "")
    : "count <b>0</b> · available <b>" + limit + "</b>";
}

function drawChart(col, index, now, yMax, limit) {
  const svg = col.querySelector(".chart");
  svg.textContent = "";
  const W = 360, H = 150, L = 26, R = 8, T = 8, B = 20;
  const from = now - WINDOW_S;
  const x = (t) => L + ((t - from) / WINDOW_S) * (W - L - R);
  const y = (v) => T + (1 - v / yMax) * (H - T - B);
  el("rect", { class: "over-zone", x: L, y: T, width: W - L - R, height: y(limit) - T }, svg);
  for (const v of new Set([0, limit, yMax])) {
    el("line", { class: v === 0 ? "axis" : "grid-line", x1: L, x2: W - R, y1: y(v), y2: y(v) }, svg);
    el("text", { x: L - 5, y: y(v) + 3.5, "text-anchor": "end" }, svg).textContent = v;
  }
  el("line", { class: "line-limit", x1: L, x2: W - R, y1: y(limit), y2: y(limit) }, svg);
  // Ticks at whole tens of seconds since the start; the window scrolls once it is full.
  for (let s = Math.ceil(from / 10) * 10; s <= now; s += 10) {
    const anchor = x(s) < L + 12 ? "start" : x(s) > W - R - 12 ? "end" : "middle";
    el("text", { x: x(s), y: H - 5, "text-anchor": anchor }, svg).textContent = s + " s";
  }
  const shown = frames.filter((f) => f.t >= from);
  const points = (pick) =>
    shown.map((f) => x(f.t).toFixed(1) + "," + y(Math.max(0, Math.min(yMax, pick(f.worlds[index])))).toFixed(1)).join(" ");
  el("polyline", { class: "line-running", points: points((w) => w.running) }, svg);
  el("polyline", { class: "line-available", points: points((w) => w.available) }, svg);
  col.dataset.points = shown.length;
}

function render() {
  if (!state) return;
  const limit = state.params.limit;
  const last = frames[frames.length - 1];
  const now = last ? Math.max(last.t, WINDOW_S) : WINDOW_S;
  // One vertical scale for the three charts, so that their heights compare.
  let top = Math.ceil(limit * 1.5);
  for (const f of frames) {
    if (f.t < now - WINDOW_S) continue;
    for (const w of f.worlds) top = Math.max(top, w.running, w.available);
  }
  $("clock").textContent = "t = " + (last ? last.t : 0).toFixed(1) + " s";
  KINDS.forEach((kind, index) => {
    const col = columns[kind];
    const s = last ? last.worlds[index] : null;
    drawStats(col, s);
    drawGrid(col, s, limit);
    drawChart(col, index, now, top, limit);
    const data = s || { admitted: 0, refused: 0, over_admitted: 0, available: limit, running: 0, crashed: 0, recovered: 0 };
    Object.assign(col.dataset, {
      admitted: data.admitted,
      refused: data.refused,
      over: data.over_admitted,
      available: data.available,
      running: data.running,
      crashed: data.crashed,
      recovered: data.recovered,
      shed: data.shed || 0,
    });
  });
}

const events = new EventSource("/events");
// The first message, and again if this page fell too far behind: a fresh start either way.
events.addEventListener("hello", (e) => {
  const hello = JSON.parse(e.data);
  frames = hello.history;
  applyState(hello.state, true);
  render();
});
events.addEventListener("state", (e) => {
  const s = JSON.parse(e.data);
  if (s.reset) frames = [];
  applyState(s, s.reset);
  render();
});
events.addEventListener("frame", (e) => {
  frames.push(JSON.parse(e.data));
  const last = frames[frames.length - 1].t;
  while (frames.length && frames[0].t < last - WINDOW_S - 2) frames.shift();
  render();
});
events.addEventListener("error", () => {
  $("phase").textContent = "disconnected";
  $("phase").className = "phase";
});

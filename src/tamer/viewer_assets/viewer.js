// tamer view: renders the JSON embedded in #tamer-data. No network, no libraries.
"use strict";

const DATA = JSON.parse(document.getElementById("tamer-data").textContent);
const ROLLOUTS = DATA.rollouts || [];
const REWARD_LO = Math.min(0, ...ROLLOUTS.map((r) => r.reward));
const REWARD_HI = Math.max(1, ...ROLLOUTS.map((r) => r.reward));
const $ = (id) => document.getElementById(id);
const BASELINE_COLORS = { demonstrator: "#888", SFT: "#e07b00" };
const SERIES_COLORS = { rl: "#2a6fdb", sft: "#7a3fb0" };
const HEADLINE = ["eval/accuracy", "eval/success_rate", "reward/mean", "train/loss", "sft/loss",
  "rollout/zero_spread_frac", "eval/mean_tool_calls", "eval/mean_cost_ratio", "rollout/mean_length",
  "rollout/truncated_frac", "rollout/tool_calls", "rollout/errors", "train/sampler_logprob_gap", "train/kl"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  return Math.abs(x) >= 1000 || (Math.abs(x) < 0.001 && x !== 0) ? x.toExponential(2) : x.toFixed(digits);
}

// ------------------------------------------------------------------ rollouts
const state = { kind: null, step: "all", rmin: null, rmax: null, errors: false, truncated: false, text: "" };

// "sft eval": the SFT model's held-out episodes (their step counts SFT steps, not RL steps).
const kindOf = (r) => (r.phase === "sft" ? "sft eval" : r.kind);
const KIND_ORDER = ["train", "eval", "sft eval"];
function kinds() { return [...new Set(ROLLOUTS.map(kindOf))].sort((a, b) => KIND_ORDER.indexOf(a) - KIND_ORDER.indexOf(b)); }
function stepsOf(kind) { return [...new Set(ROLLOUTS.filter((r) => kindOf(r) === kind).map((r) => r.step))].sort((a, b) => a - b); }

function setupFilters() {
  const kindSel = $("filter-kind");
  for (const k of kinds()) kindSel.append(el("option", { value: k, text: k }));
  state.kind = kindSel.value || null;
  kindSel.addEventListener("change", () => { state.kind = kindSel.value; fillSteps(); renderRollouts(); });
  fillSteps();
  $("filter-step").addEventListener("change", (e) => { state.step = e.target.value; renderRollouts(); });
  const num = (v) => (v === "" || isNaN(Number(v)) ? null : Number(v));
  $("filter-rmin").addEventListener("input", (e) => { state.rmin = num(e.target.value); renderRollouts(); });
  $("filter-rmax").addEventListener("input", (e) => { state.rmax = num(e.target.value); renderRollouts(); });
  $("filter-errors").addEventListener("change", (e) => { state.errors = e.target.checked; renderRollouts(); });
  $("filter-truncated").addEventListener("change", (e) => { state.truncated = e.target.checked; renderRollouts(); });
  $("filter-text").addEventListener("input", (e) => { state.text = e.target.value.toLowerCase(); renderRollouts(); });
  $("expand-all").addEventListener("click", () => document.querySelectorAll(".traj").forEach(expand));
  $("collapse-all").addEventListener("click", () => document.querySelectorAll(".traj").forEach((t) => t.classList.remove("expanded")));
}

function fillSteps() {
  const sel = $("filter-step");
  sel.textContent = "";
  const steps = stepsOf(state.kind);
  // Training steps default to the last one saved (the policy as it ended); "all" lists every step.
  for (const s of steps) sel.append(el("option", { value: String(s), text: `step ${s}` }));
  sel.append(el("option", { value: "all", text: "all steps" }));
  sel.value = steps.length ? String(steps[steps.length - 1]) : "all";
  state.step = sel.value;
}

function hasErrors(r) { return r.num_errors > 0 || (r.info && r.info.env_error); }

function passes(r) {
  if (state.kind && kindOf(r) !== state.kind) return false;
  if (state.step !== "all" && String(r.step) !== state.step) return false;
  if (state.rmin !== null && !(r.reward >= state.rmin)) return false;
  if (state.rmax !== null && !(r.reward <= state.rmax)) return false;
  if (state.errors && !hasErrors(r)) return false;
  if (state.truncated && !r.truncated) return false;
  if (state.text) {
    const hay = (promptText(r) + "\n" + r.completion).toLowerCase();
    if (!hay.includes(state.text)) return false;
  }
  return true;
}

function promptText(r) { return r.task.messages.map((m) => m.content).join("\n"); }

function groupsOf(records) {
  const byKey = new Map();
  for (const r of records) {
    const key = `${kindOf(r)}:${r.step}:${r.group}`;
    if (!byKey.has(key)) byKey.set(key, []);
    byKey.get(key).push(r);
  }
  const groups = [...byKey.values()].map((members) => {
    members.sort((a, b) => b.reward - a.reward || a.sample - b.sample);
    const mean = members.reduce((s, r) => s + r.reward, 0) / members.length;
    return { members, mean, spread: members[0].reward - members[members.length - 1].reward };
  });
  groups.sort((a, b) => b.mean - a.mean || a.members[0].group - b.members[0].group);
  return groups;
}

function renderRollouts() {
  const box = $("groups");
  box.textContent = "";
  const records = ROLLOUTS.filter(passes);
  const groups = groupsOf(records);
  box.classList.toggle("grid", state.kind !== "train"); // held-out episodes: one per task, in a grid
  $("count").textContent = ROLLOUTS.length
    ? `${records.length} trajectories in ${groups.length} groups (of ${ROLLOUTS.length} saved)`
    : "no rollouts saved in this run (tracking.rollouts.enabled, and an RL phase, write them)";
  const limit = 300; // keep the page responsive on big eval sets; filters narrow it
  for (const g of groups.slice(0, limit)) box.append(renderGroup(g));
  if (groups.length > limit) box.append(el("div", { class: "muted", text: `… ${groups.length - limit} more groups: narrow the filters` }));
}

function renderGroup(g) {
  const first = g.members[0];
  const head = el("div", { class: "group-head" },
    el("div", { class: "muted", text: `${kindOf(first)} step ${first.step} · group ${first.group} · mean reward ${fmt(g.mean)}` +
      (g.members.length > 1 ? ` · spread ${fmt(g.spread)}` : "") }),
    el("div", { class: "prompt", text: promptText(first) }),
    el("div", { class: "muted", text: `answer: ${first.task.answer}` }));
  const node = el("div", { class: "group", "data-group": String(first.group), "data-step": String(first.step) }, head);
  for (const r of g.members) node.append(renderTraj(r));
  return node;
}

function renderTraj(r) {
  const width = ((r.reward - REWARD_LO) / (REWARD_HI - REWARD_LO)) * 100; // over every saved reward
  const head = el("div", { class: "head", title: "click to open" },
    el("span", { class: "rbar" }, el("i", { style: `width:${width}%` })),
    el("b", { class: "reward", text: `reward ${fmt(r.reward)}` }),
    r.advantage !== null ? el("span", { text: `adv ${r.advantage >= 0 ? "+" : ""}${fmt(r.advantage)}` }) : null,
    el("span", { class: "muted", text: `${r.num_generated} tok` }),
    r.num_tool_calls ? el("span", { class: "badge", text: `${r.num_tool_calls} calls` }) : null,
    hasErrors(r) ? el("span", { class: "badge err", text: `${r.num_errors || 1} errors` }) : null,
    r.truncated ? el("span", { class: "badge trunc", text: "truncated" }) : null,
    el("div", { class: "preview", text: r.completion.slice(0, 160) }));
  const node = el("div", { class: "traj", "data-reward": String(r.reward) }, head, el("div", { class: "body" }));
  node._record = r;
  head.addEventListener("click", () => (node.classList.contains("expanded") ? node.classList.remove("expanded") : expand(node)));
  return node;
}

// The body is built on first open: big eval sets stay cheap until read.
function expand(node) {
  node.classList.add("expanded");
  const body = node.querySelector(".body");
  if (body.childElementCount) return;
  const r = node._record;
  body.append(rewardTable(r));
  r.turns.forEach((t, i) => body.append(renderTurn(r, t, i)));
  const facts = el("table", { class: "kv" });
  const rows = { finish: r.finish_reason, "logprob gap (mean / max)": `${fmt(r.logprob_gap, 4)} / ${fmt(r.logprob_gap_max, 4)}`,
    "weight version": r.weight_version, ...(r.info || {}) };
  for (const [k, v] of Object.entries(rows)) facts.append(el("tr", {}, el("th", { text: k }), el("td", { text: typeof v === "object" && v !== null ? JSON.stringify(v) : fmt(v, 4) })));
  body.append(facts);
}

function rewardTable(r) {
  const table = el("table", { class: "kv reward-breakdown" }, el("tr", {}, el("th", { text: "reward function" }),
    el("th", { text: "score" }), el("th", { text: "weight" })));
  for (const [name, score] of Object.entries(r.rewards || {})) {
    const w = r.weights ? r.weights[name] : null;
    table.append(el("tr", {}, el("td", { text: name }), el("td", { text: fmt(score) }), el("td", { text: fmt(w) })));
  }
  table.append(el("tr", {}, el("th", { text: "total" }), el("th", { text: fmt(r.reward) }), el("th", { text: "" })));
  return table;
}

function tokenSpans(r, start, end) {
  const box = el("div", { class: "tokens" });
  for (let i = start; i < end; i++) {
    box.append(el("span", { class: r.loss_mask[i] ? "tok trained" : "tok masked", text: r.tokens[i] }));
  }
  return box;
}

function renderTurn(r, t, i) {
  const [start, end, envEnd] = t.span || [0, r.tokens.length, r.tokens.length];
  const node = el("div", { class: "turn" }, el("div", { class: "turn-label", text: `turn ${i + 1} · assistant (${end - start} tokens)` }),
    tokenSpans(r, start, end));
  for (const c of t.tool_calls || []) node.append(el("div", { class: "call", text: `→ ${c.name}(${JSON.stringify(c.arguments)})` }));
  for (const e of t.errors || []) node.append(el("div", { class: "error", text: `error: ${e}` }));
  for (const res of t.tool_results || []) node.append(el("div", { class: "result", text: res }));
  if (envEnd > end) {
    node.append(el("div", { class: "turn-label", text: `environment (${envEnd - end} tokens, masked)` }), tokenSpans(r, end, envEnd));
  }
  return node;
}

// ------------------------------------------------------------------ curves
function series(records, key) {
  return records.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);
}

function chart(key, lines, baselines) {
  const W = 380, H = 210, L = 46, R = 10, T = 10, B = 28;
  const points = lines.flatMap((l) => l.points);
  const ys = points.map((p) => p[1]).concat(Object.values(baselines || {}));
  const xs = points.map((p) => p[0]);
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const [x0, x1] = [Math.min(...xs), Math.max(...xs) === Math.min(...xs) ? Math.min(...xs) + 1 : Math.max(...xs)];
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  svg.setAttribute("data-key", key);
  const add = (tag, attrs, text) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    svg.append(n);
    return n;
  };
  add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#bbb" });
  add("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#bbb" });
  for (const y of [y0, (y0 + y1) / 2, y1]) add("text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end" }, fmt(y));
  for (const x of [x0, x1]) add("text", { x: sx(x), y: H - B + 14, "text-anchor": "middle" }, String(x));
  add("text", { x: (W + L) / 2, y: H - 2, "text-anchor": "middle" }, "step");
  for (const [label, level] of Object.entries(baselines || {})) {
    const color = BASELINE_COLORS[label] || "#3a7";
    add("line", { class: "baseline", "data-label": label, x1: L, x2: W - R, y1: sy(level), y2: sy(level), stroke: color });
    add("text", { x: W - R - 2, y: sy(level) - 3, "text-anchor": "end", fill: color }, `${label} ${fmt(level)}`);
  }
  for (const line of lines) {
    const color = SERIES_COLORS[line.phase] || "#333";
    if (line.points.length > 1) add("polyline", { class: "series", stroke: color, points: line.points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" ") });
    if (line.points.length <= 60) {
      for (const p of line.points) {
        const c = add("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color });
        const tip = document.createElementNS(ns, "title");
        tip.textContent = `${line.phase} step ${p[0]}: ${fmt(p[1], 4)}`;
        c.append(tip);
      }
    }
  }
  return svg;
}

function renderCurves() {
  const metrics = DATA.metrics || {};
  const keys = new Set();
  for (const records of Object.values(metrics)) for (const r of records) for (const k of Object.keys(r)) {
    if (k !== "step" && k !== "time" && !k.startsWith("health/")) keys.add(k);
  }
  const ordered = HEADLINE.filter((k) => keys.has(k)).concat([...keys].filter((k) => !HEADLINE.includes(k)).sort());
  const box = $("charts");
  const more = el("details", { class: "more" }, el("summary", { text: "all other metrics" }));
  const moreBox = el("div", { id: "charts-more", style: "display:flex;flex-wrap:wrap;gap:12px" });
  more.append(moreBox);
  for (const key of ordered) {
    // One phase per chart: steps count SFT updates in one and RL updates in the other. RL first;
    // the SFT model's held-out level is the RL curve's step 0 and the dashed "SFT" line.
    const lines = ["rl", "sft", ...Object.keys(metrics)].filter((p) => metrics[p])
      .map((phase) => ({ phase, points: series(metrics[phase], key) })).filter((l) => l.points.length).slice(0, 1);
    if (!lines.length) continue;
    const base = (DATA.baselines || {})[key];
    const legend = lines.map((l) => l.phase).join(", ") + (base ? ` · dashed: ${Object.keys(base).join(", ")}` : "");
    const node = el("div", { class: "chart-box" }, el("h3", { text: key }), el("div", { class: "muted", text: legend }), chart(key, lines, base));
    (HEADLINE.includes(key) ? box : moreBox).append(node);
  }
  if (moreBox.childElementCount) box.after(more);
  renderWarnings(metrics);
  renderSummary();
}

function renderWarnings(metrics) {
  const box = $("warnings");
  for (const [phase, records] of Object.entries(metrics)) {
    const spans = {};
    for (const r of records) for (const [k, v] of Object.entries(r)) {
      if (k.startsWith("health/") && v === 1) (spans[k] = spans[k] || []).push(r.step);
    }
    for (const [k, steps] of Object.entries(spans)) {
      box.append(el("div", { class: "warning", text: `${phase}: ${k.slice(7).replace(/_/g, " ")} at steps ${steps[0]}–${steps[steps.length - 1]} (${steps.length} records)` }));
    }
  }
}

function renderSummary() {
  const entries = Object.entries(DATA.summary || {}).filter(([, v]) => typeof v === "number" || typeof v === "string");
  if (!entries.length) return;
  const table = el("table", { class: "kv" });
  for (const [k, v] of entries) table.append(el("tr", {}, el("th", { text: k }), el("td", { text: fmt(v) })));
  $("summary-table").append(el("h3", { text: "summary.json" }), table);
}

// ------------------------------------------------------------------ tabs
function showTab(name) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".page")) p.classList.toggle("hidden", p.id !== `page-${name}`);
}

function main() {
  $("run-title").textContent = DATA.title || "";
  const s = DATA.summary || {};
  const bits = [];
  if (s.task) bits.push(`task ${s.task}`);
  for (const k of ["demonstrator_accuracy", "sft_accuracy", "rl_accuracy"]) if (typeof s[k] === "number") bits.push(`${k.replace("_accuracy", "")} ${fmt(s[k])}`);
  $("run-summary").textContent = bits.join(" · ");
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => showTab(b.dataset.tab));
  setupFilters();
  renderRollouts();
  renderCurves();
  document.body.dataset.ready = "1";
}

main();

// The vllm-disagg dashboard: reads the admin API with the operator's token and draws the cluster.
//
// No framework and no build step: the page is served as-is by the orchestrator (docs/dashboard.md).
// Data: GET /admin/v1/instances, /live-requests and /admission every second, /requests every two, and
// the event log as server-sent events read through fetch() (EventSource cannot send the Authorization
// header).
// Every string from the API goes into the page as text (textContent), never as HTML.
"use strict";

(() => {
  const TOKEN_KEY = "vllm-disagg.admin-token";
  const POLL_MS = 1000;
  const RECENT_MS = 2000;
  const RECENT_LIMIT = 50;
  const HISTORY = 120; // points per sparkline: two minutes of 1 s polls
  const MAX_EVENTS = 300;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const ROLES = ["prefill", "decode", "both"]; // what POST /admin/v1/instances/{id}/role accepts

  const SERIES = [
    { key: "ttft", label: "TTFT", unit: "ms", title: "mean time to first token", get: (m) => scaled(m.ttft_s, 1000) },
    { key: "tpot", label: "TPOT", unit: "ms", title: "mean time per output token", get: (m) => scaled(m.tpot_s, 1000) },
    { key: "queue", label: "Queue", unit: "ms", title: "mean time waiting in the engine's queue", get: (m) => scaled(m.queue_s, 1000) },
    { key: "kv", label: "KV", unit: "%", title: "KV-cache usage", max: 100, get: (m) => scaled(m.kv_cache_usage, 100) },
  ];
  const STAGES = {
    scheduled: "scheduled",
    prefill_start: "prefilling",
    prefill_end: "KV handoff",
    decode_start: "decoding",
    first_token: "streaming to the client",
  };

  const $ = (id) => document.getElementById(id);
  let session = null; // the connection in use: {token, controller, alive}
  const view = {
    instances: [], live: [], recent: [], admission: null, cards: new Map(), history: new Map(), liveHistory: [],
    recentRows: new Map(), lastEventId: 0, instancesSeq: 0, errors: new Map(),
  };

  class AuthError extends Error {}
  class ApiError extends Error {
    constructor(status, message) {
      super(`HTTP ${status}: ${message}`);
      this.status = status;
    }
  }

  function scaled(value, factor) {
    return value === null || value === undefined ? null : value * factor;
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (name === "text") node.textContent = value;
      else if (name === "className") node.className = value;
      else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
    }
    node.append(...children.filter((c) => c !== null && c !== undefined));
    return node;
  }

  function fmtMs(ms) {
    if (ms === null || ms === undefined) return "–";
    if (ms < 10) return `${ms.toFixed(1)} ms`;
    if (ms < 1000) return `${Math.round(ms)} ms`;
    return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
  }
  const fmtSeconds = (s) => (s === null || s === undefined ? "–" : fmtMs(s * 1000));
  const fmtValue = (v, unit) => (v === null ? "–" : unit === "%" ? `${v.toFixed(1)} %` : fmtMs(v));
  const pair = (p, d) => `${p || "colocated"} → ${d || "?"}`;

  // ---- The admin API -------------------------------------------------------------------------

  async function api(path, options = {}) {
    const current = session;
    const resp = await fetch(path, {
      ...options,
      headers: { Authorization: `Bearer ${current.token}`, ...(options.headers || {}) },
      cache: "no-store",
      signal: current.controller.signal,
    });
    const body = await resp.json().catch(() => null);
    const message = body && body.error && body.error.message ? body.error.message : resp.statusText;
    if (resp.status === 401) throw new AuthError(message);
    if (!resp.ok) throw new ApiError(resp.status, message);
    return body;
  }

  function sleep(ms, signal) {
    return new Promise((resolve) => {
      const timer = setTimeout(resolve, ms);
      signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
    });
  }

  // Run ``step`` every ``ms`` while the session lasts; errors show in the banner and are retried.
  async function every(current, name, ms, step) {
    while (current.alive) {
      const started = performance.now();
      try {
        await step();
        setApiError(name, null);
      } catch (err) {
        if (!current.alive) return;
        if (err instanceof AuthError) return authFailed(current, err.message);
        setApiError(name, err.message);
      }
      await sleep(Math.max(0, ms - (performance.now() - started)), current.controller.signal);
    }
  }

  function setApiError(name, message) {
    if (message) view.errors.set(name, message);
    else view.errors.delete(name);
    const banner = $("api-error");
    banner.hidden = view.errors.size === 0;
    banner.textContent = [...view.errors].map(([what, why]) => `Cannot read ${what}: ${why}`).join(" · ")
      + (view.errors.size ? " — retrying every second." : "");
    setConnection(view.errors.size ? "trouble" : "live");
  }

  function setConnection(status) {
    const text = { idle: "not connected", connecting: "connecting…", live: "live", trouble: "reconnecting…",
      refused: "token refused" }[status];
    $("connection").dataset.status = status;
    $("connection-text").textContent = text;
  }

  // ---- Connecting with a token ---------------------------------------------------------------

  function connect(token) {
    disconnect();
    session = { token, controller: new AbortController(), alive: true };
    sessionStorage.setItem(TOKEN_KEY, token);
    $("auth-error").hidden = true;
    $("token-forget").hidden = false;
    setConnection("connecting");
    const current = session;
    every(current, "instances", POLL_MS, refreshInstances);
    every(current, "live requests", POLL_MS, async () => {
      view.live = (await api("/admin/v1/live-requests")).requests;
      renderLive();
    });
    every(current, "admission", POLL_MS, async () => {
      view.admission = await api("/admin/v1/admission");
      renderAdmission();
    });
    every(current, "recent requests", RECENT_MS, async () => {
      view.recent = (await api(`/admin/v1/requests?limit=${RECENT_LIMIT}`)).requests;
      renderRecent();
    });
    followEvents(current);
  }

  function disconnect() {
    if (session) {
      session.alive = false;
      session.controller.abort();
    }
    session = null;
    view.errors.clear();
    $("api-error").hidden = true;
  }

  function authFailed(current, message) {
    if (current !== session) return;
    disconnect();
    sessionStorage.removeItem(TOKEN_KEY);
    const banner = $("auth-error");
    banner.textContent = `The admin API refused the token (401: ${message}). Enter the right admin token above.`;
    banner.hidden = false;
    $("token-forget").hidden = true;
    setConnection("refused");
    $("token-input").focus();
  }

  // ---- Instances -----------------------------------------------------------------------------

  async function refreshInstances() {
    const seq = ++view.instancesSeq;
    const body = await api("/admin/v1/instances");
    if (seq < view.instancesSeq) return; // a newer call (after an action or an event) already drew
    view.instances = body.instances;
    $("welcome").hidden = true;
    $("dashboard").hidden = false;
    renderInstances();
    renderFlow();
  }

  let refreshTimer = null;
  function refreshSoon() { // an event said something changed: show it now, not at the next poll
    if (refreshTimer || !session) return;
    refreshTimer = setTimeout(() => {
      refreshTimer = null;
      if (session) refreshInstances().catch(() => {}); // the poll reports errors
    }, 50);
  }

  function poolOf(role) {
    return role === "prefill" || role === "decode" ? role : "both";
  }

  function renderInstances() {
    const seen = new Set();
    const counts = { prefill: 0, decode: 0, both: 0 };
    let readyP = 0;
    let readyD = 0;
    for (const inst of view.instances) {
      seen.add(inst.agent_id);
      record(inst);
      const pool = poolOf(inst.role);
      counts[pool] += 1;
      if (inst.state === "ready" && inst.role !== "decode") readyP += 1;
      if (inst.state === "ready" && inst.role !== "prefill") readyD += 1;
      let card = view.cards.get(inst.agent_id);
      if (!card) {
        card = makeCard(inst.agent_id);
        view.cards.set(inst.agent_id, card);
      }
      updateCard(card, inst);
      const cards = $(`pool-${pool}`).querySelector(".cards");
      cards.append(card.root); // appending in API order (by id) keeps the cards sorted
    }
    for (const [id, card] of view.cards) {
      if (!seen.has(id)) { // removed by an operator
        card.root.remove();
        view.cards.delete(id);
        view.history.delete(id);
      }
    }
    for (const pool of ["prefill", "decode", "both"]) {
      const section = $(`pool-${pool}`);
      section.querySelector(".pool-count").textContent = `${counts[pool]} instance${counts[pool] === 1 ? "" : "s"}`;
      section.querySelector(".empty").hidden = counts[pool] > 0;
    }
    $("pool-both").hidden = counts.both === 0;
    $("stat-ready-prefill").textContent = String(readyP);
    $("stat-ready-decode").textContent = String(readyD);
    $("stat-instances").textContent = String(view.instances.length);
    $("stat-updated").textContent = new Date().toLocaleTimeString();
  }

  function record(inst) {
    let series = view.history.get(inst.agent_id);
    if (!series) {
      series = { sampled: 0, ...Object.fromEntries(SERIES.map((s) => [s.key, []])) };
      view.history.set(inst.agent_id, series);
    }
    // One point a second: the extra reads after an action or an event do not squeeze the time axis,
    // unless the state changed (a death must show at once).
    const now = performance.now();
    if (now - series.sampled < POLL_MS * 0.9 && inst.state === series.state) return;
    series.sampled = now;
    series.state = inst.state;
    // A dead instance's last scrape is stale: draw a gap rather than repeat it.
    const alive = inst.state !== "dead";
    for (const s of SERIES) push(series[s.key], alive ? s.get(inst.metrics || {}) : null);
  }

  function push(list, value) {
    list.push(value);
    if (list.length > HISTORY) list.shift();
  }

  function makeCard(id) {
    const refs = {};
    refs.state = el("span", { className: "state-badge" });
    refs.meta = el("div", { className: "meta" });
    refs.facts = el("dl", { className: "facts" });
    refs.flags = el("div", { className: "flags" });
    refs.reason = el("p", { className: "reason" });
    refs.sparks = {};
    const sparks = el("div", { className: "sparks" });
    for (const s of SERIES) {
      const svg = sparkSvg();
      const value = el("span", { className: "spark-value" });
      const box = el("div", { className: "spark", "data-series": s.key, title: `${s.title} (${s.unit})` },
        el("span", { className: "spark-label", text: `${s.label} (${s.unit})` }), svg, value);
      sparks.append(box);
      refs.sparks[s.key] = { box, path: svg.firstChild, value };
    }
    refs.drain = el("button", { type: "button", "data-action": "drain" });
    refs.cordon = el("button", { type: "button", "data-action": "cordon", className: "secondary" });
    for (const button of [refs.drain, refs.cordon]) {
      button.addEventListener("click", () => act(id, button.dataset.action, button));
    }
    refs.role = roleControls(id);
    const actions = el("div", { className: "actions" }, refs.drain, refs.cordon, refs.role.root);
    refs.root = el("article", { className: "card", "data-instance-id": id },
      el("header", {}, el("span", { className: "inst-id", text: id }), refs.state),
      refs.meta, refs.flags, refs.reason, refs.facts, sparks, actions);
    return refs;
  }

  // ---- Role changes ------------------------------------------------------------------------
  // A select with the three roles and a "Set role" button, beside drain and cordon. The select shows
  // the instance's role; once the operator picks another one, the polls leave it alone ("dirty") until
  // the change is sent, so a refresh does not undo a choice about to be made.
  function roleControls(id) {
    const role = { current: null };
    role.select = el("select", { className: "role-select", "aria-label": `new role for ${id}` },
      ...ROLES.map((r) => el("option", { value: r, text: r })));
    role.button = el("button", { type: "button", "data-action": "role", className: "secondary", text: "Set role" });
    role.root = el("span", { className: "role-controls" }, role.select, role.button);
    role.select.addEventListener("change", () => {
      role.select.dataset.dirty = "1";
      syncRole(role, null);
    });
    role.button.addEventListener("click", () => setRole(id, role));
    return role;
  }

  // Keep the controls in step with the instance (``inst``; null: only the operator's choice changed).
  function syncRole(role, inst) {
    if (inst) {
      role.current = inst.role;
      role.dead = inst.state === "dead";
    }
    const busy = role.button.dataset.busy === "1";
    if (role.select.value === role.current) role.select.dataset.dirty = "";
    if (!busy && role.select.dataset.dirty !== "1") role.select.value = role.current;
    role.select.disabled = role.dead || busy;
    role.button.disabled = role.dead || busy || role.select.value === role.current;
    role.button.title = role.dead ? "dead: no agent to tell"
      : role.select.value === role.current ? `it is ${role.current}: pick another role first`
        : `make it ${role.select.value}: it moves to that pool at once; the agent is told`;
  }

  async function setRole(id, role) {
    const current = session;
    const wanted = role.select.value;
    if (!current || wanted === role.current) return;
    role.button.dataset.busy = "1";
    syncRole(role, null);
    showAction(`Asking ${id} to serve as ${wanted} (an engine that must restart for it is drained first)…`, "info");
    try {
      const body = await api(`/admin/v1/instances/${encodeURIComponent(id)}/role`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ role: wanted }),
      });
      if (body.instance) role.current = body.instance.role;
      const restarted = body.how === "restart" ? ` (its engine restarted: ready after ${body.timeline.ready} s)` : "";
      showAction(`role ${id}: ${body.from} → ${body.role}${restarted}.`, "ok");
    } catch (err) {
      if (err instanceof AuthError) return authFailed(current, err.message);
      // 409: the engine cannot serve that role (the agent's reason is in the message); it keeps its own.
      const refused = err.status === 409 ? "refused" : "failed";
      showAction(`role ${id} → ${wanted}: ${refused} (${err.message}).`, "error");
    } finally {
      role.button.dataset.busy = "";
      role.select.dataset.dirty = ""; // back to showing the instance's role, whichever it now is
      syncRole(role, null);
      if (session === current) refreshInstances().catch(() => {});
    }
  }

  function updateCard(card, inst) {
    const root = card.root;
    root.dataset.state = inst.state;
    root.dataset.role = inst.role;
    card.state.textContent = inst.state;
    card.state.dataset.state = inst.state;
    card.meta.textContent = `${inst.role} · ${inst.model} · ${inst.engine} engine at ${inst.url}`;
    const flags = [];
    if (inst.draining.admin) flags.push(["draining", "draining (operator)"]);
    if (inst.draining.agent) flags.push(["draining", "draining (agent)"]);
    if (inst.cordoned) flags.push(["cordoned", "cordoned"]);
    if (inst.breaker.state !== "closed") flags.push(["breaker", `breaker ${inst.breaker.state.replace("_", "-")}`]);
    card.flags.replaceChildren(...flags.map(([kind, text]) => el("span", { className: `flag ${kind}`, text })));
    const reason = inst.dead_reason || inst.suspect_reason;
    card.reason.textContent = reason ? `Why ${inst.state}: ${reason}` : "";
    card.reason.hidden = !reason;
    const m = inst.metrics || {};
    const facts = [
      ["engine", inst.state === "dead" ? `${inst.engine_state} (its last report)` : inst.engine_state],
      ["breaker", `${inst.breaker.state.replace("_", "-")} (${inst.breaker.failures} failed in a row)`],
      ["in flight", `${inst.in_flight} (engine: ${m.num_running ?? 0} running, ${m.num_waiting ?? 0} waiting)`],
      ["served", `${inst.requests_total} requests`],
      ["heartbeat", `${inst.seconds_since_heartbeat.toFixed(1)} s ago (session ${inst.session})`],
    ];
    card.facts.replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
    const series = view.history.get(inst.agent_id);
    for (const s of SERIES) drawSpark(card.sparks[s.key], series[s.key], s);
    const dead = inst.state === "dead";
    const drained = inst.draining.admin;
    card.drain.dataset.action = drained ? "undrain" : "drain";
    card.drain.textContent = drained ? "Undrain" : "Drain";
    card.drain.title = dead ? "dead: no agent to tell" : drained ? "route new requests to it again"
      : "stop new requests; in-flight ones finish; the agent is told";
    card.drain.disabled = dead || card.drain.dataset.busy === "1";
    card.cordon.dataset.action = inst.cordoned ? "uncordon" : "cordon";
    card.cordon.textContent = inst.cordoned ? "Uncordon" : "Cordon";
    card.cordon.title = inst.cordoned ? "route new requests to it again" : "stop new requests; the agent is not told";
    syncRole(card.role, inst);
  }

  function sparkSvg() {
    const svg = document.createElementNS(SVG_NS, "svg");
    svg.setAttribute("viewBox", "0 0 120 28");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("class", "spark-svg");
    svg.append(document.createElementNS(SVG_NS, "path"));
    return svg;
  }

  function drawSpark(spark, values, series) {
    const present = values.filter((v) => v !== null);
    const max = series.max || Math.max(...present, 1e-9) * 1.15;
    // The first half minute fills the width as it comes, then the line scrolls within two minutes.
    const span = Math.min(HISTORY, Math.max(values.length, 30));
    const step = 120 / (span - 1);
    const offset = span - values.length;
    let d = "";
    let pen = false;
    values.forEach((v, i) => {
      if (v === null) { pen = false; return; }
      const x = ((offset + i) * step).toFixed(1);
      const y = (26 - (Math.min(v, max) / max) * 24).toFixed(1);
      d += `${pen ? "L" : "M"}${x} ${y} `;
      pen = true;
    });
    spark.path.setAttribute("d", d.trim());
    spark.box.dataset.points = String(present.length);
    const last = values.length ? values[values.length - 1] : null;
    spark.value.textContent = fmtValue(last, series.unit);
  }

  async function act(id, action, button) {
    const current = session;
    if (!current) return;
    button.dataset.busy = "1";
    button.disabled = true;
    showAction(`Sending ${action} to ${id}…`, "info");
    try {
      const body = await api(`/admin/v1/instances/${encodeURIComponent(id)}/${action}`, { method: "POST" });
      const ack = body.ack ? (body.ack.ok ? "; the agent acknowledged" : `; the agent answered: ${body.ack.error}`) : "";
      const now = body.instance ? `; it is now ${body.instance.state}` : "";
      showAction(`${action} ${id}: done${ack}${now}.`, "ok");
    } catch (err) {
      if (err instanceof AuthError) return authFailed(current, err.message);
      // Drain and undrain change routing before the agent is asked, so a 502/504 is half a success.
      const routed = (action === "drain" || action === "undrain") && (err.status === 502 || err.status === 504);
      showAction(`${action} ${id}: ${routed ? "routing changed, but the agent did not confirm" : "failed"} (${err.message}).`,
        "error");
    } finally {
      button.dataset.busy = "";
      button.disabled = false;
      if (session === current) refreshInstances().catch(() => {});
    }
  }

  function showAction(text, kind) {
    const banner = $("action-status");
    banner.textContent = `${new Date().toLocaleTimeString()} · ${text}`;
    banner.dataset.kind = kind;
    banner.hidden = false;
  }

  // ---- Requests ------------------------------------------------------------------------------

  // A request's row: keyed by the gateway's own id; the client's X-Request-Id, where it sent one, is
  // what the row shows (the operator searches by it), the gateway's id its tooltip.
  function requestIds(r) {
    return { "data-request-id": r.request_id, "data-client-request-id": r.client_request_id || "" };
  }

  function renderLive() {
    const rows = view.live.map((r) => el("tr", requestIds(r),
      el("td", { className: "mono", text: r.client_request_id || r.request_id, title: r.request_id }),
      el("td", { text: r.model }),
      el("td", { text: r.mode }),
      el("td", { text: STAGES[r.stage] || r.stage }),
      el("td", { text: pair(r.prefill, r.decode) }),
      el("td", { className: "num", text: fmtSeconds(r.age_s) }),
      el("td", { className: "num", text: String(r.attempts) }),
      el("td", { className: "num", text: String(r.resumes) })));
    const table = $("live-requests");
    table.querySelector("tbody").replaceChildren(...rows);
    table.nextElementSibling.hidden = rows.length > 0;
    $("live-count").textContent = `(${rows.length})`;
    $("stat-live").textContent = String(rows.length);
    push(view.liveHistory, rows.length);
    drawClusterSpark();
    renderFlow();
  }

  // ---- Admission -----------------------------------------------------------------------------

  // "a:2 b:1" of {a: 2, b: 1}, leaving out zeros; "–" when nothing is left. ``order`` sorts the keys
  // (a JavaScript object lists "0" before "-1", whatever order the JSON had).
  function tally(counts, sep = ":", order = undefined) {
    const kept = Object.entries(counts || {}).filter(([, n]) => n);
    if (order) kept.sort(([a], [b]) => order(a, b));
    return kept.map(([key, n]) => `${key}${sep}${n}`).join(" ") || "–";
  }

  function renderAdmission() {
    const a = view.admission;
    const models = Object.entries(a.models || {});
    const rows = models.map(([name, m]) => {
      const counts = m.counts || {};
      const stage = m.saturated
        ? el("span", { className: "flag saturated", title: `${m.saturated} holds the queue back: its pair has no room`, text: m.saturated })
        : "–";
      return el("tr", { "data-model": name, className: m.saturated ? "saturated" : "" },
        el("td", { text: name }),
        el("td", { className: "num", "data-field": "depth", text: String(m.depth) }),
        el("td", { "data-field": "by-priority", text: tally(m.by_priority, ":", (a, b) => Number(a) - Number(b)) }),
        el("td", { "data-field": "by-tenant", text: tally(m.by_tenant) }),
        el("td", { className: "num", text: m.depth ? fmtSeconds(m.oldest_wait_s) : "–" }),
        el("td", { "data-field": "saturated" }, stage),
        el("td", { className: "num", "data-field": "admitted", text: String(counts.admitted || 0) }),
        el("td", { className: "num", "data-field": "queued", text: String(counts.queued || 0) }),
        el("td", { "data-field": "shed", text: tally(counts.shed, "=") }));
    });
    const table = $("admission");
    table.querySelector("tbody").replaceChildren(...rows);
    table.hidden = !a.enabled;
    const empty = $("admission-empty");
    empty.hidden = rows.length > 0;
    empty.textContent = a.enabled ? "No request through admission yet."
      : "Admission is off (--admission off): every request goes straight to an engine.";
    const waiting = models.reduce((sum, [, m]) => sum + m.depth, 0);
    $("admission-count").textContent = a.enabled ? `(${waiting} waiting)` : "(off)";
    const named = a.enabled ? tally(a.tenants.weights, "=") : "–";
    $("admission-weights").textContent = !a.enabled ? "–"
      : `${named === "–" ? "none set" : named} (any other tenant: ${a.tenants.default_weight})`;
  }

  function drawClusterSpark() {
    const holder = $("stat-live-spark");
    if (!holder.firstChild) holder.append(sparkSvg(), el("span", { className: "spark-value" }));
    const spark = { box: holder, path: holder.querySelector("path"), value: holder.querySelector(".spark-value") };
    drawSpark(spark, view.liveHistory, { unit: "" });
    spark.value.textContent = `max ${Math.max(0, ...view.liveHistory)}`;
  }

  function pickOf(profile) {
    if (!profile || !profile.pick) return "–";
    const row = (profile.candidates || []).find((c) => c.id === profile.pick);
    const score = row ? ` · ${row.total.toFixed(2)}` : "";
    const n = (profile.candidates || []).length;
    return `${profile.pick}${score}${n > 1 ? `, best of ${n}` : ""}`;
  }

  function scoresTable(title, profile) {
    if (!profile) return null;
    const scorers = Object.keys(profile.weights || {});
    const head = el("tr", {}, el("th", { text: "candidate" }),
      ...scorers.map((name) => el("th", { className: "num", text: `${name} ×${profile.weights[name]}` })),
      el("th", { className: "num", text: "total" }));
    const rows = (profile.candidates || []).map((c) => el("tr", { className: c.id === profile.pick ? "picked" : "" },
      el("td", { text: c.id === profile.pick ? `${c.id} ✔` : c.id }),
      ...scorers.map((name) => el("td", { className: "num", text: (c.scores[name] ?? 0).toFixed(3) })),
      el("td", { className: "num", text: c.total.toFixed(3) })));
    const filtered = (profile.filtered || []).map((f) => `${f.id} (${f.filter})`).join(", ");
    return el("div", { className: "scores" },
      el("div", { className: "scores-title", text: `${title}: ${profile.eligible} eligible of ${profile.population}, picker ${profile.picker}` }),
      el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)),
      filtered ? el("div", { className: "filtered", text: `filtered out: ${filtered}` }) : null);
  }

  function recentRow(r) {
    const ex = r.explanation || {};
    const why = [];
    if (ex.decider && ex.decider.reason) why.push(ex.decider.reason);
    if (r.fallback) why.push(`fallback: ${r.fallback}`);
    if (r.resumes) why.push(`resumed ${r.resumes}×`);
    if (r.relay) why.push(r.relay);
    if (r.unread_events) why.push(`${r.unread_events} stream event(s) passed on unread`);
    if (r.error) why.push(r.error);
    if (r.kv_check) why.push(r.kv_check);
    const row = el("tr", { ...requestIds(r), className: r.status >= 400 ? "failed" : "" },
      el("td", { className: "mono", text: r.client_request_id || r.request_id, title: r.request_id }),
      el("td", { className: `num status ${r.status >= 400 ? "bad" : "good"}`, text: String(r.status) }),
      el("td", { text: r.mode }),
      el("td", { text: pair(r.prefill, r.decode) }),
      el("td", { className: "num", text: fmtSeconds(r.total_s) }),
      el("td", { className: "num", text: fmtSeconds(r.ttfb_s) }),
      el("td", { text: pickOf(ex.decode) }),
      el("td", { text: ex.prefill ? pickOf(ex.prefill) : "–" }),
      el("td", { className: "why", text: why.join("; ") || "–" }));
    if (!r.explanation) return [row];
    // The scores get a full-width row of their own: a table per profile does not fit in a cell.
    const summary = `scores: decode ${pickOf(ex.decode)}${ex.prefill ? `; prefill ${pickOf(ex.prefill)}` : ""}`;
    return [row, el("tr", { className: "details-row", "data-details-for": r.request_id },
      el("td", { colspan: "9" }, el("details", {}, el("summary", { text: summary }),
        el("div", { className: "scores-pair" }, scoresTable("decode", ex.decode), scoresTable("prefill", ex.prefill)))))];
  }

  function renderRecent() {
    // Rows are kept by request id, so a row whose details an operator opened stays open.
    const rows = new Map();
    for (const r of view.recent) {
      const key = `${r.request_id}|${r.kv_check}`;
      const old = view.recentRows.get(r.request_id);
      rows.set(r.request_id, old && old.key === key ? old : { key, rows: recentRow(r) });
    }
    view.recentRows = rows;
    const table = $("recent-requests");
    table.querySelector("tbody").replaceChildren(...[...rows.values()].flatMap((x) => x.rows));
    table.nextElementSibling.hidden = rows.size > 0;
    $("recent-count").textContent = `(last ${rows.size})`;
    renderFlow();
  }

  function renderFlow() {
    const ids = (roles) => view.instances.filter((i) => roles.includes(i.role)).map((i) => i.agent_id);
    const prefills = ids(["prefill", "both"]);
    const decodes = ids(["decode", "both"]);
    const count = (list) => {
      const out = new Map();
      for (const r of list) {
        if (!r.decode) continue;
        const key = `${r.prefill || ""}|${r.decode}`;
        out.set(key, (out.get(key) || 0) + 1);
        if (r.prefill && !prefills.includes(r.prefill)) prefills.push(r.prefill); // since removed
        if (!decodes.includes(r.decode)) decodes.push(r.decode);
      }
      return out;
    };
    const live = count(view.live);
    const recent = count(view.recent);
    const rowsOf = [...prefills, ""].filter((p) => p || [...live.keys(), ...recent.keys()].some((k) => k.startsWith("|")));
    const head = el("tr", {}, el("th", { text: "prefill ↓  decode →" }), ...decodes.map((d) => el("th", { text: d })));
    const body = rowsOf.map((p) => el("tr", {}, el("th", { text: p || "colocated (no P)" }), ...decodes.map((d) => {
      const key = `${p}|${d}`;
      const n = live.get(key) || 0;
      const cell = el("td", { className: n ? "hot num" : "num", "data-pair": `${p || "colocated"}->${d}`,
        title: `${pair(p, d)}: ${n} in flight, ${recent.get(key) || 0} of the recent requests` });
      cell.append(el("b", { text: String(n) }), ` / ${recent.get(key) || 0}`);
      return cell;
    })));
    $("flow").replaceChildren(decodes.length ? el("table", { className: "data flow" }, el("thead", {}, head), el("tbody", {}, ...body))
      : el("p", { className: "empty", text: "No decode instance yet." }));
  }

  // ---- The event log: server-sent events through fetch() -------------------------------------

  // The text/event-stream format: "field: value" lines, a blank line ends an event, ":" a comment.
  class SseParser {
    constructor(onEvent) {
      this.onEvent = onEvent;
      this.buffer = "";
      this.reset();
    }

    reset() {
      this.data = [];
      this.type = "";
      this.id = null;
    }

    push(text) {
      this.buffer += text;
      for (;;) {
        const match = /\r\n|\r|\n/.exec(this.buffer);
        if (!match) return;
        // A lone "\r" at the end may be the first half of "\r\n" still in flight.
        if (match[0] === "\r" && match.index === this.buffer.length - 1) return;
        const line = this.buffer.slice(0, match.index);
        this.buffer = this.buffer.slice(match.index + match[0].length);
        this.line(line);
      }
    }

    line(line) {
      if (line === "") {
        if (this.data.length) this.onEvent({ id: this.id, type: this.type || "message", data: this.data.join("\n") });
        this.reset();
        return;
      }
      if (line.startsWith(":")) return; // keepalive
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") this.data.push(value);
      else if (field === "event") this.type = value;
      else if (field === "id") this.id = value;
    }
  }

  function eventsFetch(current, query) {
    // ``since`` and Last-Event-ID say the same: resume after the last event shown, missing nothing.
    return fetch(`/admin/v1/events?${query}`, {
      headers: { Authorization: `Bearer ${current.token}`, Accept: "text/event-stream",
        "Last-Event-ID": String(view.lastEventId) },
      cache: "no-store",
      signal: current.controller.signal,
    });
  }

  // After a lost stream the orchestrator may have restarted, numbering its events from 1 again; its
  // log then lacks the last event shown, which a running orchestrator always still keeps.
  async function restarted(current) {
    if (!view.lastEventId) return false;
    const resp = await eventsFetch(current, `follow=false&since=${view.lastEventId - 1}`);
    return resp.ok && (await resp.text()).trim() === "";
  }

  async function followEvents(current) {
    let backoff = 1000;
    let lost = false;
    while (current.alive) {
      let overflow = false;
      try {
        setEventsStatus("connecting…");
        if (lost && (await restarted(current))) {
          view.lastEventId = 0;
          $("events").prepend(el("li", { "data-kind": "restart" }, el("time"), el("span", { className: "kind", text: "—" }),
            el("span", { className: "text", text: "the orchestrator restarted: its event log starts again" })));
        }
        const resp = await eventsFetch(current, `since=${view.lastEventId}`);
        if (resp.status === 401) {
          const body = await resp.json().catch(() => null);
          return authFailed(current, body && body.error ? body.error.message : "unauthorized");
        }
        if (!resp.ok || !resp.body) throw new Error(`HTTP ${resp.status}`);
        setEventsStatus("live");
        backoff = 1000;
        const parser = new SseParser((event) => {
          if (event.type === "overflow") overflow = true;
          else addEvent(event);
        });
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        while (!overflow) {
          const { value, done } = await reader.read();
          if (done) break;
          parser.push(decoder.decode(value, { stream: true }));
        }
        reader.cancel().catch(() => {});
        lost = !overflow;
      } catch (err) {
        if (!current.alive) return;
        lost = true;
        setEventsStatus(`reconnecting (${err.message})`);
      }
      if (!overflow) { // the orchestrator went away: wait a little longer each time
        await sleep(backoff, current.controller.signal);
        backoff = Math.min(backoff * 2, 10000);
      }
    }
  }

  function setEventsStatus(text) {
    $("events-status").textContent = `(${text})`;
    $("events-status").dataset.status = text;
  }

  function describe(e) {
    switch (e.kind) {
      case "joined": return `${e.instance} joined as ${e.role} (session ${e.session}, ${e.model} at ${e.url})`;
      case "not_resumable":
        return `${e.instance}: its engine lacks ${(e.missing || []).join(", ")}: its streams are not resumable`;
      case "state": return `${e.instance}: ${e.from || "new"} → ${e.to}${e.reason ? ` (${e.reason})` : ""}`;
      case "breaker": return `${e.instance}: breaker ${e.from} → ${e.to} after ${e.failures} failure(s)`;
      case "link": return `link ${e.prefill} → ${e.decode}: breaker ${e.from} → ${e.to}`;
      case "fallback": return `request ${e.request_id} ran colocated on ${e.decode} (${e.cause})`;
      case "resume": return `request ${e.request_id} resumed on ${e.to} (${e.cause})`;
      case "kv_recomputed":
        return `${e.decode} computed ${e.tokens} prompt tokens of KV it was handed by ${(e.prefills || []).join(", ")}`;
      case "removed": return `${e.instance} removed by an operator`;
      case "role": return `${e.instance}: role ${e.from} → ${e.to}`;
      case "rollout":
        return `rollout of ${e.model} ${e.from} → ${e.to}: ${e.what}${e.instance ? ` ${e.instance}` : ""}`;
      case "role_restart": {
        const steps = Object.entries(e.timeline || {}).map(([k, v]) => `${k} ${v} s`).join(", ");
        const left = e.left_in_flight ? `, ${e.left_in_flight} request(s) failed over` : "";
        return `${e.instance}: role ${e.from} → ${e.to} by restart: ${e.step}${steps ? ` (${steps})` : ""}${left}${e.error ? `: ${e.error}` : ""}`;
      }
      case "planner_shift":
        return `planner${e.dry_run ? " (dry run)" : ""}: ${e.instance} ${e.from} → ${e.to}, ${e.outcome}: ${e.reason}`;
      default: {
        const { seq: _seq, at: _at, kind: _kind, ...rest } = e;
        return JSON.stringify(rest);
      }
    }
  }

  function addEvent(event) {
    const seq = Number(event.id);
    if (!(seq > view.lastEventId)) return; // already shown (a reconnect replays from ``since``)
    view.lastEventId = seq;
    let data;
    try {
      data = JSON.parse(event.data);
    } catch {
      data = { kind: event.type, text: event.data };
    }
    const kind = data.kind || event.type;
    const when = data.at ? new Date(data.at * 1000).toLocaleTimeString() : "";
    const item = el("li", { "data-kind": kind, "data-seq": String(seq), "data-to": data.to || null },
      el("time", { text: when }), el("span", { className: "kind", text: kind }),
      el("span", { className: "text", text: describe(data) }));
    const list = $("events");
    list.prepend(item);
    while (list.children.length > MAX_EVENTS) list.lastElementChild.remove();
    $("events-empty").hidden = true;
    if (["joined", "state", "breaker", "removed", "role", "role_restart"].includes(kind)) refreshSoon();
  }

  // ---- Start ---------------------------------------------------------------------------------

  function start() {
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = $("token-input");
      const token = input.value.trim();
      input.value = ""; // the token lives in sessionStorage only, not in the page
      if (!token) {
        $("auth-error").textContent = "Enter the admin token first.";
        $("auth-error").hidden = false;
        return;
      }
      connect(token);
    });
    $("token-forget").addEventListener("click", () => {
      disconnect();
      sessionStorage.removeItem(TOKEN_KEY);
      $("token-forget").hidden = true;
      $("dashboard").hidden = true;
      $("welcome").hidden = false;
      setConnection("idle");
    });
    const saved = sessionStorage.getItem(TOKEN_KEY);
    if (saved) connect(saved);
    else setConnection("idle");
  }

  start();
})();

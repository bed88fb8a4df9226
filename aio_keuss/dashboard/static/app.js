// The aio-keuss dashboard page: polls /api/state every second and draws it.
// Every value from the server (queue names, ids, headers, payloads) is inserted with
// textContent or as an attribute value through the DOM API, never as markup.
"use strict";

(() => {
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  const csrf = document.querySelector('meta[name="csrf-token"]').getAttribute("content");
  const queueRows = new Map();
  const deadRows = new Map();
  let state = null;
  let peekQueue = null;
  let busy = false;
  let refreshes = 0;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  function cell(cls, text) {
    return el("td", { class: cls }, text);
  }

  function pre(text) {
    const td = el("td");
    td.appendChild(el("pre", {}, text));
    return td;
  }

  function headersText(headers) {
    return Object.entries(headers).map(([k, v]) => `${k}: ${v}`).join("\n");
  }

  function when(seconds) {
    return new Date(seconds * 1000).toLocaleTimeString();
  }

  async function api(path, body) {
    const options = { credentials: "same-origin", headers: { Accept: "application/json" } };
    if (body !== undefined) {
      options.method = "POST";
      options.headers["Content-Type"] = "application/json";
      options.headers["X-CSRF-Token"] = csrf;
      options.body = JSON.stringify(body);
    }
    const response = await fetch(path, options);
    let data = null;
    try {
      data = await response.json();
    } catch (_) {
      data = null;
    }
    if (!response.ok) {
      throw new Error((data && data.error) || `${response.status} ${response.statusText}`);
    }
    return data.result;
  }

  function status(text, bad) {
    const node = document.getElementById("status");
    node.textContent = text;
    node.className = bad ? "bad" : "";
  }

  // queues -------------------------------------------------------------------------------

  function sparkline(series) {
    const width = 160;
    const height = 34;
    const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "spark" });
    chart.appendChild(svg("rect", { x: 0, y: 0, width, height, fill: "#f3f5f8", rx: 3 }));
    if (!series || series.length < 2) {
      chart.appendChild(svg("text", { x: 6, y: 21, "font-size": 11, fill: "#8a93a3" }, "sampling..."));
      return chart;
    }
    const t0 = series[0][0];
    const span = Math.max(series[series.length - 1][0] - t0, 1);
    const top = Math.max(1, ...series.map((p) => Math.max(p[1], p[2])));
    for (const [index, colour] of [[1, "#2f6fdb"], [2, "#1f9d55"]]) {
      const points = series.map((p) => {
        const x = 2 + ((p[0] - t0) / span) * (width - 4);
        const y = height - 3 - (p[index] / top) * (height - 6);
        return `${x.toFixed(1)},${y.toFixed(1)}`;
      });
      chart.appendChild(svg("polyline", {
        points: points.join(" "), fill: "none", stroke: colour, "stroke-width": 1.5,
      }));
    }
    return chart;
  }

  function rateText(series) {
    if (!series || series.length === 0) return "";
    const last = series[series.length - 1];
    const span = Math.round(last[0] - series[0][0]);
    const over = span >= 120 ? `${Math.round(span / 60)} min` : `${span} s`;
    return `${last[1].toFixed(1)} in/s, ${last[2].toFixed(1)} done/s (chart: ${over})`;
  }

  function queueRow(name) {
    const row = el("tr", { "data-queue": name });
    row.appendChild(cell("name", name));
    for (const cls of ["ready", "scheduled", "reserved", "total"]) row.appendChild(cell(`num ${cls}`, ""));
    const rates = el("td");
    const box = el("div", { class: "rates" });
    box.appendChild(el("span", { class: "chart" }));
    box.appendChild(el("span", { class: "figures" }));
    rates.appendChild(box);
    row.appendChild(rates);
    row.appendChild(cell("state", ""));
    const actions = el("td", { class: "actions" });
    const toggle = el("button", { type: "button", class: "toggle" }, "Pause");
    toggle.addEventListener("click", () => act(toggle, async () => {
      const paused = row.getAttribute("data-paused") === "true";
      await api(paused ? "/api/resume" : "/api/pause", { queue: name });
    }));
    const peek = el("button", { type: "button", class: "peek" }, "Peek");
    peek.addEventListener("click", () => openPeek(name));
    actions.appendChild(toggle);
    actions.appendChild(peek);
    row.appendChild(actions);
    return row;
  }

  function drawQueues() {
    const body = document.querySelector("#queues tbody");
    const seen = new Set();
    for (const queue of state.queues) {
      seen.add(queue.name);
      let row = queueRows.get(queue.name);
      if (!row) {
        row = queueRow(queue.name);
        queueRows.set(queue.name, row);
      }
      body.appendChild(row); // keeps the server's (sorted) order
      for (const cls of ["ready", "scheduled", "reserved", "total"]) {
        const value = cls === "ready" ? queue.size : queue[cls];
        row.querySelector(`td.${cls}`).textContent = String(value);
      }
      row.setAttribute("data-paused", String(queue.paused));
      const stateCell = row.querySelector("td.state");
      stateCell.textContent = queue.paused ? "paused" : "running";
      stateCell.className = `state state-${queue.paused ? "paused" : "running"}`;
      row.querySelector("button.toggle").textContent = queue.paused ? "Resume" : "Pause";
      // own keys only: a queue may be named like a member of every object (constructor)
      const own = Object.prototype.hasOwnProperty.call(state.rates, queue.name);
      const series = own ? state.rates[queue.name] : undefined;
      row.querySelector("span.chart").replaceChildren(sparkline(series));
      row.querySelector("span.figures").textContent = rateText(series);
    }
    for (const [name, row] of queueRows) {
      if (!seen.has(name)) {
        row.remove();
        queueRows.delete(name);
      }
    }
    document.getElementById("queues-empty").hidden = state.queues.length > 0;
  }

  // peek ---------------------------------------------------------------------------------

  function openPeek(name) {
    peekQueue = name;
    document.getElementById("peek-section").hidden = false;
    document.getElementById("peek-queue").textContent = name;
    drawPeek();
  }

  async function drawPeek() {
    if (peekQueue === null) return;
    const note = document.getElementById("peek-note");
    const body = document.querySelector("#peek tbody");
    if (!state.capabilities.peek) {
      note.textContent = `The ${state.backend} backend cannot show messages without taking them.`;
      body.replaceChildren();
      return;
    }
    const asked = peekQueue;
    const chosen = document.getElementById("peek-state").value;
    const query = new URLSearchParams({ queue: asked, state: chosen, n: "50" });
    // an answer for a queue or state no longer chosen (it came back late) is dropped
    const stale = () =>
      peekQueue !== asked || document.getElementById("peek-state").value !== chosen;
    try {
      const messages = await api(`/api/messages?${query}`);
      if (stale()) return;
      const rows = messages.map((m) => {
        const row = el("tr", { "data-id": m.id });
        row.appendChild(cell("id", m.shown_id));
        row.appendChild(cell("", m.state));
        row.appendChild(cell("", when(m.at)));
        row.appendChild(cell("num", m.tries));
        row.appendChild(cell("num priority", m.priority));
        row.appendChild(pre(headersText(m.headers)));
        row.appendChild(pre(m.payload));
        row.querySelector("td:last-child pre").classList.add("payload");
        row.appendChild(promoteCell(asked, m));
        return row;
      });
      body.replaceChildren(...rows);
      note.textContent = messages.length ? `first ${messages.length} (at most 50)` : "empty";
      note.className = "note";
    } catch (error) {
      if (stale()) return;
      note.textContent = String(error.message);
      note.className = "note bad";
    }
  }

  // a scheduled message made ready now (where the backend has capabilities.reschedule)
  function promoteCell(queue, m) {
    const actions = el("td");
    if (m.state !== "scheduled" || !state.capabilities.promote) return actions;
    const button = el("button", { type: "button", class: "promote" }, "Promote");
    button.addEventListener("click", () => act(button, async () => {
      const promoted = await api("/api/promote", { queue, id: m.id });
      if (!promoted) throw new Error("no longer scheduled (taken, removed or ready already)");
    }));
    actions.appendChild(button);
    return actions;
  }

  // deadletter ---------------------------------------------------------------------------

  function deadRow(m) {
    const row = el("tr", { "data-id": m.id });
    row.appendChild(cell("id", m.shown_id));
    row.appendChild(cell("from", m.headers["x-dl-from-queue"] || ""));
    row.appendChild(cell("num tries", m.tries));
    row.appendChild(pre(headersText(m.headers)));
    row.appendChild(pre(m.payload));
    row.querySelector("td:nth-child(5) pre").classList.add("payload");
    const actions = el("td");
    const button = el("button", { type: "button", class: "requeue" }, "Requeue");
    button.disabled = !state.capabilities.requeue;
    button.addEventListener("click", () => act(button, async () => {
      // the answer names what moved: nothing for a message held by a consumer, gone, or
      // whose x-dl-from-queue names no queue
      const moved = await api("/api/requeue", { queue: state.deadletter, ids: [m.id] });
      if (!Object.prototype.hasOwnProperty.call(moved, m.id)) {
        throw new Error("not requeued (held by a consumer, gone, or no valid x-dl-from-queue)");
      }
    }));
    actions.appendChild(button);
    row.appendChild(actions);
    return row;
  }

  async function drawDeadletter() {
    document.getElementById("dl-name").textContent = state.deadletter;
    const note = document.getElementById("dl-note");
    const body = document.querySelector("#deadletter tbody");
    const all = document.getElementById("dl-requeue-all");
    const listed = state.queues.some((q) => q.name === state.deadletter);
    all.disabled = !listed || !state.capabilities.requeue;
    if (!listed || !state.capabilities.peek) {
      note.textContent = listed
        ? `The ${state.backend} backend cannot show messages without taking them.`
        : "No deadletter queue on this backend yet.";
      body.replaceChildren();
      deadRows.clear();
      return;
    }
    const query = new URLSearchParams({ queue: state.deadletter, state: "all", n: "50" });
    let messages;
    try {
      messages = await api(`/api/messages?${query}`);
    } catch (error) {
      note.textContent = String(error.message);
      note.className = "note bad";
      return;
    }
    const seen = new Set();
    for (const m of messages) {
      seen.add(m.id);
      // kept while the message is as drawn (a row being clicked is not replaced under the
      // pointer); drawn again when it changed: requeued and deadlettered again between two
      // refreshes, it failed elsewhere, with other tries and headers, under the same id
      const drawn = JSON.stringify(m);
      let kept = deadRows.get(m.id);
      if (!kept || kept.drawn !== drawn) {
        const row = deadRow(m);
        if (kept) kept.row.replaceWith(row);
        kept = { row, drawn };
        deadRows.set(m.id, kept);
      }
      body.appendChild(kept.row);
    }
    for (const [id, kept] of deadRows) {
      if (!seen.has(id)) {
        kept.row.remove();
        deadRows.delete(id);
      }
    }
    note.className = "note";
    note.textContent = messages.length
      ? `${messages.length} shown (at most 50)`
      : "Nothing in the deadletter queue.";
    if (!state.capabilities.requeue) note.textContent += "; this backend cannot requeue.";
  }

  // pipelines ----------------------------------------------------------------------------

  function layout(pipeline) {
    const edges = [];
    const nodes = new Map();
    const add = (id, label, kind, handler) => {
      if (!nodes.has(id)) nodes.set(id, { id, label, kind, handler });
    };
    for (const queue of pipeline.queues) add(`q:${queue}`, queue, "queue");
    for (const station of pipeline.stations) {
      add(`q:${station.from}`, station.from, "queue");
      const label = `station ${station.name}: ${station.handler}`;
      if (station.to.length === 0) {
        add(`s:${station.name}`, station.name, "sink", station.handler);
        edges.push({ from: `q:${station.from}`, to: `s:${station.name}`, label });
      }
      for (const target of station.to) {
        add(`q:${target}`, target, "queue");
        edges.push({ from: `q:${station.from}`, to: `q:${target}`, label });
      }
    }
    const incoming = new Set(edges.map((e) => e.to));
    let frontier = [...nodes.keys()].filter((id) => !incoming.has(id));
    if (frontier.length === 0 && nodes.size) frontier = [nodes.keys().next().value];
    const depth = new Map(frontier.map((id) => [id, 0]));
    while (frontier.length) {
      const next = [];
      for (const id of frontier) {
        for (const e of edges) {
          if (e.from === id && !depth.has(e.to)) {
            depth.set(e.to, depth.get(id) + 1);
            next.push(e.to);
          }
        }
      }
      frontier = next;
    }
    const columns = new Map();
    for (const id of nodes.keys()) {
      const d = depth.has(id) ? depth.get(id) : 0;
      if (!columns.has(d)) columns.set(d, []);
      columns.get(d).push(id);
      nodes.get(id).column = d;
      nodes.get(id).row = columns.get(d).length - 1;
    }
    return { nodes, edges, columns };
  }

  function graph(pipeline, index) {
    const { nodes, edges, columns } = layout(pipeline);
    const W = 150;
    const H = 46;
    const GX = 90;
    const GY = 26;
    const width = 20 + columns.size * (W + GX);
    const tallest = Math.max(1, ...[...columns.values()].map((c) => c.length));
    const height = 30 + tallest * (H + GY);
    const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    const marker = `arrow-${index}`;
    const defs = svg("defs");
    const head = svg("marker", {
      id: marker, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7,
      orient: "auto-start-reverse",
    });
    head.appendChild(svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#6b7383" }));
    defs.appendChild(head);
    root.appendChild(defs);
    const at = (n) => ({ x: 10 + n.column * (W + GX), y: 15 + n.row * (H + GY) });
    const sizes = new Map(state.queues.map((q) => [q.name, q]));
    for (const e of edges) {
      const a = at(nodes.get(e.from));
      const b = at(nodes.get(e.to));
      const forward = nodes.get(e.to).column > nodes.get(e.from).column;
      let d;
      if (forward) {
        d = `M${a.x + W},${a.y + H / 2} C${a.x + W + GX / 2},${a.y + H / 2} ${b.x - GX / 2},${b.y + H / 2} ${b.x},${b.y + H / 2}`;
      } else {
        const low = Math.max(a.y, b.y) + H + GY * 0.8;
        d = `M${a.x + W / 2},${a.y + H} C${a.x + W / 2},${low} ${b.x + W / 2},${low} ${b.x + W / 2},${b.y + H}`;
      }
      const path = svg("path", { d, fill: "none", stroke: "#8a93a3", "stroke-width": 1.4, "marker-end": `url(#${marker})` });
      path.appendChild(svg("title", {}, e.label));
      root.appendChild(path);
    }
    for (const n of nodes.values()) {
      const p = at(n);
      const group = svg("g", { class: `node node-${n.kind}`, "data-queue": n.kind === "queue" ? n.label : "" });
      const info = sizes.get(n.label);
      const paused = n.kind === "queue" && info && info.paused;
      group.appendChild(svg("rect", {
        x: p.x, y: p.y, width: W, height: H, rx: n.kind === "sink" ? 22 : 5,
        fill: n.kind === "sink" ? "#f3f5f8" : "#fff", stroke: paused ? "#c2410c" : "#2f6fdb",
        "stroke-width": paused ? 2 : 1.2,
      }));
      const label = n.label.length > 20 ? `${n.label.slice(0, 19)}...` : n.label;
      group.appendChild(svg("text", { x: p.x + 8, y: p.y + 18, "font-size": 12, "font-weight": 600, fill: "#1d2430" }, label));
      let detail = `sink ${(n.handler || "").split(":").pop()}`;
      if (n.kind === "queue") {
        detail = info ? `${info.size} ready, ${info.total} total${paused ? ", paused" : ""}` : "not opened yet";
      }
      const shown = detail.length > 26 ? `${detail.slice(0, 25)}...` : detail;
      group.appendChild(svg("text", { x: p.x + 8, y: p.y + 36, "font-size": 11, fill: "#6b7383", class: "size" }, shown));
      group.appendChild(svg("title", {}, n.kind === "sink" ? `sink ${n.label}: ${n.handler}` : n.label));
      root.appendChild(group);
    }
    return root;
  }

  function drawPipelines() {
    const box = document.getElementById("pipelines");
    const parts = state.pipelines.map((pipeline, index) => {
      const part = el("div", { class: "pipeline", "data-pipeline": pipeline.name });
      part.appendChild(el("h3", {}, pipeline.name));
      const holder = el("div", { class: "graph" });
      holder.appendChild(graph(pipeline, index));
      part.appendChild(holder);
      return part;
    });
    box.replaceChildren(...parts);
    document.getElementById("pipelines-empty").hidden = state.pipelines.length > 0;
  }

  // the loop -----------------------------------------------------------------------------

  // An action's outcome, shown instead of "updated ..." by the next refreshes: the refresh
  // that follows every action replaced a failure at once, before anyone could read it.
  let notice = null;
  const NOTICE_REFRESHES = 5;

  async function act(button, work) {
    button.disabled = true;
    try {
      const outcome = await work(); // what it did, when more than "done" can say
      notice = { text: outcome || "done", bad: false, left: 1 };
    } catch (error) {
      notice = { text: `failed: ${error.message}`, bad: true, left: NOTICE_REFRESHES };
    } finally {
      button.disabled = false;
      status(notice.text, notice.bad);
      await refresh();
    }
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      state = await api("/api/state");
      document.getElementById("backend").textContent = state.backend;
      drawQueues();
      drawPipelines();
      await drawDeadletter();
      await drawPeek();
      if (notice !== null && notice.left > 0) {
        notice.left -= 1;
        status(notice.text, notice.bad);
      } else {
        status(`updated ${new Date().toLocaleTimeString()}`, false);
      }
      // how many refreshes completed: lets a test wait for one that began after a change
      document.body.setAttribute("data-refreshes", String(++refreshes));
    } catch (error) {
      status(`cannot update: ${error.message}`, true);
    } finally {
      busy = false;
    }
  }

  document.getElementById("peek-close").addEventListener("click", () => {
    peekQueue = null;
    document.getElementById("peek-section").hidden = true;
  });
  document.getElementById("peek-state").addEventListener("change", drawPeek);
  // A requeue of all moves up to 1,000 ready messages that name a valid origin, walking past
  // those that do not (a bounded number per click), and answers with what moved, how many it
  // passed over (no valid x-dl-from-queue) and how many ready messages are left: the
  // server's counts, not the last refresh's. Any left is shown as a failure, as a single
  // Requeue's is, so that what stayed is not unsaid.
  document.getElementById("dl-requeue-all").addEventListener("click", (event) =>
    act(event.currentTarget, async () => {
      const answer = await api("/api/requeue", { queue: state.deadletter, ids: null });
      const moved = Object.keys(answer.moved).length;
      if (answer.left > 0) {
        throw new Error(`requeued ${moved} of ${moved + answer.left} (${answer.unmovable}`
          + " passed over with no valid x-dl-from-queue; any other left held by a consumer,"
          + " gone, or beyond this click's reach: click again)");
      }
      return `requeued ${moved}`;
    }));

  refresh();
  setInterval(() => {
    if (!document.hidden) refresh(); // a background tab costs the backend nothing
  }, POLL_MS);
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh();
  });
})();

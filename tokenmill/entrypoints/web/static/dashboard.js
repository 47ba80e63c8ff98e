/* The dashboard: one fetch()-read SSE connection to /v1/engine/stream (EventSource cannot send
   the bearer header), reconnected with backoff; tiles, a tokens/s chart, the KV block map and
   speculative acceptance per draft position, all drawn here on <canvas> (no chart library). */
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const WINDOW_S = 120;            // the chart's time span
  const STALE_MS = 5000;           // no event for this long: drop the connection, reconnect
  const series = [];               // [{t, prompt, gen}] over the last WINDOW_S seconds
  let last = null;                 // the latest event

  function cssVar(name) {
    return getComputedStyle(document.body).getPropertyValue(name).trim() || "#888";
  }

  function setStatus(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text || state;
  }

  function setText(id, text) {
    const el = $(id);
    if (el && el.textContent !== text) el.textContent = text;
  }

  function pct(x) { return x === null || x === undefined ? "–" : TM.fmt(100 * x, 1) + "%"; }

  function percentiles(prefix, p) {
    ["p50", "p90", "p99"].forEach((k) => setText(prefix + "-" + k, p ? TM.fmt(p[k], 1) : "–"));
  }

  function updateTiles(ev) {
    setText("model-name", ev.model || "–");
    setText("generation-tps", TM.fmt(ev.generation_tokens_per_s, 1));
    setText("prompt-tps", TM.fmt(ev.prompt_tokens_per_s, 1));
    setText("generation-tokens-total", TM.fmtInt(ev.generation_tokens_total));
    setText("prompt-tokens-total", TM.fmtInt(ev.prompt_tokens_total));
    setText("num-running", TM.fmtInt(ev.num_running));
    setText("num-waiting", TM.fmtInt(ev.num_waiting));
    setText("num-finished", TM.fmtInt(ev.num_requests_finished));
    setText("num-aborted", TM.fmtInt(ev.num_aborted));
    setText("num-preemptions", TM.fmtInt(ev.num_preemptions));
    setText("prefix-hit-rate", pct(ev.prefix_cache_hit_rate));
    const kv = ev.kv || {};
    setText("kv-usage", pct(kv.usage));
    setText("kv-blocks", TM.fmtInt(kv.num_used) + "/" + TM.fmtInt(kv.num_blocks) + " × " +
            TM.fmtInt(kv.block_size));
    setText("kv-used", TM.fmtInt(kv.num_used));
    setText("kv-cached", TM.fmtInt(kv.num_cached));
    setText("kv-free", TM.fmtInt(kv.num_free));
    percentiles("ttft", ev.ttft_ms);
    percentiles("itl", ev.itl_ms);
    setText("updated", new Date((ev.time || Date.now() / 1000) * 1000).toLocaleTimeString());
  }

  /* A canvas sized to its CSS box in device pixels; returns a context in CSS pixels. */
  function prepare(canvas, cssHeight) {
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(100, canvas.parentElement.clientWidth - 2);
    const w = Math.round(width * dpr), h = Math.round(cssHeight * dpr);
    if (canvas.width !== w) canvas.width = w;
    if (canvas.height !== h) canvas.height = h;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, cssHeight);
    return { ctx, width, height: cssHeight };
  }

  function niceMax(x) {
    if (!(x > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 4, 6, 8, 10]) if (m * p >= x) return m * p;
    return 10 * p;
  }

  function drawChart() {
    const { ctx, width, height } = prepare($("tps-chart"), 170);
    const left = 48, right = 8, top = 8, bottom = 22;
    const plotW = width - left - right, plotH = height - top - bottom;
    const now = series.length ? series[series.length - 1].t : Date.now() / 1000;
    const ymax = niceMax(Math.max(1, ...series.map((s) => Math.max(s.gen, s.prompt))));
    ctx.font = "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
    ctx.fillStyle = cssVar("--muted");
    ctx.strokeStyle = cssVar("--grid");
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = top + plotH - (plotH * i) / 4;
      ctx.beginPath(); ctx.moveTo(left, y + 0.5); ctx.lineTo(left + plotW, y + 0.5); ctx.stroke();
      const tick = (ymax * i) / 4;
      ctx.fillText(TM.fmt(tick, Number.isInteger(tick) ? 0 : 1), left - 6, y);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "top";
    for (let s = 0; s <= WINDOW_S; s += 30) {
      const x = left + plotW - (plotW * s) / WINDOW_S;
      ctx.fillText(s === 0 ? "now" : "-" + s + "s", x, top + plotH + 6);
    }
    const xOf = (t) => left + plotW - (plotW * (now - t)) / WINDOW_S;
    const yOf = (v) => top + plotH - (plotH * Math.min(v, ymax)) / ymax;
    [["prompt", "--prompt"], ["gen", "--gen"]].forEach(([key, color]) => {
      if (series.length < 2) return;
      ctx.strokeStyle = cssVar(color);
      ctx.lineWidth = 2;
      ctx.beginPath();
      series.forEach((s, i) => (i ? ctx.lineTo(xOf(s.t), yOf(s[key])) : ctx.moveTo(xOf(s.t), yOf(s[key]))));
      ctx.stroke();
    });
  }

  /* One cell per block, row-major, colored by the map's letter (u used, c cached, f free). */
  function drawKvMap(kv) {
    const canvas = $("kv-map");
    const map = (kv && kv.map) || "";
    const n = map.length;
    const width = Math.max(100, canvas.parentElement.clientWidth - 2);
    let cell = 14;                       // shrink the cells until the grid is at most 240 px tall
    while (cell > 3 && Math.ceil(n / Math.floor(width / cell)) * cell > 240) cell -= 1;
    const perRow = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(n / perRow));
    const { ctx } = prepare(canvas, rows * cell);
    const colors = { u: cssVar("--used"), c: cssVar("--cached"), f: cssVar("--free") };
    const gap = cell >= 8 ? 2 : 1;
    for (let i = 0; i < n; i++) {
      ctx.fillStyle = colors[map[i]] || colors.f;
      ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - gap, cell - gap);
    }
    canvas.dataset.used = String((map.match(/u/g) || []).length);
    canvas.dataset.cached = String((map.match(/c/g) || []).length);
    canvas.dataset.free = String((map.match(/f/g) || []).length);
    canvas.dataset.numBlocks = String(n);
  }

  function drawSpec(spec) {
    const panel = $("spec-panel");
    panel.hidden = !spec;
    if (!spec) return;
    setText("spec-method", spec.method + ", k = " + spec.num_speculative_tokens);
    setText("spec-acceptance", pct(spec.acceptance_rate));
    setText("spec-mean-length", TM.fmt(spec.mean_acceptance_length, 2));
    setText("spec-drafts", TM.fmtInt(spec.num_drafts));
    const rates = spec.accepted_per_position || [];
    const { ctx, width, height } = prepare($("spec-chart"), 120);
    const top = 16, bottom = 20, left = 8;
    const plotH = height - top - bottom;
    const slot = (width - left) / Math.max(1, rates.length);
    const bar = Math.min(60, slot * 0.7);
    ctx.font = "11px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace";
    ctx.textAlign = "center";
    rates.forEach((r, j) => {
      const x = left + j * slot + (slot - bar) / 2;
      const h = plotH * Math.max(0, Math.min(1, r));
      ctx.fillStyle = cssVar("--grid");
      ctx.fillRect(x, top, bar, plotH);
      ctx.fillStyle = cssVar("--gen");
      ctx.fillRect(x, top + plotH - h, bar, h);
      ctx.fillStyle = cssVar("--muted");
      ctx.textBaseline = "bottom";
      ctx.fillText(TM.fmt(100 * r, 0) + "%", x + bar / 2, top + plotH - h - 2);
      ctx.textBaseline = "top";
      ctx.fillText("draft " + (j + 1), x + bar / 2, top + plotH + 4);
    });
  }

  function onEvent(ev) {
    last = ev;
    const t = ev.time || Date.now() / 1000;
    series.push({ t, prompt: ev.prompt_tokens_per_s || 0, gen: ev.generation_tokens_per_s || 0 });
    while (series.length && series[0].t < t - WINDOW_S) series.shift();
    updateTiles(ev);
    drawChart();
    drawKvMap(ev.kv);
    drawSpec(ev.spec);
    document.body.dataset.events = String(Number(document.body.dataset.events || 0) + 1);
  }

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  /* The one connection of this page; reconnects with doubling backoff (0.5 s .. 10 s). */
  async function streamLoop() {
    let delay = 500;
    for (;;) {
      const controller = new AbortController();
      let lastEventAt = Date.now();
      const watchdog = setInterval(() => {
        if (Date.now() - lastEventAt > STALE_MS) controller.abort();
      }, 1000);
      try {
        setStatus("connecting", "connecting");
        const response = await TM.apiFetch("/v1/engine/stream", { signal: controller.signal });
        if (!response.ok) throw new Error(await TM.errorMessage(response));
        setStatus("live", "live");
        await TM.readSSE(response, (ev) => {
          lastEventAt = Date.now();
          delay = 500;
          if (document.getElementById("status").dataset.state !== "live") setStatus("live", "live");
          onEvent(ev);
        });
        throw new Error("stream ended");
      } catch (e) {
        clearInterval(watchdog);
        if (e instanceof TM.AuthError) {
          setStatus("auth", "API key needed");
          await TM.waitForKey();
          continue;
        }
        setStatus("reconnecting", "reconnecting in " + (delay / 1000).toFixed(1) + " s");
        await sleep(delay);
        delay = Math.min(delay * 2, 10000);
      } finally {
        clearInterval(watchdog);
      }
    }
  }

  document.addEventListener("DOMContentLoaded", async () => {
    window.addEventListener("resize", () => { if (last) { drawChart(); drawKvMap(last.kv); drawSpec(last.spec); } });
    drawChart();
    const config = await TM.init();
    document.body.dataset.ready = "1";
    if (config.auth_required && !TM.getKey()) {
      setStatus("auth", "API key needed");
      await TM.waitForKey();
    }
    streamLoop();
  });
})();

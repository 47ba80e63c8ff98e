/* The playground: streams a chat (or raw completion) reply over SSE, keeps the multi-turn
   history in the page, and shows the request's own figures under each reply. */
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const history = [];              // [{role, content}] of finished turns (chat mode only)
  let modelName = null;
  let inFlight = null;             // AbortController of the streaming request

  function showError(message) {
    const box = $("error");
    box.textContent = message || "";
    box.hidden = !message;
  }

  function addMessage(role, text, extraClass) {
    const note = $("empty-note");
    if (note) note.remove();
    const item = document.createElement("div");
    item.className = "message " + role + (extraClass ? " " + extraClass : "");
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role === "assistant" ? "assistant" : role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    item.append(label, content);
    $("messages").append(item);
    scrollDown();
    return item;
  }

  function addReply() {
    const item = addMessage("assistant", "", "reply streaming");
    item.dataset.testid = "reply";
    item.querySelector(".content").classList.add("reply-text");
    const stats = document.createElement("div");
    stats.className = "reply-stats";
    stats.dataset.testid = "reply-stats";
    stats.textContent = "waiting for the first token…";
    item.append(stats);
    return item;
  }

  function scrollDown() {
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  }

  function numberField(id, parse) {
    const raw = $(id).value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    return Number.isFinite(value) ? value : undefined;
  }

  function samplingFields() {
    const fields = {
      temperature: numberField("temperature", parseFloat),
      top_p: numberField("top-p", parseFloat),
      max_tokens: numberField("max-tokens", (s) => parseInt(s, 10)),
      seed: numberField("seed", (s) => parseInt(s, 10)),
    };
    Object.keys(fields).forEach((k) => fields[k] === undefined && delete fields[k]);
    return fields;
  }

  function mode() { return $("mode").value; }

  /* The served model's id (and its name in the header); a 401 throws TM.AuthError. */
  async function ensureModel() {
    if (modelName) return modelName;
    let response;
    try {
      response = await TM.apiFetch("/v1/models");
    } catch (e) {
      if (!(e instanceof TM.AuthError)) $("model-name").textContent = "offline";
      throw e;
    }
    if (!response.ok) throw new Error(await TM.errorMessage(response));
    const body = await response.json();
    modelName = body.data && body.data[0] ? body.data[0].id : null;
    $("model-name").textContent = modelName || "no model";
    return modelName;
  }

  /* At load: the model name as soon as a key (if one is needed) has been given. */
  async function loadModelName() {
    for (;;) {
      try { return await ensureModel(); } catch (e) {
        if (!(e instanceof TM.AuthError)) return null;
        await TM.waitForKey();
      }
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("mode").disabled = busy;
  }

  function buildRequest(text) {
    const body = Object.assign({ model: modelName, stream: true,
                                 stream_options: { include_usage: true } }, samplingFields());
    if (mode() === "completions") {
      body.prompt = text;
      return { path: "/v1/completions", body };
    }
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    body.messages = messages.concat(history, [{ role: "user", content: text }]);
    return { path: "/v1/chat/completions", body };
  }

  /* Figures of one request: TTFT from the click, decode speed between first and last token. */
  function statsLine(m) {
    const parts = [];
    const tokens = m.usage ? m.usage.completion_tokens : m.numChunks;
    parts.push((m.usage ? "" : "~") + TM.fmtInt(tokens) + " tokens");
    if (m.tFirst !== null) parts.push("TTFT " + TM.fmt(m.tFirst - m.t0) + " ms");
    if (m.tFirst !== null && m.tLast > m.tFirst && tokens > 1) {
      parts.push(TM.fmt((tokens - 1) / ((m.tLast - m.tFirst) / 1000), 1) + " tok/s");
    }
    if (m.usage) {
      const details = m.usage.prompt_tokens_details || {};
      parts.push("cached " + TM.fmtInt(details.cached_tokens || 0) + "/" +
                 TM.fmtInt(m.usage.prompt_tokens) + " prompt tokens");
    }
    if (m.spec) {
      parts.push("spec accepted " + TM.fmt(100 * m.spec.acceptance_rate, 0) + "% · mean length " +
                 TM.fmt(m.spec.mean_acceptance_length, 2) + " · " +
                 TM.fmtInt(m.spec.num_accepted_tokens) + "/" + TM.fmtInt(m.spec.num_draft_tokens) +
                 " drafted");
    }
    if (m.finishReason) parts.push(m.finishReason);
    return parts.join(" · ");
  }

  async function fetchSpec(requestId) {
    if (!requestId) return null;
    try {
      const response = await TM.apiFetch("/v1/engine/requests/" + encodeURIComponent(requestId));
      if (!response.ok) return null;
      const body = await response.json();
      return body.spec_decode || null;
    } catch (e) { return null; }
  }

  async function send() {
    const text = $("prompt").value;
    if (!text.trim() || inFlight) return;
    showError("");
    try { await ensureModel(); } catch (e) {
      showError(e instanceof TM.AuthError ? "Enter the API key first." : "Cannot reach the server: " + e.message);
      return;
    }
    const { path, body } = buildRequest(text);
    $("prompt").value = "";
    addMessage(mode() === "completions" ? "prompt" : "user", text);
    const reply = addReply();
    const content = reply.querySelector(".content");
    const statsBox = reply.querySelector(".reply-stats");
    const m = { t0: performance.now(), tFirst: null, tLast: null, numChunks: 0, usage: null,
                spec: null, finishReason: null, requestId: null };
    let replyText = "";
    const controller = new AbortController();
    inFlight = controller;
    setBusy(true);
    try {
      const response = await TM.apiFetch(path, { method: "POST", json: body, signal: controller.signal });
      if (!response.ok) throw new Error(await TM.errorMessage(response));
      await TM.readSSE(response, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || "server error");
        if (chunk.id) m.requestId = chunk.id;
        if (chunk.usage) m.usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const piece = choice.delta ? choice.delta.content : choice.text;
        if (piece) {
          const now = performance.now();
          if (m.tFirst === null) m.tFirst = now;
          m.tLast = now;
          m.numChunks += 1;
          replyText += piece;
          content.textContent = replyText;
          statsBox.textContent = statsLine(m);
          scrollDown();
        }
        if (choice.finish_reason) m.finishReason = "finished: " + choice.finish_reason;
      });
      m.spec = await fetchSpec(m.requestId);
    } catch (e) {
      if (e.name === "AbortError") {
        m.finishReason = "stopped";
        reply.classList.add("stopped");
      } else {
        reply.classList.add("failed");
        m.finishReason = "failed";
        showError(e instanceof TM.AuthError ? "Enter the API key, then send again." : e.message);
      }
    } finally {
      inFlight = null;
      setBusy(false);
      reply.classList.remove("streaming");
      if (m.requestId) reply.dataset.requestId = m.requestId;
      statsBox.textContent = statsLine(m);
    }
    if (mode() === "chat" && !reply.classList.contains("failed")) {
      history.push({ role: "user", content: text }, { role: "assistant", content: replyText });
    }
    if (reply.classList.contains("failed") && !replyText) $("prompt").value = text;
  }

  function stop() {
    if (inFlight) inFlight.abort();
  }

  function clear() {
    stop();
    history.length = 0;
    $("messages").replaceChildren();
    showError("");
  }

  function onModeChange() {
    const completions = mode() === "completions";
    $("system").disabled = completions;
    document.body.classList.toggle("completions-mode", completions);
    $("prompt").placeholder = completions
      ? "Raw prompt, continued by the model (no chat template)"
      : "Message (Enter sends, Shift+Enter for a new line)";
  }

  document.addEventListener("DOMContentLoaded", async () => {
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", stop);
    $("clear").addEventListener("click", clear);
    $("mode").addEventListener("change", onModeChange);
    $("prompt").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    });
    onModeChange();
    const config = await TM.init();
    document.body.dataset.ready = "1";
    if (config.auth_required && !TM.getKey()) await TM.waitForKey();
    loadModelName();
  });
})();

/* Shared by the playground and the dashboard: the API key (kept in sessionStorage only, sent as
   a bearer header, never put in a URL or in the page), an authorized fetch, and a reader for
   `data:` lines of a server-sent-event body (EventSource cannot send an Authorization header). */
"use strict";

(function () {
  const KEY_NAME = "tokenmill.apiKey";
  const keyWaiters = [];

  class AuthError extends Error {
    constructor(message) { super(message || "an API key is required"); this.name = "AuthError"; }
  }

  function getKey() {
    try { return sessionStorage.getItem(KEY_NAME) || ""; } catch (e) { return ""; }
  }

  function setKey(key) {
    try {
      if (key) sessionStorage.setItem(KEY_NAME, key); else sessionStorage.removeItem(KEY_NAME);
    } catch (e) { /* storage disabled: the key lives only as long as this call */ }
    hideKeyForm();
    keyWaiters.splice(0).forEach((resolve) => resolve(key));
  }

  /* Resolves the next time a key is saved through the form. */
  function waitForKey() { return new Promise((resolve) => keyWaiters.push(resolve)); }

  function $(id) { return document.getElementById(id); }

  function showKeyForm(message) {
    const panel = $("auth-panel");
    if (!panel) return;
    panel.hidden = false;
    const note = $("auth-message");
    if (note) note.textContent = message || "This server needs an API key.";
    const input = $("api-key");
    if (input) input.focus();
  }

  function hideKeyForm() {
    const panel = $("auth-panel");
    if (panel) panel.hidden = true;
  }

  function installKeyForm() {
    const form = $("api-key-form");
    if (!form) return;
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();                     // never a real submission (CSP form-action 'none')
      const input = $("api-key");
      const key = input.value.trim();
      input.value = "";                        // the key does not stay in the DOM
      if (key) setKey(key);
    });
    const forget = $("api-key-forget");
    if (forget) forget.addEventListener("click", () => { setKey(""); showKeyForm("Key forgotten."); });
  }

  /* fetch() with the bearer header; a 401 shows the key form and throws AuthError. */
  async function apiFetch(path, options) {
    const opts = Object.assign({}, options || {});
    const headers = new Headers(opts.headers || {});
    const key = getKey();
    if (key) headers.set("Authorization", "Bearer " + key);
    if (opts.json !== undefined) {
      headers.set("Content-Type", "application/json");
      opts.body = JSON.stringify(opts.json);
      delete opts.json;
    }
    opts.headers = headers;
    opts.credentials = "omit";
    opts.cache = "no-store";
    const response = await fetch(path, opts);
    if (response.status === 401) {
      showKeyForm(key ? "The API key was refused. Enter it again." : "This server needs an API key.");
      throw new AuthError(await errorMessage(response));
    }
    return response;
  }

  /* The OpenAI-style {"error": {"message"}} of a failed response, or its status line. */
  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
      if (body && body.detail) return String(body.detail);
    } catch (e) { /* not JSON */ }
    return "HTTP " + response.status + " " + (response.statusText || "");
  }

  /* Calls onData(parsed JSON) for each `data:` event of an SSE body until it ends or `[DONE]`.
     Events are separated by a blank line; several `data:` lines of one event are joined. */
  async function readSSE(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let dataLines = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (dataLines.length) {
            const data = dataLines.join("\n");
            dataLines = [];
            if (data === "[DONE]") { reader.cancel().catch(() => {}); return; }
            onData(JSON.parse(data));
          }
        } else if (line.startsWith("data:")) {
          dataLines.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }                                      // comments (":") and other fields are ignored
      }
    }
    if (dataLines.length && dataLines.join("\n") !== "[DONE]") onData(JSON.parse(dataLines.join("\n")));
  }

  async function loadConfig() {
    try {
      const response = await fetch("/web/config", { credentials: "omit", cache: "no-store" });
      if (response.ok) return await response.json();
    } catch (e) { /* server unreachable: the first real call reports it */ }
    return { auth_required: false, version: "" };
  }

  /* Shows the key form when the server needs a key and none is stored; resolves with config. */
  async function init() {
    installKeyForm();
    const config = await loadConfig();
    const version = $("version");
    if (version && config.version) version.textContent = "v" + config.version;
    if (config.auth_required && !getKey()) showKeyForm("This server needs an API key.");
    return config;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toFixed(digits === undefined ? 0 : digits);
  }

  function fmtInt(value) {
    if (value === null || value === undefined) return "–";
    return Math.round(value).toLocaleString("en-US");
  }

  window.TM = { AuthError, getKey, setKey, waitForKey, showKeyForm, hideKeyForm, apiFetch,
                errorMessage, readSSE, init, fmt, fmtInt };
})();

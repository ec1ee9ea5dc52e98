// redisq console: refresh the live parts of a page without reloading it.
// Every element with data-live="<block>" is replaced by the same block rendered by the server
// (?fragment=<block>) every data-interval ms, while the tab is visible.
(function () {
  "use strict";
  const banner = document.getElementById("live-error");
  function show(message) {
    if (!banner) return;
    banner.textContent = message;
    banner.classList.toggle("hidden", !message);
  }
  function refresh(section) {
    const block = section.getAttribute("data-live");
    const url = new URL(window.location.href);
    url.searchParams.delete("notice");
    url.searchParams.set("fragment", block);
    return fetch(url, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (response) {
        return response.text().then(function (body) {
          if (response.ok) {
            section.innerHTML = body;
            section.setAttribute("data-refreshed", String(Date.now()));
            show("");
          } else if (response.status === 401) {
            show("Signed out: reload the page to sign in again.");
          } else {
            const doc = new DOMParser().parseFromString(body, "text/html");
            show("Live update failed: " + (doc.body.textContent || response.status).trim());
          }
        });
      })
      .catch(function () { show("Live update failed: the console is not reachable."); });
  }
  document.querySelectorAll("[data-live]").forEach(function (section) {
    const interval = parseInt(section.getAttribute("data-interval") || "2000", 10);
    function tick() {
      const next = function () { window.setTimeout(tick, interval); };
      if (document.hidden) { next(); return; }
      refresh(section).then(next, next);
    }
    window.setTimeout(tick, interval);
  });
})();

// The live tail (/topics/<topic>/tail): poll for what came after the cursor, newest on top,
// keep the newest data-keep messages, stop after data-max-ms or when the page closes.
(function () {
  "use strict";
  const section = document.getElementById("tail");
  if (!section) return;
  const list = document.getElementById("tail-messages");
  const status = document.getElementById("tail-status");
  const counter = document.getElementById("tail-count");
  const toggle = document.getElementById("tail-toggle");
  const interval = parseInt(section.getAttribute("data-interval") || "1000", 10);
  const keep = parseInt(section.getAttribute("data-keep") || "200", 10);
  const maxMs = parseInt(section.getAttribute("data-max-ms") || "900000", 10);
  let cursor = section.getAttribute("data-cursor") || "";
  let running = true;
  let started = Date.now();
  let timer = null;
  let received = 0;
  function say(message) { status.textContent = message; }
  function stop(message) {
    running = false;
    toggle.textContent = "Resume";
    if (timer !== null) { window.clearTimeout(timer); timer = null; }
    say(message);
  }
  function schedule(delay) {
    if (running) timer = window.setTimeout(poll, delay);
  }
  function poll() {
    timer = null;
    if (!running) return;
    if (Date.now() - started > maxMs) { stop("Stopped: a tail runs " + Math.max(1, Math.round(maxMs / 60000)) + " minutes at most; Resume to go on."); return; }
    if (document.hidden) { schedule(interval); return; }
    const url = new URL(section.getAttribute("data-tail"), window.location.href);
    url.searchParams.set("cursor", cursor);
    url.searchParams.set("fragment", "batch");  // an error answers as one line
    fetch(url, { credentials: "same-origin", headers: { "X-Requested-With": "fetch" } })
      .then(function (response) {
        return response.text().then(function (body) {
          const doc = new DOMParser().parseFromString(body, "text/html");
          if (!response.ok) {
            const why = (doc.body.textContent || String(response.status)).trim();
            if (response.status === 404 || response.status === 400 || response.status === 401) {
              stop("Stopped: " + why);
            } else {
              say("Poll failed: " + why); schedule(interval * 3);
            }
            return;
          }
          const batch = doc.querySelector(".tail-batch");
          if (!batch) { stop("Stopped: unexpected answer"); return; }
          cursor = batch.getAttribute("data-cursor") || cursor;
          const articles = Array.from(batch.querySelectorAll("article"));
          articles.forEach(function (article) { list.insertBefore(document.importNode(article, true), list.firstChild); });
          while (list.children.length > keep) list.removeChild(list.lastChild);
          received += articles.length;
          counter.textContent = String(received);
          section.setAttribute("data-polled", String(Date.now()));
          say("Tailing… (last checked " + new Date().toLocaleTimeString() + ")");
          schedule(batch.getAttribute("data-more") === "1" ? 50 : interval);
        });
      })
      .catch(function () { say("Poll failed: the console is not reachable."); schedule(interval * 3); });
  }
  toggle.addEventListener("click", function () {
    if (running) { stop("Paused."); return; }
    running = true; started = Date.now(); toggle.textContent = "Pause"; say("Tailing…"); poll();
  });
  schedule(0);
})();

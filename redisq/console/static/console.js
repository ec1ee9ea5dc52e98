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

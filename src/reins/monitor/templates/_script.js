// Live updates by polling: an element with data-poll-url gets its content replaced every
// data-poll-s seconds while the page's "live" box is ticked; data-version-url reloads the page
// when the version it answers changes (a rollout that is still running). A poll names the tag
// of what the element shows (data-etag, then each answer's ETag): unchanged, the answer is a
// 304 with no body, and the element is left as it is.
(function () {
  const live = document.getElementById("live");
  const isLive = () => !live || live.checked;
  async function fetchText(url, el) {
    const headers = el && el.dataset.etag ? { "If-None-Match": el.dataset.etag } : {};
    const response = await fetch(url, { credentials: "same-origin", headers });
    if (response.redirected || response.status === 401) { window.location.reload(); return null; }
    if (!response.ok) return null;
    if (el) el.dataset.etag = response.headers.get("ETag") || "";
    return response.text();
  }
  document.querySelectorAll("[data-poll-url]").forEach((el) => {
    const every = 1000 * Number(el.dataset.pollS || 5);
    setInterval(async () => {
      if (!isLive() || document.hidden) return;
      const html = await fetchText(el.dataset.pollUrl, el);
      if (html !== null) el.innerHTML = html;
    }, every);
  });
  document.querySelectorAll("[data-version-url]").forEach((el) => {
    const every = 1000 * Number(el.dataset.pollS || 5);
    setInterval(async () => {
      if (!isLive() || document.hidden) return;
      const text = await fetchText(el.dataset.versionUrl);
      if (text === null) return;
      if (JSON.parse(text).version !== el.dataset.version) window.location.reload();
    }, every);
  });
})();

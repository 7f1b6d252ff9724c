// The console's one enhancement: a part marked data-refresh="SECONDS" (the overview's queues) is read again
// that often while the tab is visible. Every page works without this file.
(() => {
  const live = document.querySelector("[data-refresh]");
  if (!live) return;
  const everyMs = Number(live.dataset.refresh) * 1000;
  setInterval(async () => {
    if (document.hidden) return;
    const response = await fetch(location.href, { credentials: "same-origin" });
    if (!response.ok) return;
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    const fresh = page.querySelector("[data-refresh]");
    if (fresh) live.replaceChildren(...fresh.childNodes);
  }, everyMs);
})();

"""The operator console: server-rendered pages under /console, served by the API process itself when
`console_enabled` is set (off by default). Who may see what: api/console/viewer.py; the pages and their
actions: api/console/routes.py; the HTML: templates/ (Jinja2, every value escaped)."""

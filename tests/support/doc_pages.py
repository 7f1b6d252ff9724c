"""The documentation pages whose blocks tests/docs/test_readme.py runs as written (besides the README's
Quickstart and curl session); tests/docs/test_site.py requires every other page with commands to say why its
blocks are not run."""

ENGINE_PAGE = "docs/guides/engine.md"
POSTGRES_REDIS_PAGE = "docs/getting-started/postgres-redis.md"
RUN_PAGES = frozenset({ENGINE_PAGE, POSTGRES_REDIS_PAGE})

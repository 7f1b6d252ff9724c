"""Conveyor: a job queue for asynchronous LLM inference.

The repository root is the `conveyor` import package (pyproject.toml: `package-dir = {"conveyor" = "."}`):
`conveyor.api` is api/, `conveyor.worker` worker/, `conveyor.engine` engine/, `conveyor.kernels` kernels/,
`conveyor.core` core/, `conveyor.cli` cli/, `conveyor.bench` bench/, `conveyor.migrations` migrations/. A
wheel holds them under conveyor/ and nothing else; the tests are not installed. `python -m conveyor` is the
`conveyor` command.

kernels/ has no __init__.py on purpose: from the repository root (the tests, `python -m conveyor`), a regular
package there would be found as the top-level `kernels` before Hugging Face's, which transformers imports.
"""

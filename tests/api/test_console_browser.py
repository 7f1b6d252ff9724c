"""The operator console in a real browser: headless Chromium (Debian's, installed by .ci/browser) driven by
Selenium against a live `conveyor serve` with auth on. An admin signs in, sees a job submitted through the
API appear, opens it, cancels a waiting one through its confirmation page, sees a batch's progress, and the
workers and tenants. A screenshot of each page is kept under test-artifacts/console/
(docs/assets/console-overview.png is the overview's)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import WebDriverWait

from conveyor.core.clock import utcnow
from conveyor.core.store import keys
from conveyor.core.store.migrate import upgrade
from tests.support.fault_stack import REPO_ROOT
from tests.support.fault_store import store_engine
from tests.support.serve import Serve

ARTIFACTS = REPO_ROOT / "test-artifacts" / "console"
# Chromium as root in a container, without the connections it makes on its own (refused here, and slow).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900")
WAIT_S = 30.0


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_path, "chromium and chromedriver are missing: run .ci/browser (make test does)"
    options = Options()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    driver = _started(driver_path, options)
    try:
        yield driver
    finally:
        driver.quit()


def _started(driver_path: str, options: Options) -> WebDriver:
    """Chromium, started once more if its first start fails: a cold start on a loaded machine can miss
    chromedriver's wait for it (DevToolsActivePort)."""
    try:
        return webdriver.Chrome(service=ChromeService(executable_path=driver_path), options=options)
    except WebDriverException:
        return webdriver.Chrome(service=ChromeService(executable_path=driver_path), options=options)


@pytest.fixture
def serve(tmp_path: Path, demo_model_dir: Path) -> Iterator[Serve]:
    with Serve(tmp_path, demo_model_dir, AUTH_ENABLED="true", CONSOLE_ENABLED="true") as server:
        yield server


def new_key(database_url: str, tenant: str, *, admin: bool = False) -> str:
    from sqlalchemy.orm import Session

    with Session(store_engine(database_url)) as session:
        return keys.create_key(session, tenant, utcnow(), admin=admin)[1]


def shot(driver: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def wait_text(driver: WebDriver, text: str) -> None:
    body = (By.TAG_NAME, "body")
    WebDriverWait(driver, WAIT_S).until(expected_conditions.text_to_be_present_in_element(body, text))


def test_an_admin_signs_in_sees_a_job_opens_it_and_cancels_another(serve: Serve, browser: WebDriver,
                                                                   ) -> None:
    upgrade(serve.database_url)
    admin_key = new_key(serve.database_url, "ops", admin=True)
    tenant_key = new_key(serve.database_url, "alice")
    serve.start()
    api = httpx.Client(base_url=serve.url, headers={"Authorization": f"Bearer {tenant_key}"}, timeout=30)
    done = api.post("/v1/jobs", json={"prompt": "<b>bold?</b> The river is calm", "max_tokens": 4}).json()
    later = api.post("/v1/jobs", json={"prompt": "Good night", "max_tokens": 4, "delay_s": 3600}).json()

    browser.get(f"{serve.url}/console")
    assert browser.current_url.endswith("/console/sign-in")
    browser.find_element(By.NAME, "key").send_keys(admin_key)
    browser.find_element(By.CSS_SELECTOR, "form[action='/console/sign-in'] button").click()
    wait_text(browser, "every tenant")
    assert "interactive" in browser.find_element(By.TAG_NAME, "table").text
    shot(browser, "overview")

    browser.get(f"{serve.url}/console/jobs")
    wait_text(browser, done["id"])
    shot(browser, "jobs")
    browser.find_element(By.LINK_TEXT, done["id"]).click()
    wait_text(browser, "Prompt")
    assert "<b>bold?</b> The river is calm" in browser.find_element(By.TAG_NAME, "pre").text  # as text
    assert not browser.find_elements(By.CSS_SELECTOR, "pre b")
    shot(browser, "job")

    browser.get(f"{serve.url}/console/jobs/{later['id']}")
    browser.find_element(By.LINK_TEXT, "Cancel…").click()
    wait_text(browser, f"Cancel job {later['id']}?")
    browser.find_element(By.CSS_SELECTOR, "form button[type='submit']:not(header button)").click()
    wait_text(browser, "cancelled")
    shot(browser, "cancelled")
    assert api.get(f"/v1/jobs/{later['id']}").json()["status"] == "cancelled"


    batch = api.post("/v1/batches", json={"input": "s3://nightly/in.jsonl", "output": "s3://nightly/out/",
                                          "delay_s": 3600}).json()
    browser.get(f"{serve.url}/console/batches")
    wait_text(browser, batch["id"])
    assert browser.find_elements(By.TAG_NAME, "progress")
    shot(browser, "batches")
    browser.find_element(By.LINK_TEXT, batch["id"]).click()
    wait_text(browser, "line(s)")
    shot(browser, "batch")
    browser.get(f"{serve.url}/console")  # the queues refresh themselves (static/console.js)
    queues = browser.find_element(By.CSS_SELECTOR, "[data-refresh]")
    before = queues.text
    api.post("/v1/jobs", json={"prompt": "Later again", "max_tokens": 4, "delay_s": 3600})
    WebDriverWait(browser, WAIT_S).until(
        lambda driver: driver.find_element(By.CSS_SELECTOR, "[data-refresh]").text != before)
    for name in ("workers", "tenants"):
        browser.get(f"{serve.url}/console/{name}")
        wait_text(browser, "alice" if name == "tenants" else "live")
        shot(browser, name)

"""The report in a real headless browser (Chromium from the system's packages, driven by selenium): the page loads
without console errors and every plot is drawn. A screenshot is kept as a test artifact (its path is printed and
recorded as the test's ``screenshot`` property).

Needs ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium chromium-driver``; ``.ci/run`` installs
them). Without them the test is skipped on a workstation and fails in CI (``CI`` set)."""

from __future__ import annotations

import os
import shutil

import pytest
from run_folders import write_run

from raytrain_eks.report.html import write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromedriver are missing in CI: .ci/run installs them with apt-get")
        pytest.skip("needs chromium and chromedriver: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,4000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def test_report_page_loads_cleanly_and_shows_every_plot(tmp_path, browser, record_property):
    runs = [
        write_run(tmp_path / "efa", fabric={"require": "efa", "verdict": "efa", "met": True, "report": "EFA"}),
        write_run(tmp_path / "tcp", steps=40),
    ]
    page = write_report(runs, tmp_path / "report")
    browser.get(page.as_uri())
    assert browser.title.startswith("raytrain-eks report")
    images = browser.execute_script(
        "return Array.from(document.images)"
        ".map(i => [i.alt, i.complete, i.naturalWidth, i.getBoundingClientRect().height])"
    )
    assert len(images) == 7
    assert all(complete and width > 0 and height > 0 for _, complete, width, height in images), images
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    shot = tmp_path / "report-screenshot.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    record_property("screenshot", str(shot))
    print(f"screenshot: {shot}")

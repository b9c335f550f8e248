"""The HTML report opened in headless Chromium (Debian's chromium and chromium-driver, which
``make`` installs): every figure loads and the console shows no error, offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from silodp.config import parse_config
from silodp.experiment import run_experiment
from silodp.html_report import write_report

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")


@pytest.mark.slow
def test_report_loads_in_chromium_without_console_errors(tmp_path: Path) -> None:
    assert CHROMIUM and DRIVER, (
        "Debian's chromium and chromium-driver are needed (make installs them)"
    )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    config = {
        "name": "browser",
        "algorithms": ["fedavg", "local_item_dp"],
        "data": {"source": "digits", "num_silos": 3, "num_subjects": 30, "max_records": 300},
        "model": {"name": "mlp"},
        "training": {"rounds": 2, "local_steps": 2, "batch_size": 32, "lr": 0.5},
        "privacy": {"noise_multiplier": 1.5, "group_size": 3},
    }
    run_experiment(parse_config(config), tmp_path / "run")
    page = write_report(tmp_path / "run", tmp_path / "report.html")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--proxy-server=127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND",
    ):
        options.add_argument(flag)  # no network: the page must need none
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        driver.get(page.resolve().as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.alt])"
        )
        assert len(images) >= 5
        assert all(done and width > 0 for done, width, _ in images), images
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        assert driver.title == "browser"
    finally:
        driver.quit()

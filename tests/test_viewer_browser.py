"""`tamer demo` then `tamer view`, opened in a real headless Chromium: filter, expand, screenshot.

Needs Debian's browser and driver (`apt-get install -y chromium chromium-driver`) and the
`browser` extra (`pip install -e ".[browser]"`: selenium, used only to drive the browser; no
driver is downloaded). Set TAMER_SCREENSHOT_DIR to keep the screenshots (CI artifacts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("Chromium is not installed: apt-get install -y chromium chromium-driver", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason='selenium is missing: pip install -e ".[browser]"')
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

from tests.test_viewer import TINY_DEMO  # noqa: E402


def tamer(*args: str, cwd: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tamer.cli", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=900, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """`tamer demo` (tiny) then `tamer view runs/demo`, as a user types them."""
    cwd = tmp_path_factory.mktemp("browser")
    tamer("demo", "-o", "runs/demo", *TINY_DEMO, cwd=cwd)
    tamer("view", "runs/demo", cwd=cwd)
    return cwd / "runs" / "demo" / "view.html"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def count(driver) -> tuple[int, int]:
    words = driver.find_element(By.ID, "count").text.split()  # "N trajectories in M groups (of K saved)"
    return int(words[0]), int(words[3])


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    out = Path(os.environ.get("TAMER_SCREENSHOT_DIR") or tmp_path) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(out))
    assert out.stat().st_size > 10_000  # a rendered page, not a blank image
    return out


def test_page_loads_filters_expands_and_plots(page, browser, tmp_path):
    data = json.loads(page.read_text().split('<script id="tamer-data" type="application/json">')[1]
                      .split("</script>")[0])
    rollouts = data["rollouts"]
    browser.get(page.as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []

    # Opens on the last training step: its saved groups, side by side.
    last = max(r["step"] for r in rollouts if r["kind"] == "train")
    shown = [r for r in rollouts if r["kind"] == "train" and r["step"] == last]
    assert count(browser) == (len(shown), len({r["group"] for r in shown}))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups .group")) == len({r["group"] for r in shown})
    rewards = [float(t.get_attribute("data-reward")) for t in
               browser.find_elements(By.CSS_SELECTOR, "#groups .group:first-child .traj")]
    assert rewards == sorted(rewards, reverse=True)  # best attempt first

    # Filter: every step, reward at least the median distinct one, then truncated only.
    Select(browser.find_element(By.ID, "filter-step")).select_by_value("all")
    train = [r for r in rollouts if r["kind"] == "train"]
    distinct = sorted({r["reward"] for r in train})
    threshold = distinct[len(distinct) // 2]  # the median distinct reward: above the lowest
    browser.find_element(By.ID, "filter-rmin").send_keys(repr(threshold))
    kept = [r for r in train if r["reward"] >= threshold]
    assert count(browser)[0] == len(kept) < len(train)
    browser.find_element(By.ID, "filter-truncated").click()
    assert count(browser)[0] == sum(r["truncated"] for r in kept)
    browser.find_element(By.ID, "filter-truncated").click()
    browser.find_element(By.ID, "filter-rmin").clear()
    browser.find_element(By.ID, "filter-rmin").send_keys("0")  # fires input; back to a known set below
    Select(browser.find_element(By.ID, "filter-kind")).select_by_value("eval")
    evals = [r for r in rollouts if r["kind"] == "eval" and r["phase"] == "rl"]
    last_eval = max(r["step"] for r in evals)
    assert count(browser)[0] == sum(r["step"] == last_eval and r["reward"] >= 0 for r in evals)
    Select(browser.find_element(By.ID, "filter-kind")).select_by_value("train")
    browser.find_element(By.ID, "filter-rmin").clear()
    browser.find_element(By.ID, "filter-rmin").send_keys("-1e9")

    # Expand the first attempt: its tokens, trained ones highlighted, and its reward breakdown.
    first = browser.find_element(By.CSS_SELECTOR, "#groups .traj")
    first.find_element(By.CSS_SELECTOR, ".head").click()
    assert "expanded" in first.get_attribute("class")
    trained = first.find_elements(By.CSS_SELECTOR, ".tok.trained")
    generated = int(first.find_element(By.CSS_SELECTOR, ".head .muted").text.split()[0])  # "N tok"
    assert len(trained) == generated > 0
    assert trained[0].value_of_css_property("background-color") != first.find_element(
        By.CSS_SELECTOR, ".head").value_of_css_property("background-color")
    breakdown = first.find_element(By.CSS_SELECTOR, "table.reward-breakdown").text
    assert "correctness" in breakdown and "length" in breakdown
    shot = screenshot(browser, tmp_path, "view_rollouts.png")

    # Curves: accuracy with the demonstrator and SFT levels dashed.
    browser.find_element(By.ID, "tab-curves").click()
    assert not browser.find_element(By.ID, "page-curves").get_attribute("class").count("hidden")
    chart = browser.find_element(By.CSS_SELECTOR, 'svg.chart[data-key="eval/accuracy"]')
    labels = {line.get_attribute("data-label") for line in chart.find_elements(By.CSS_SELECTOR, "line.baseline")}
    assert labels == {"demonstrator", "SFT"}
    assert browser.find_elements(By.CSS_SELECTOR, 'svg.chart[data-key="reward/mean"] polyline.series')
    screenshot(browser, tmp_path, "view_curves.png")
    assert shot.exists()
